"""Replay a request trace through the reference engine: the main job behind ``otel-swa replay``.

``DEFAULT_REPLAY`` is the run with no options: the first 200 requests of the conversation trace,
all arriving at once, through :class:`~otel_swa.reference.engine.EngineConfig` defaults (window 128
tokens, a 65,536-slot FULL pool, an 8,192-slot SWA pool, page size 1, up to 48 running requests,
1,024 tokens per forward step). Prompts of that slice are up to 4,107 tokens long, so tokens leave
the window in every long request, the SWA pool is recycled many times over, and the SWA slot of a
token soon differs from its FULL slot: with the reporter sampling every 20 forward steps the run
shows divergence >= 1, out-of-window tokens >= 1 and ``verify_swa < verify_full``.

Example::

    from otel_swa.reference.replay import DEFAULT_REPLAY, replay
    from otel_swa.reference.trace import load_trace

    summary = replay(load_trace(DEFAULT_REPLAY.trace, DEFAULT_REPLAY.limit), DEFAULT_REPLAY.config)
    print(summary.forward_steps, summary.requests_finished, summary.wall_s)
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

from otel_swa.reference.config import ARRIVALS, DEFAULT_REPLAY, EngineConfig, ReplayDefaults
from otel_swa.reference.engine import BatchInfo, EngineStats, ReferenceEngine
from otel_swa.reference.scheduler import RequestTooLargeError
from otel_swa.reference.trace import TraceRequest

__all__ = ["ReplayDefaults", "DEFAULT_REPLAY", "ReplaySummary", "ReplayInterrupted", "SkippedRequest", "replay", "ARRIVALS"]

_log = logging.getLogger("otel_swa.reference.replay")

#: Skipped requests logged one by one (logger ``otel_swa.reference.replay``, WARNING); the rest are
#: counted in one line at the end of the submission.
LOGGED_SKIPS = 5


@dataclass(frozen=True)
class SkippedRequest:
    """A request of the trace that can never run with the engine's configuration.

    Attributes:
        index: its position in the trace (0-based).
        reason: why, naming the request and the size it exceeds (``max_context_len`` or a pool).
    """

    index: int
    reason: str

@dataclass(frozen=True)
class ReplaySummary:
    """The outcome of a replay.

    Attributes:
        forward_steps: forward steps the engine ran.
        requests_total, requests_finished: requests submitted and finished (skipped requests are
            not submitted).
        skipped: the requests of the trace that could not fit, in trace order.
        wall_s: wall-clock seconds of the replay (engine steps and reporter work, not trace loading).
        virtual_s: the engine's virtual clock at the end, in seconds.
        peak_full_slots, peak_swa_slots: most slots in use per pool (whole pages x page size).
        full_pool_size, swa_pool_size: the pool sizes, in slots.
        engine: the engine's cumulative statistics.
    """

    forward_steps: int
    requests_total: int
    requests_finished: int
    wall_s: float
    virtual_s: float
    peak_full_slots: int
    peak_swa_slots: int
    full_pool_size: int
    swa_pool_size: int
    engine: EngineStats
    skipped: tuple[SkippedRequest, ...] = ()

    @property
    def requests_skipped(self) -> int:
        """Requests of the trace that could not fit and were skipped."""
        return len(self.skipped)

    def skipped_line(self) -> str:
        """The summary's ``requests skipped`` value: ``0``, or the count and the first reason
        (requests are numbered by their position in the trace, from 0)."""
        if not self.skipped:
            return "0"
        return f"{len(self.skipped)} (too long for this engine; first: {self.skipped[0].reason})"


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def replay(
    requests: Iterable[TraceRequest],
    config: EngineConfig | None = None,
    reporter: Any = None,
    *,
    progress: bool = False,
    arrivals: str = "ignore",
    time_scale: float = 1.0,
    device: "str | torch.device" = "cpu",
    forward_span: "Callable[[BatchInfo], ContextManager[Any]] | None" = None,
    num_threads: int | None = 1,
    on_submit: "Callable[[Any, TraceRequest], None] | None" = None,
    on_step: "Callable[[Any], None] | None" = None,
    on_engine: "Callable[[ReferenceEngine], None] | None" = None,
) -> ReplaySummary:
    """Run ``requests`` through a fresh :class:`ReferenceEngine` until all have finished.

    The reporter, when given, is flushed at the end (its last samples are delivered) but not
    closed: the caller owns it.

    A request that can never run with ``config`` (more KV positions than ``max_context_len``, or a
    reservation larger than a pool: :class:`~otel_swa.reference.scheduler.RequestTooLargeError`)
    is skipped, not submitted: it is listed in ``ReplaySummary.skipped`` and the first
    :data:`LOGGED_SKIPS` are logged as warnings (logger ``otel_swa.reference.replay``), then one
    line counts the others. The other requests run as usual.

    Args:
        requests: the trace (e.g. from :func:`otel_swa.reference.trace.load_trace`).
        config: engine configuration (``EngineConfig()`` when ``None``).
        reporter: an ``otel_swa.reporter.SwaDivergenceReporter`` on ``device`` or ``None``.
        progress: show a tqdm progress bar of finished requests (on stderr).
        arrivals: ``"ignore"`` (all at t=0) or ``"compress"`` (arrival at ``arrival_s /
            time_scale`` on the virtual clock, which advances ``config.step_time_s`` per step).
        time_scale: compression factor for ``arrivals="compress"`` (> 0).
        device: where the engine lives.
        forward_span: installed as the engine's ``forward_span`` hook when given.
        on_submit: called as ``on_submit(state, request)`` after each request is queued (``state``
            is the engine's ``RequestState``; ``state.rid`` is the id forward steps report), e.g.
            to start the request's span.
        on_step: called with each forward step's ``StepResult`` (``result.finished`` holds the ids
            of the requests that finished in it), e.g. to end request spans.
        num_threads: torch intra-op threads during the replay (restored afterwards); ``None``
            leaves the setting alone. The reference model's operations are small, and on a busy
            machine extra threads cost more in synchronisation than they save, hence 1.

        on_engine: called with the new engine before any request is submitted (e.g. to register
            its pools with the telemetry: ``PoolMetrics.register(..., owner=engine)``).

    Raises:
        ValueError: unknown ``arrivals`` or ``time_scale <= 0``, or a request with negative
            token counts.
    """
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals={arrivals!r}; expected one of {', '.join(ARRIVALS)}")
    if not time_scale > 0:
        raise ValueError(f"time_scale={time_scale!r}; expected a number > 0")
    engine = ReferenceEngine(config, reporter=reporter, device=device)
    if forward_span is not None:
        engine.forward_span = forward_span
    if on_engine is not None:
        on_engine(engine)
    skipped: list[SkippedRequest] = []
    for index, request in enumerate(requests):
        try:
            state = engine.submit(request, arrival_s=0.0 if arrivals == "ignore" else request.arrival_s / time_scale,
                                  rid=index)
        except RequestTooLargeError as exc:
            skipped.append(SkippedRequest(index, str(exc)))
            if len(skipped) <= LOGGED_SKIPS:
                _log.warning("skipped, cannot fit: %s", exc)
            continue
        if on_submit is not None:
            on_submit(state, request)
    if len(skipped) > LOGGED_SKIPS:
        _log.warning("skipped %d more request(s) that cannot fit (%d in all)", len(skipped) - LOGGED_SKIPS, len(skipped))
    total = engine.stats.submitted
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc="replay", leave=False)
    start = time.perf_counter()
    try:
        with _torch_threads(num_threads):
            while True:
                result = engine.step()
                if result is None:
                    break
                if on_step is not None:
                    on_step(result)
                if bar is not None and result.finished:
                    bar.update(len(result.finished))
            if reporter is not None:
                reporter.flush()
    except KeyboardInterrupt as exc:  # the summary so far goes with it (the reporter is not flushed)
        raise ReplayInterrupted(_summary(engine, total, time.perf_counter() - start, skipped)) from exc
    finally:
        if bar is not None:
            bar.close()
    return _summary(engine, total, time.perf_counter() - start, skipped)


class ReplayInterrupted(KeyboardInterrupt):
    """A Ctrl-C (or another ``KeyboardInterrupt``) stopped :func:`replay` between forward steps.

    Attributes:
        summary: the :class:`ReplaySummary` of the forward steps run until then.
    """

    def __init__(self, summary: ReplaySummary) -> None:
        super().__init__(f"interrupted after forward step {summary.forward_steps}")
        self.summary = summary


def _summary(engine: Any, total: int, wall: float, skipped: list) -> ReplaySummary:
    stats = engine.stats
    return ReplaySummary(
        forward_steps=stats.forward_steps,
        requests_total=total,
        requests_finished=stats.finished_requests,
        wall_s=wall,
        virtual_s=engine.clock_s,
        peak_full_slots=stats.peak_full_slots,
        peak_swa_slots=stats.peak_swa_slots,
        full_pool_size=engine.config.full_pool_size,
        swa_pool_size=engine.config.swa_pool_size,
        engine=stats,
        skipped=tuple(skipped),
    )
