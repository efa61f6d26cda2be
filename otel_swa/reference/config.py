"""The reference engine's configuration and the default replay, importable without torch.

:class:`EngineConfig` (re-exported by :mod:`otel_swa.reference.engine`) and :class:`ReplayDefaults`,
:data:`DEFAULT_REPLAY`, :data:`ARRIVALS` (re-exported by :mod:`otel_swa.reference.replay`) live here
so that ``otel-swa`` can build its argument parser, whose defaults they are, without importing torch
(about 1.5 s and 200 MB); only running the engine imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineConfig", "ReplayDefaults", "DEFAULT_REPLAY", "ARRIVALS"]


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and policy of the reference engine.

    Attributes:
        window: sliding window of the SWA layer, in tokens.
        full_pool_size: usable FULL slots (a multiple of ``page_size``).
        swa_pool_size: usable SWA slots (a multiple of ``page_size``).
        page_size: slots per page in both pools.
        max_running: the most requests in one forward step.
        token_budget: the most new tokens in one forward step (>= ``max_running``).
        max_context_len: the longest request in tokens (prompt + output - 1).
        seed: seed of the model weights and the prompt token ids.
        step_time_s: virtual seconds per forward step.
        vocab_size, num_heads, head_dim: model sizes.
        run_model: ``False`` skips the attention math (slot allocation, the tables, eviction and
            the reporter calls are unchanged; every generated token id is then 0): for checks
            and benchmarks of the KV cache bookkeeping alone.
        read_check: with a reporter and the model, the reporter's read check
            (:mod:`otel_swa.device.read_check`) recomputes the sliding-window layer's output for
            ``read_check_queries`` requests at each sampled step: ``"rotate"`` or ``"all"`` (one
            sliding-window layer here: the same), ``"off"``: no check.
        read_check_queries: queries checked per sampled step (>= 1).
        provenance: with a reporter and the model, the engine writes provenance stamps and content
            checksums at every KV write, runs the write check at sampled steps and gives its
            requests' token ids in its view (:mod:`otel_swa.device.provenance`): ``"all"`` (the
            checksum of every byte of both layers' K and V rows), ``"prefix"`` (each K and V row's
            first 64 bytes of the first layer of each pool), ``"off"``: none of it.
        provenance_budget: live slots verified per pool and sampled step (>= 1).

    Raises:
        ValueError: a value is out of range (the message names it).
    """

    window: int = 128
    full_pool_size: int = 65536
    swa_pool_size: int = 8192
    page_size: int = 1
    max_running: int = 48
    token_budget: int = 1024
    max_context_len: int = 16384
    seed: int = 0
    step_time_s: float = 0.05
    vocab_size: int = 128
    num_heads: int = 1
    head_dim: int = 16
    run_model: bool = True
    read_check: str = "rotate"
    read_check_queries: int = 8
    provenance: str = "all"
    provenance_budget: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "window", "full_pool_size", "swa_pool_size", "page_size", "max_running", "token_budget",
            "max_context_len", "vocab_size", "num_heads", "head_dim", "read_check_queries", "provenance_budget",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r}; expected an integer >= 1")
        for name in ("full_pool_size", "swa_pool_size"):
            if getattr(self, name) % self.page_size:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} is not a multiple of page_size={self.page_size}")
        if self.token_budget < self.max_running:
            raise ValueError(f"EngineConfig.token_budget={self.token_budget} is below max_running={self.max_running}")
        if self.read_check not in ("rotate", "all", "off"):
            raise ValueError(f"EngineConfig.read_check={self.read_check!r}; expected rotate, all or off")
        if self.provenance not in ("all", "prefix", "off"):
            raise ValueError(f"EngineConfig.provenance={self.provenance!r}; expected all, prefix or off")
        if not self.step_time_s >= 0:
            raise ValueError(f"EngineConfig.step_time_s={self.step_time_s!r}; expected a number >= 0")



#: How arrival times are used: all requests at t=0, or the trace's times divided by ``time_scale``.
ARRIVALS = ("ignore", "compress")


@dataclass(frozen=True)
class ReplayDefaults:
    """The default main job (described in :mod:`otel_swa.reference.replay`).

    Attributes:
        trace: packaged trace name or path (for :func:`otel_swa.reference.trace.load_trace`).
        limit: number of requests taken from the start of the trace (``None`` = all).
        interval: the reporter's sampling interval in forward steps.
        arrivals: one of :data:`ARRIVALS`.
        time_scale: arrival times are divided by this when ``arrivals == "compress"``.
        config: the engine configuration.
    """

    trace: str = "conv"
    limit: int | None = 200
    interval: int = 20
    arrivals: str = "ignore"
    time_scale: float = 10.0
    config: EngineConfig = field(default_factory=EngineConfig)


DEFAULT_REPLAY = ReplayDefaults()
