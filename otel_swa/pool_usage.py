"""How full each KV cache pool is: the host-side figures an engine keeps, in tokens.

No torch and no OpenTelemetry here: a :class:`PoolUsage` is plain host integers, built by an engine
adapter (``otel_swa.views.sglang``, ``otel_swa.views.vllm``, the reference engine's pools) and read
by the telemetry's observable gauges (:mod:`otel_swa.telemetry.pools`) at collection time.

The four counts follow SGLang's accounting (sglang 0.5.23,
``managers/scheduler_components/pool_stats_observer.py``, exported there as the Prometheus gauges
``kv_/swa_ used/available/evictable _tokens``)::

    used = total - available - evictable        usage = used / total

``available``: free slots, handed out at the next allocation; ``evictable``: slots that hold KV
only the prefix cache keeps (no running request reads them), freed when the cache evicts them;
``used``: the slots running requests (and anything else that pins them) hold; ``total``: the pool's
size. An engine whose pool is shared by several KV cache groups (vLLM's one ``BlockPool``) reports
each group kind as a pool: ``available`` and ``total`` are then the shared pool's, the same in
each, and ``used`` / ``evictable`` are the blocks of that kind's groups (see
:func:`otel_swa.views.vllm.kv_cache_pool_usage`).

A source of pool usage (what the instrumentors register) is a callable returning a sequence of
:class:`PoolUsage`, one per pool, or ``None`` when the engine cannot say at that moment; it must do
host work only (no device sync), and is called outside the forward path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["PoolUsage", "PoolUsageSource", "POOLS", "POOL_FULL", "POOL_SWA"]

#: The pool of the full-attention layers.
POOL_FULL = "full"
#: The pool of the sliding-window layers.
POOL_SWA = "swa"
#: The pool names a :class:`PoolUsage` may carry (the ``pool`` attribute of the telemetry).
POOLS = (POOL_FULL, POOL_SWA)

#: A zero-argument callable giving the pools' usage now (host ints), or ``None`` when unknown.
PoolUsageSource = Callable[[], Optional[Sequence["PoolUsage"]]]


@dataclass(frozen=True)
class PoolUsage:
    """One KV cache pool at one moment, in tokens (KV slots; host ints).

    Attributes:
        pool: ``"full"`` or ``"swa"`` (:data:`POOLS`).
        used: slots held by running requests (``total - available - evictable`` for a pool of its
            own; less in a shared pool, whose other groups hold the rest).
        available: free slots.
        evictable: slots whose KV only the prefix cache holds (0 without a prefix cache).
        total: the pool's size in slots.

    Raises:
        ValueError: ``pool`` is not one of :data:`POOLS`, a count is not an integer >= 0, or
            ``used + available + evictable`` exceeds ``total`` (the message names the values).
    """

    pool: str
    used: int
    available: int
    evictable: int
    total: int

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"PoolUsage.pool={self.pool!r}; expected one of {', '.join(POOLS)}")
        for name in ("available", "evictable", "total", "used"):
            _check_count(self.pool, name, getattr(self, name))
        _check_free(self.pool, self.total, self.available, self.evictable)
        if self.used > self.total - self.available - self.evictable:
            raise ValueError(
                f"PoolUsage of pool {self.pool}: used {self.used} + available {self.available} + evictable "
                f"{self.evictable} exceed total {self.total}"
            )

    @classmethod
    def from_free(cls, pool: str, *, total: int, available: int, evictable: int = 0) -> "PoolUsage":
        """The usage of a pool whose engine counts free and evictable slots: ``used`` is the rest,
        ``total - (available + evictable)``, as SGLang computes it.

        Raises:
            ValueError: see the class (``available + evictable > total`` would make ``used``
                negative).
        """
        for name, value in (("available", available), ("evictable", evictable), ("total", total)):
            _check_count(pool, name, value)
        _check_free(pool, total, available, evictable)
        return cls(pool, total - available - evictable, available, evictable, total)

    @property
    def usage(self) -> float | None:
        """``used / total`` (a ratio in [0, 1]); ``None`` for an empty pool (``total == 0``)."""
        return self.used / self.total if self.total else None


def _check_count(pool: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"PoolUsage.{name}={value!r} for pool {pool!r}; expected an integer >= 0")


def _check_free(pool: str, total: int, available: int, evictable: int) -> None:
    if available + evictable > total:
        raise ValueError(
            f"PoolUsage of pool {pool!r}: available {available} + evictable {evictable} exceed total {total}"
        )
