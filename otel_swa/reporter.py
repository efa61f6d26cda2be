"""The SWA divergence reporter: ties the device accumulator, the sample, its checks and the
device-to-host ring to the host-side record and its sinks.

Data path::

    forward ── observe(pool, count) ──▶ device int64[2] accumulator (in place, graph-safe)
    step(view) ── every `interval` forwards ──▶ the sample and every check staged on the current
               stream (otel_swa.sampling) ──▶ async copy into a preallocated (pinned) host ring slot + event
    later step() / flush() ── event.query(), in order ──▶ SwaDivergenceRecord ──▶ sink(record, context)
                                                         (otel_swa.delivery)

Compared with SGLang's reporter (sgl-project/sglang PR #26820): the host ring is preallocated, the
host polls instead of blocking, the gather covers only live tokens when the engine knows its
sequence lengths on the host, the batch is read at the step it describes, and ``flush()``/``close()``
deliver the last samples instead of losing them. The checks inside the forward and their sampling
decision: :mod:`otel_swa.reporter_checks`; the reporter's health: :mod:`otel_swa.reporter_health`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Mapping

import torch

import otel_swa.device as device_kernels
from otel_swa import config
from otel_swa.checks import default_parts
from otel_swa.delivery import SampleQueue
from otel_swa.device import KVPool, PoolAccumulator
from otel_swa.device.gate import GRAPH_MODES, SamplingGate
from otel_swa.record import VERIFY_SOURCES, SwaDivergenceRecord
from otel_swa.reporter_checks import InForwardChecks, check_micro_batch
from otel_swa.reporter_health import ReporterHealth, ReporterStats
from otel_swa.views.base import SwaBatchView, validate_view

try:  # opentelemetry-api is a dependency; the reporter itself only needs its context object.
    from opentelemetry import context as _otel_context
except ImportError:  # pragma: no cover - exercised only without opentelemetry-api
    _otel_context = None

__all__ = ["SwaDivergenceReporter", "ReporterStats", "KVPool", "Sink"]

_log = logging.getLogger("otel_swa.reporter")

#: A sink receives each delivered record with the OpenTelemetry context that was current at the
#: forward step where the sample was taken (``None`` when no context is known).
Sink = Callable[[SwaDivergenceRecord, Any], None]


class SwaDivergenceReporter(InForwardChecks, ReporterHealth):
    """Samples an engine's SWA KV cache every ``interval`` forward steps and delivers records.

    Args:
        interval: sample at forward counts that are non-zero multiples of this (int >= 1). Use
            :meth:`from_env` to honour the environment gate, where 0 means off.
        device: the device of the engine's KV cache tensors (``"cpu"``, ``"cuda:0"``...).
        ring_size: host ring slots (int >= 1); samples in flight at once.
        sinks: callables ``sink(record, context)``; more with :meth:`add_sink`. A sink that has a
            ``flush()`` method gets it called by :meth:`flush` (after the records), and one with
            ``reset_after_fork()`` by :meth:`reset_after_fork`.
        verify_source: what the counts given to :meth:`observe` are, carried by every record
            (:data:`otel_swa.record.VERIFY_SOURCES`): ``"attention"`` (default: the KV entries
            attention read) or ``"kv_canary"`` (the entries SGLang's KV canary verified).
        micro_batches: under pipeline parallelism (``step(view, micro_batch=i)``), which
            micro-batches a sampling step samples (:data:`otel_swa.config.MICRO_BATCH_MODES`):
            ``"one"`` (default, SGLang's behaviour): the forward step whose ``forward_ct`` is a
            multiple of ``interval``, whichever micro-batch it ran; ``"every"``: that step, then
            each following forward step whose micro-batch has not been sampled since, until a
            micro-batch comes round again (the pipeline's whole round: one record per micro-batch,
            each at its own ``forward_ct``). A step without a micro-batch index ends the round.
        liveness_steps: forward steps without a delivered sample after which the reporter gives
            its liveness warning once (:meth:`liveness_warning`; checked at the sampling steps):
            ``None`` (default) 10 intervals (:data:`otel_swa.config.DEFAULT_LIVENESS_INTERVALS`),
            0 never.
        audit_budget: free-list ids or SWA page cells the SWA slot audit reads per sample beyond
            the holders (int >= 1; default :data:`~otel_swa.device.audit.AUDIT_BUDGET` on the CPU,
            :data:`~otel_swa.device.audit.AUDIT_BUDGET_CUDA` on CUDA): a larger
            pool is audited in passes over several samples, each pass's record carrying the audit
            of the pool at the pass's first sample (:class:`~otel_swa.device.audit.SwaAuditSweep`,
            whose docstring gives the bound on how many samples a fault can stay unseen).
        graph_mode: how checks recorded into a CUDA graph take the sampling flag at each replay
            (:data:`otel_swa.device.gate.GRAPH_MODES`): ``"masked"`` (default: they run at every
            replay, their counts masked) or ``"conditional"`` (in a conditional node, run only at
            sampled replays; CUDA 12.4 or later, else as ``"masked"``).

    Raises:
        ValueError: ``interval``, ``ring_size`` or ``audit_budget`` below 1 or not an int; an unknown
            ``verify_source``, ``micro_batches`` or ``graph_mode``; ``liveness_steps`` not ``None`` nor an int >= 0; a
            CUDA ``device`` where torch has no CUDA device (a CPU build, no GPU visible).

    Liveness: a reporter on and not working says so (:mod:`otel_swa.reporter_health`; the line
    sinks write ``otel_swa_liveness=``, the telemetry sink an event).

    CUDA graphs. Every entry point may be called while the current stream captures a graph:
    ``observe`` with a device tensor is captured (each replay adds), ``step`` is ignored and counted
    in ``stats.skipped_captures`` (a captured forward has not run; call ``step`` after each replay,
    outside capture), ``flush`` and ``close`` do nothing there (they would wait on events, which
    capture forbids) and log it once. Nothing polls or synchronises inside capture.

    Use::

        reporter = SwaDivergenceReporter.from_env(device="cuda:0", sinks=[my_sink])
        ...
        # inside the forward (graph-safe):
        reporter.observe(KVPool.FULL, full_entries_tensor)
        reporter.observe(KVPool.SWA, swa_entries_tensor)
        # once per forward step, after it:
        reporter.step(view)
        ...
        reporter.close()   # delivers every pending sample
    """

    def __init__(
        self,
        interval: int,
        *,
        device: "str | torch.device" = "cpu",
        ring_size: int = config.DEFAULT_RING_SIZE,
        sinks: Iterable[Sink] = (),
        verify_source: str = "attention",
        micro_batches: str = config.MICRO_BATCH_MODES[0],
        liveness_steps: "int | None" = None,
        audit_budget: "int | None" = None,
        graph_mode: str = GRAPH_MODES[0],
    ) -> None:
        if type(interval) is not int or interval < 1:
            raise ValueError(f"interval must be an int >= 1 (forward steps between samples), got {interval!r}")
        if verify_source not in VERIFY_SOURCES:
            raise ValueError(f"verify_source must be one of {', '.join(VERIFY_SOURCES)}, got {verify_source!r}")
        if micro_batches not in config.MICRO_BATCH_MODES:
            raise ValueError(
                f"micro_batches must be one of {', '.join(config.MICRO_BATCH_MODES)}, got {micro_batches!r}"
            )
        if liveness_steps is None:
            liveness_steps = config.DEFAULT_LIVENESS_INTERVALS * interval
        if type(liveness_steps) is not int or liveness_steps < 0:
            raise ValueError(f"liveness_steps must be None or an int >= 0 (forward steps), got {liveness_steps!r}")
        self.interval = interval
        self.liveness_steps = liveness_steps
        self.verify_source = verify_source
        self.micro_batches = micro_batches
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r}: no CUDA device here (torch {torch.__version__}, "
                "torch.cuda.is_available() is False); give the KV cache's device, e.g. device='cpu'"
            )
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" names the current device; tensors made there report "cuda:N", so the index is
            # fixed here, once, for every device comparison that follows
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cuda = self.device.type == "cuda"
        self._accumulator = PoolAccumulator(self.device)
        #: the checks' device parts by check name (otel_swa.checks): the slot audit's sweep from the
        #: start, the read check, provenance and the write check once the engine switches them on
        self._parts: "dict[str, Any]" = default_parts(device_kernels, self.device, audit_budget=audit_budget)
        self._queue = SampleQueue(self.device, ring_size, self._parts, sinks)
        self._gate = SamplingGate(self.device, graph_mode=graph_mode)
        self._other_gates: "list[SamplingGate]" = []  # gates on other devices that before_forward sets
        self._liveness_hook: "str | None" = None  # set by expect_steps_from
        self._init_state()

    def _init_state(self) -> None:
        self._forward_ct = 0
        self._closed = False
        self._skipped_captures = 0
        self._capture_warned = False
        self._delivered_at = 0  # forward_ct when the last sample was delivered
        self._silence_reported = False  # a liveness warning was given for the silence under way
        self._liveness_warnings = 0
        # micro-batches sampled since the last interval step (micro_batches="every"), or None
        self._round: "set[int] | None" = None
        # Held while the ring and the pending queue change (sampling, delivery, flush), so that a
        # close() from another thread (an uninstrument, a finaliser) cannot race the engine's step().
        # Plain steps with nothing pending never take it.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ construction from the gate
    @classmethod
    def from_env(
        cls,
        *,
        device: "str | torch.device" = "cpu",
        sinks: Iterable[Sink] = (),
        environ: Mapping[str, str] | None = None,
        verify_source: str = "attention",
    ) -> "SwaDivergenceReporter | None":
        """A reporter configured from the environment, or ``None`` when the gate is off.

        Reads ``OTEL_SWA_DIVERGENCE_INTERVAL`` (fallback ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``),
        ``OTEL_SWA_RING_SIZE``, ``OTEL_SWA_MICRO_BATCHES``, ``OTEL_SWA_LIVENESS_STEPS`` and
        ``OTEL_SWA_GRAPH_CHECKS``. ``None``
        (interval 0) means the engine does no reporter work at all.

        Raises:
            otel_swa.config.ConfigError: a variable holds an unusable value.
        """
        interval = config.divergence_interval(environ)
        if interval == 0:
            return None
        return cls(
            interval, device=device, ring_size=config.ring_size(environ), sinks=sinks, verify_source=verify_source,
            micro_batches=config.micro_batches(environ), liveness_steps=config.liveness_steps(interval, environ),
            graph_mode=config.graph_checks(environ),
        )

    # ------------------------------------------------------------------ engine-facing calls
    def observe(self, pool: "KVPool | int | str", count: "int | torch.Tensor") -> None:
        """Add ``count`` KV entries checked/read in ``pool`` during this forward.

        A Python int is added on the host (no device operation, no allocation); a 0-dim device
        tensor in place on the device (no host sync, safe inside CUDA graph capture: pass a tensor
        there; a Python int inside capture is captured as a constant, added at every replay).

        Raises:
            ValueError: unknown pool, a negative int.
            TypeError: neither an int nor a 0-dim integer tensor.
        """
        self._accumulator.add(pool, count)

    def step(self, view: Any, context: Any = None, *, micro_batch: "int | None" = None) -> None:
        """Count one forward step; at non-zero multiples of ``interval``, sample ``view`` (and, with
        ``micro_batches="every"``, the rest of the pipeline's round: class docstring).

        Also delivers, without blocking, every sample whose copy has finished, the one just taken
        included: on CPU the copy is done when the sample is staged, so a record reaches the sinks
        at the step it describes (a process killed right after loses nothing the reporter held);
        on CUDA it is delivered at the first later ``step()`` or ``flush()`` that finds its event
        complete. Inside CUDA graph capture the call is ignored (class docstring).

        Args:
            view: a :class:`otel_swa.views.SwaBatchView` describing the batch of this forward step,
                or a zero-argument callable returning one (called only at sampling steps, so an
                engine pays nothing to build it on the other steps). Only read at sampling steps.
            context: the OpenTelemetry context of this forward step, handed to the sinks with the
                record; default: the current context at this call.
            micro_batch: under pipeline parallelism, the index of the micro-batch this forward step
                ran (``0 .. MICRO_BATCH_MAX``, SGLang's ``mb_id``), carried by its record
                (``record.micro_batch``); ``None`` (default): no pipeline.

        Raises:
            TypeError, ValueError: ``micro_batch`` is not ``None`` nor an int in ``0 ..
                MICRO_BATCH_MAX`` (any step); at a sampling step, ``view`` does not satisfy the protocol (see
                :func:`otel_swa.views.validate_view`): an integration error, raised so it is seen
                at the first sample. Errors of the view factory or of the device work (out of
                memory, a CUDA fault) also propagate; sink errors never do, and invalid sample
                values (a bad view's included) are counted, not raised.
        """
        if self._closed:
            return
        if self._cuda and torch.cuda.is_current_stream_capturing():
            self._skipped_captures += 1
            return
        check_micro_batch(micro_batch)
        self._forward_ct += 1
        if self._queue.pending:
            with self._lock:
                self._delivered(self._queue.deliver_ready(self.verify_source))
        if self._forward_ct % self.interval == 0:
            due = True
            if self.micro_batches == "every":
                self._round = None if micro_batch is None else {micro_batch}
        elif self._round is not None:  # micro_batches="every", inside a sampled round
            due = micro_batch is not None and micro_batch not in self._round
            if due:
                self._round.add(micro_batch)
            else:
                self._round = None
        else:
            self._set_host_due(self._due_next(None))
            return
        self._set_host_due(self._due_next(None))  # the next forward's, until before_forward() says more
        if due:
            with self._lock:
                if not self._closed:
                    try:
                        self._sample(view, context, micro_batch)
                        self._delivered(self._queue.deliver_ready(self.verify_source))
                    finally:  # a view refused at every sampling step raises here: still said once
                        if (self.liveness_steps and not self._silence_reported
                                and self._forward_ct - self._delivered_at >= self.liveness_steps):
                            self.liveness_warning()

    def add_sink(self, sink: Sink) -> None:
        """Deliver future records to ``sink`` too."""
        if not callable(sink):
            raise TypeError(f"sink must be callable as sink(record, context), got {sink!r}")
        self._queue.sinks.append(sink)

    def flush(self) -> None:
        """Deliver every pending sample now, waiting for copies still in flight, then call the
        sinks' own ``flush()`` (a sink that hands records to another thread delivers them there
        before this returns). Idempotent; thread-safe with respect to ``step()``. Inside CUDA graph
        capture it does nothing (waiting is not allowed there)."""
        if self._capturing("flush"):
            return
        with self._lock:
            self._delivered(self._queue.drain(self.verify_source))
        self._queue.call_sinks("flush")

    def close(self) -> None:
        """Flush, then stop: later ``observe`` still works, later ``step`` does nothing. Idempotent.
        Inside CUDA graph capture it does nothing (the reporter stays open). A reporter an engine
        was to step (:meth:`expect_steps_from`) that delivered no sample gives its liveness
        warning first."""
        if self._capturing("close"):
            return
        with self._lock:
            if self._closed:
                return
            if self._liveness_hook is not None:
                self.liveness_warning(final=True, hook=self._liveness_hook)
            self.flush()
            self._closed = True

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's state (totals, forward count, pending samples,
        health counts) and reset the sinks that can be (their own ``reset_after_fork()``, e.g. a
        delivery thread that did not survive the fork). The sinks stay attached. Called by
        :mod:`otel_swa.lifecycle` for every tracked reporter."""
        self._accumulator.reset()
        self._queue.ring.reset_after_fork()
        self._queue.reset()
        for part in self._parts.values():  # the checks' host state that a child must not inherit
            reset = getattr(part, "reset_after_fork", None)
            if callable(reset):
                reset()
        self._init_state()
        self._queue.call_sinks("reset_after_fork", count_errors=False)

    def __enter__(self) -> "SwaDivergenceReporter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ introspection
    @property
    def forward_ct(self) -> int:
        """Forward steps seen so far."""
        return self._forward_ct

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def totals(self) -> torch.Tensor:
        """The totals so far, ``int64 [2]`` (FULL, SWA) on the reporter's device: the device part
        plus the host ints. While no Python int was observed this is the device accumulator itself
        (no copy: safe to read inside CUDA graph capture, as SGLang's canary manager reads its
        reporter's counter), else a new tensor. Reading it on the host synchronises."""
        if self._accumulator.host == [0, 0]:
            return self._accumulator.totals
        return self._accumulator.combined()

    @property
    def device_totals(self) -> torch.Tensor:
        """The device part of the totals, ``int64 [2]`` (FULL, SWA): the counts given as device
        tensors, in place, the same tensor for the reporter's life (what a CUDA graph may read)."""
        return self._accumulator.totals

    @property
    def _audit_sweep(self) -> Any:
        """The SWA slot audit's :class:`~otel_swa.device.audit.SwaAuditSweep` (benchmarks read its passes)."""
        return self._parts["slot_audit"].sweep

    def _capturing(self, what: str) -> bool:
        """Whether this thread's current CUDA stream is capturing (never true on CPU); logs once."""
        if not (self._cuda and torch.cuda.is_current_stream_capturing()):
            return False
        if not self._capture_warned:
            self._capture_warned = True
            _log.warning("otel-swa reporter.%s() called during CUDA graph capture: nothing done", what)
        return True

    # ------------------------------------------------------------------ the sample
    def _sample(self, view: Any, context: Any, micro_batch: "int | None" = None) -> None:
        if callable(view) and not isinstance(view, SwaBatchView):
            view = view()
        validate_view(view, self.device)
        if context is None and _otel_context is not None:
            context = _otel_context.get_current()
        self._delivered(self._queue.take(view, context, self._forward_ct, micro_batch, self._accumulator.totals,
                                         self._accumulator.host, self.verify_source))

    def _delivered(self, count: int) -> None:
        """Note ``count`` records just delivered (the liveness clock restarts)."""
        if count:
            self._delivered_at = self._forward_ct
            self._silence_reported = False
