"""The SWA divergence reporter: ties the device accumulator, the sample and the device-to-host ring
to the host-side record and its sinks.

Data path::

    forward ── observe(pool, count) ──▶ device int64[2] accumulator (in place, graph-safe)
    step(view) ── every `interval` forwards ──▶ stage_sample on the current stream
               ──▶ async copy into a preallocated (pinned) host ring slot + event
    later step() / flush() ── event.query(), in order ──▶ SwaDivergenceRecord ──▶ sink(record, context)

Compared with SGLang's reporter (sgl-project/sglang PR #26820): the host ring is preallocated, the
host polls instead of blocking, the gather covers only live tokens when the engine knows its
sequence lengths on the host, the batch is read at the step it describes, and ``flush()``/``close()``
deliver the last samples instead of losing them.

Checks inside the forward (the read check, the write check, the provenance stamps and checksums)
take the sampling decision from the device: :meth:`SwaDivergenceReporter.before_forward` sets
:attr:`SwaDivergenceReporter.sampling_flag` before each forward, so that a forward replayed from a
CUDA graph holding the checks is checked at its sampled steps (:mod:`otel_swa.device.gate`).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch

from otel_swa import config
from otel_swa.device import (
    FAULTS,
    STAGE_WIDTH,
    DeviceToHostRing,
    KVPool,
    PoolAccumulator,
    SampleMeta,
    Workspace,
    read_sample,
    stage_sample,
)
from otel_swa.device.audit import SwaAuditSweep
from otel_swa.device.gate import GRAPH_MODES, SamplingGate
from otel_swa.device.provenance import KvProvenance
from otel_swa.device.read_check import READ_CHECK_MODES, ReadCheck
from otel_swa.device.write_check import WriteCheck
from otel_swa.record import MICRO_BATCH_MAX, VERIFY_SOURCES, LivenessWarning, Offender, SwaDivergenceRecord
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


_NO_FAULTS: Mapping[str, int] = types.MappingProxyType({name: 0 for name in FAULTS})


@dataclass(frozen=True)
class ReporterStats:
    """The reporter's own health counters (all cumulative ints).

    Attributes:
        samples_taken: samples staged on the device.
        samples_delivered: records handed to the sinks.
        ring_full_waits: times a new sample found every ring slot in flight and the host waited
            for the oldest copy (samples are never dropped).
        sink_errors: exceptions raised by sinks (caught and logged).
        pending: samples staged and not yet delivered.
        skipped_captures: ``step()`` calls made while the current CUDA stream was capturing a
            graph: ignored (the captured forward has not run; no host state changes, no event is
            polled, no sample is taken).
        invalid_samples: samples delivered as no record because their values could not form
            one: a negative total (a negative count given to ``observe`` as a device tensor) or a
            fault of the view (``view_faults``); logged, never delivered.
        view_faults: per fault of :data:`otel_swa.device.FAULTS`, the samples whose view showed
            it (a sample with two faults counts under both): ``req_pool_indices`` outside
            ``req_to_token``, a live token's FULL slot outside ``0 .. len(mapping) - 1``,
            ``seq_lens`` above ``max_context_len`` or below 0, ``seq_lens_cpu`` different from
            ``seq_lens``. Read-only mapping, every fault present.
        liveness_warnings: liveness warnings given (:meth:`SwaDivergenceReporter.liveness_warning`:
            on, and no sample delivered for ``liveness_steps`` forward steps, or at the end of a
            life in which none was).
    """

    samples_taken: int
    samples_delivered: int
    ring_full_waits: int
    sink_errors: int
    pending: int
    skipped_captures: int
    invalid_samples: int = 0
    view_faults: Mapping[str, int] = field(default_factory=lambda: _NO_FAULTS)
    liveness_warnings: int = 0


class _Pending(NamedTuple):
    slot: int
    forward_ct: int
    context: Any
    divergence_applicable: bool
    audit_page_size: int  # 0 when the sample carries no audit
    meta: SampleMeta
    host_totals: tuple[int, int]  # the accumulator's host part when the sample was taken
    micro_batch: "int | None"
    request_ids: "tuple[str, ...] | None" = None  # the batch's request ids (view.request_ids)
    held_request_ids: "tuple[str, ...] | None" = None  # the block audit's requests (kv_block_audit)
    # with holders_include_batch, how the batch's tokens lead the audit's holders: ("live", lengths)
    # or ("dense", batch, max_context_len); of the sample where the audit's pass began
    batch_holders: "tuple | None" = None
    audit_request_ids: "tuple[str, ...] | None" = None  # the batch's request ids at that sample
    block_hashes: Any = None  # the view's kv_block_hashes (host values: views.base.BlockHashFindings)
    # an attached write check's batch (request ids of the step it checked) and layer names / groups
    write_request_ids: "tuple[str, ...] | None" = None
    write_layers: "Mapping[int, tuple[str | None, int | None, bool]] | None" = None


class SwaDivergenceReporter:
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

    Liveness. Like SGLang's KV canary, which raises "canary path is not executing" when a kernel's
    run counter is still 0 after its warm-up, the reporter says when it is on and not working: a
    :class:`~otel_swa.record.LivenessWarning` handed to every sink that has a
    ``liveness(warning, context)`` method (the line sinks write it as otel-swa's
    ``otel_swa_liveness=`` line, the telemetry sink as an event; logged as a Python warning when
    no sink takes it), counted in ``stats.liveness_warnings``.

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
        self._ring = DeviceToHostRing(ring_size, STAGE_WIDTH, self.device)
        self._workspace = Workspace(self.device)
        self._audit_sweep = SwaAuditSweep(self.device, budget=audit_budget)
        self._sinks: list[Sink] = list(sinks)
        self._gate = SamplingGate(self.device, graph_mode=graph_mode)
        self._read_check: "ReadCheck | None" = None
        self._provenance: "KvProvenance | None" = None
        self._write_check: "WriteCheck | None" = None  # attach_write_check's
        self._write_batch: "Callable[[], Any] | None" = None
        self._write_layers: "Mapping[int, tuple[str | None, int | None, bool]] | None" = None
        self._other_gates: "list[SamplingGate]" = []  # gates on other devices that before_forward sets
        self._liveness_hook: "str | None" = None  # set by expect_steps_from
        self._init_state()

    def _init_state(self) -> None:
        self._pending: collections.deque[_Pending] = collections.deque()
        self._next_slot = 0
        self._forward_ct = 0
        self._closed = False
        self._samples_taken = 0
        self._samples_delivered = 0
        self._ring_full_waits = 0
        self._sink_errors = 0
        self._skipped_captures = 0
        self._invalid_samples = 0
        self._view_faults = {name: 0 for name in FAULTS}
        self._capture_warned = False
        self._invalid_warned = False
        self._delivered_at = 0  # forward_ct when the last sample was delivered
        self._silence_reported = False  # a liveness warning was given for the silence under way
        self._liveness_warnings = 0
        # micro-batches sampled since the last interval step (micro_batches="every"), or None
        self._round: "set[int] | None" = None
        # where the audit's pass in progress began: (batch_holders, request ids) of that sample
        self._audit_origin: "tuple | None" = None
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
        _check_micro_batch(micro_batch)
        self._forward_ct += 1
        if self._pending:
            with self._lock:
                self._deliver_ready()
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
                        self._deliver_ready()
                    finally:  # a view refused at every sampling step raises here: still said once
                        if (self.liveness_steps and not self._silence_reported
                                and self._forward_ct - self._delivered_at >= self.liveness_steps):
                            self.liveness_warning()

    # ------------------------------------------------------------------ the sampling decision on the device
    def before_forward(self, *, micro_batch: "int | None" = None) -> None:
        """Say before each forward step whether it is a sampling step: sets :attr:`sampling_flag`
        (one tiny device write, only when the decision changes) for the checks a CUDA graph holds,
        and the host's decision for eager ones. Call it outside capture, before the forward runs or
        is replayed (SGLang: at the start of the ``ModelRunner.forward`` wrapper); inside a capture
        it does nothing. Without it eager checks still run at the right steps (the host decision is
        also kept by :meth:`step`), but a replayed graph's checks see a stale flag.

        Args:
            micro_batch: the micro-batch the forward runs (``micro_batches="every"``), or ``None``.

        Raises:
            ValueError: ``micro_batch`` is not ``None`` nor an int in ``0 .. MICRO_BATCH_MAX``.
        """
        _check_micro_batch(micro_batch)
        if self._closed or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return
        due = self._due_next(micro_batch)
        self._gate.set(due)
        for gate in self._other_gates:
            if not gate.capturing():
                gate.set(due)

    def _set_host_due(self, due: bool) -> None:
        """The host's decision for the next forward, on every gate (no device work)."""
        self._gate.due = due
        for gate in self._other_gates:
            gate.due = due

    def _due_next(self, micro_batch: "int | None") -> bool:
        """Whether the next :meth:`step` samples (its ``forward_ct`` and, in a round of
        ``micro_batches="every"``, ``micro_batch``); no state changes."""
        if self._closed:
            return False
        if (self._forward_ct + 1) % self.interval == 0:
            return True
        return self._round is not None and micro_batch is not None and micro_batch not in self._round

    @property
    def sampling_flag(self) -> torch.Tensor:
        """``bool`` 0-dim on the reporter's device, True while the forward now running is a sampling
        step (set by :meth:`before_forward`); the same tensor for the reporter's life, so a CUDA graph
        may read it."""
        return self._gate.flag

    @property
    def gate(self) -> SamplingGate:
        """The :class:`~otel_swa.device.gate.SamplingGate` the in-forward checks share."""
        return self._gate

    def checks_wanted(self) -> bool:
        """Whether an in-forward check called now should run: the forward is a sampling step, or a
        CUDA graph is being captured (the check is then recorded, its effect at each replay decided
        by :attr:`sampling_flag`). Host work only."""
        return not self._closed and self._gate.wanted()

    # ------------------------------------------------------------------ provenance and the write check
    def enable_provenance(self, *, full_slots: int, swa_slots: "int | None" = None, **options: Any) -> KvProvenance:
        """Switch provenance on (:mod:`otel_swa.device.provenance`: stamps and checksums written at
        every forward step, verified with each sample, and the write check) and return it; the
        engine then calls its :meth:`~otel_swa.device.provenance.KvProvenance.stamp` once per forward
        and :meth:`~otel_swa.device.provenance.KvProvenance.after_layer` after each attention layer.
        Idempotent: the same object is returned after the first call (its arguments then ignored).

        Args:
            full_slots, swa_slots: slots of the FULL and SWA pools (their K/V buffers' first
                dimension; ``swa_slots=None``: no SWA pool). The tables take 8 bytes per slot each,
                on the reporter's device.
            options: :class:`~otel_swa.device.provenance.KvProvenance`'s (``checksum``,
                ``checksum_bytes``, ``checksum_layers``, ``budget``, ``write_check``,
                ``write_check_tokens``, ``write_check_layers``).

        Raises:
            ValueError: an argument out of range.
            TypeError: an unknown option.
        """
        if self._provenance is None:
            self._provenance = KvProvenance(self.device, self._gate, full_slots=full_slots, swa_slots=swa_slots,
                                            **options)
        return self._provenance

    @property
    def provenance(self) -> "KvProvenance | None":
        """Provenance, or ``None`` while it is off."""
        return self._provenance

    def attach_write_check(self, check: WriteCheck, *, batch: "Callable[[], Any] | None" = None,
                           layers: "Mapping[int, tuple[str | None, int | None, bool]] | None" = None) -> None:
        """Take the cells of a write check the engine runs itself
        (:class:`~otel_swa.device.write_check.WriteCheck`, made before this reporter, e.g. where
        the model runner is set up before the scheduler exists, on the KV cache's device, which
        may differ from this reporter's) into every sample: the record's ``kv_write_*`` fields and
        the first mismatch as a ``kv_write_mismatches`` offender. Used instead of provenance's write
        check when both exist.

        :meth:`before_forward` then also sets ``check.gate`` (when it is not this reporter's own
        gate): the engine calls :meth:`before_forward` before each forward and the check's
        ``check_layer`` after each layer's store, as with provenance. The sample copies the
        check's cells into the staged sample (a copy from the check's device: where that is a GPU
        and this reporter's device the CPU, the copy waits for the work queued on the current
        stream, once per sample).

        Args:
            check: the write check.
            batch: returns, when a sample is taken, the request ids of the forward step whose
                checks the cells hold (a sequence of strings, index = the offender's ``entry``),
                or ``None`` when unknown; an exception is logged and taken as ``None``.
            layers: ``layer_id -> (layer name, KV cache group, rows)`` for the offender (name and
                group ``None`` when unknown); ``rows``: the check's ``entry`` is the token's batch
                row (the layer's store gave ``extend_start_loc``), so ``batch()[entry]`` is its
                request; else the entry is a token index and neither row nor request is named. A
                layer not in the mapping: no name, no group, no row.

        Raises:
            TypeError: ``check`` is not a ``WriteCheck``.
        """
        if not isinstance(check, WriteCheck):
            raise TypeError(f"check must be a WriteCheck, got {type(check).__name__}")
        self._write_check = check
        self._write_batch = batch
        self._write_layers = dict(layers) if layers is not None else None
        if check.gate is not self._gate and all(g is not check.gate for g in self._other_gates):
            self._other_gates.append(check.gate)
            check.gate.due = self._gate.due

    @property
    def write_check(self) -> "WriteCheck | None":
        """The write check whose cells the samples take: the attached one, else provenance's."""
        if self._write_check is not None:
            return self._write_check
        return self._provenance.write_check if self._provenance is not None else None

    def _write_request_ids(self) -> "tuple[str, ...] | None":
        if self._write_batch is None:
            return None
        try:
            ids = self._write_batch()
            return None if ids is None else tuple(str(r) for r in ids)
        except Exception:
            _log.exception("otel-swa: the write check's batch was not read; its offender names no request")
            return None

    # ------------------------------------------------------------------ the read check
    def enable_read_check(self, *, max_queries: int = 8, layers: str = READ_CHECK_MODES[0]) -> ReadCheck:
        """Switch the read check on (:mod:`otel_swa.device.read_check`) and return it: at each
        sampled forward step the engine's sliding-window layers call
        :meth:`~otel_swa.device.read_check.ReadCheck.check_layer` (while :meth:`read_check_due`
        holds) and the sample carries the results (``swa_read_checks``, ``swa_read_mismatches``,
        ``swa_read_unchecked``, and the first disagreeing query as an offender). Idempotent: the
        same object is returned after the first call.

        Raises:
            ValueError: ``max_queries`` or ``layers`` out of range (see ``ReadCheck``).
        """
        if self._read_check is None:
            self._read_check = ReadCheck(self.device, max_queries=max_queries, layers=layers, gate=self._gate)
        return self._read_check

    @property
    def read_check(self) -> "ReadCheck | None":
        """The read check, or ``None`` while it is off."""
        return self._read_check

    def read_check_due(self) -> bool:
        """Whether the forward step now running (the next :meth:`step`) is a sampling step whose
        sliding-window layers should be checked: the read check is on, the reporter open, and the
        step's ``forward_ct`` a multiple of ``interval``. Host work only (an increment's worth)."""
        return (self._read_check is not None and not self._closed
                and (self._forward_ct + 1) % self.interval == 0)

    def add_sink(self, sink: Sink) -> None:
        """Deliver future records to ``sink`` too."""
        if not callable(sink):
            raise TypeError(f"sink must be callable as sink(record, context), got {sink!r}")
        self._sinks.append(sink)

    def flush(self) -> None:
        """Deliver every pending sample now, waiting for copies still in flight, then call the
        sinks' own ``flush()`` (a sink that hands records to another thread delivers them there
        before this returns). Idempotent; thread-safe with respect to ``step()``. Inside CUDA graph
        capture it does nothing (waiting is not allowed there)."""
        if self._capturing("flush"):
            return
        with self._lock:
            while self._pending:
                head = self._pending[0]
                self._ring.wait(head.slot)
                self._deliver(self._pending.popleft())
            sinks = list(self._sinks)
        for sink in sinks:
            flush = getattr(sink, "flush", None)
            if callable(flush):
                try:
                    flush()
                except Exception:  # telemetry must never crash the engine
                    self._sink_errors += 1
                    _log.exception("otel-swa sink %r failed to flush", sink)

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

    def expect_steps_from(self, hook: str) -> None:
        """Expect the engine to step this reporter from ``hook`` (the engine method an instrumentor
        wrapped): when it is closed having delivered no sample, it gives its liveness warning naming
        ``hook`` (:meth:`liveness_warning`; :mod:`otel_swa.lifecycle` does the same at the end of
        the process)."""
        self._liveness_hook = hook

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's state (totals, forward count, pending samples,
        health counts) and reset the sinks that can be (their own ``reset_after_fork()``, e.g. a
        delivery thread that did not survive the fork). The sinks stay attached. Called by
        :mod:`otel_swa.lifecycle` for every tracked reporter."""
        self._accumulator.reset()
        self._ring.reset_after_fork()
        self._audit_sweep.reset()
        self._init_state()
        for sink in list(self._sinks):
            reset = getattr(sink, "reset_after_fork", None)
            if callable(reset):
                try:
                    reset()
                except Exception:
                    _log.exception("otel-swa sink %r could not be reset after a fork", sink)

    def liveness_warning(self, *, final: bool = False, hook: "str | None" = None) -> "LivenessWarning | None":
        """Say that the reporter is on and not working: hand a
        :class:`~otel_swa.record.LivenessWarning` to the sinks that have ``liveness(warning,
        context)`` (a Python warning when none has), count it in ``stats.liveness_warnings``, and
        return it. Called by :meth:`step` when ``liveness_steps`` forward steps passed without a
        delivered sample (once per such silence), and by :mod:`otel_swa.lifecycle` at the end of
        the process for reporters an engine's instrumentor made.

        Args:
            final: the end of the reporter's life: warn only when it never delivered a sample
                (cause ``no_forward_step`` when no forward step reached it either), and at most
                once; returns ``None`` otherwise.
            hook: where the engine was to step the reporter, said in the warning.
        """
        if final and (self._samples_delivered or self._silence_reported):
            return None
        cause = "no_forward_step" if self._forward_ct == 0 else "no_sample_delivered"
        warning = LivenessWarning(
            cause, forward_ct=self._forward_ct, steps=self._forward_ct - self._delivered_at,
            samples_delivered=self._samples_delivered, samples_taken=self._samples_taken,
            invalid_samples=self._invalid_samples, skipped_captures=self._skipped_captures,
            verify_source=self.verify_source, hook=hook,
        )
        self._silence_reported = True
        self._liveness_warnings += 1
        told = False
        for sink in list(self._sinks):
            liveness = getattr(sink, "liveness", None)
            if not callable(liveness):
                continue
            told = True
            try:
                liveness(warning, None)
            except Exception:  # telemetry must never crash the engine
                self._sink_errors += 1
                _log.exception("otel-swa sink %r failed on a liveness warning", sink)
        if not told:
            _log.warning("otel-swa reporter: %s", warning.summary())
        return warning

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
    def stats(self) -> ReporterStats:
        return ReporterStats(
            samples_taken=self._samples_taken,
            samples_delivered=self._samples_delivered,
            ring_full_waits=self._ring_full_waits,
            sink_errors=self._sink_errors,
            pending=len(self._pending),
            skipped_captures=self._skipped_captures,
            invalid_samples=self._invalid_samples,
            view_faults=types.MappingProxyType(dict(self._view_faults)),
            liveness_warnings=self._liveness_warnings,
        )

    def _capturing(self, what: str) -> bool:
        """Whether this thread's current CUDA stream is capturing (never true on CPU); logs once."""
        if not (self._cuda and torch.cuda.is_current_stream_capturing()):
            return False
        if not self._capture_warned:
            self._capture_warned = True
            _log.warning("otel-swa reporter.%s() called during CUDA graph capture: nothing done", what)
        return True

    # ------------------------------------------------------------------ device side
    def _sample(self, view: Any, context: Any, micro_batch: "int | None" = None) -> None:
        if callable(view) and not isinstance(view, SwaBatchView):
            view = view()
        validate_view(view, self.device)
        if len(self._pending) == self._ring.slots:
            # Every slot is in flight: wait for the oldest, never drop it.
            self._ring_full_waits += 1
            head = self._pending.popleft()
            self._ring.wait(head.slot)
            self._deliver(head)
        if context is None and _otel_context is not None:
            context = _otel_context.get_current()
        audit = getattr(view, "swa_audit", None)
        provenance = self._provenance
        slot = self._next_slot
        meta = stage_sample(
            self._ring.stage[slot],
            self._accumulator.totals,
            view.req_to_token,
            view.full_to_swa_index_mapping,
            view.req_pool_indices,
            view.seq_lens,
            getattr(view, "seq_lens_cpu", None),
            audit,
            functools.partial(self._ring.upload, slot),
            req_pool_indices_cpu=getattr(view, "req_pool_indices_cpu", None),
            workspace=self._workspace,
            sliding_window=getattr(view, "sliding_window", None),
            swa_eviction_allowance=getattr(view, "swa_eviction_allowance", None),
            extend_lens_cpu=getattr(view, "extend_lens_cpu", None),
            read_check=self._read_check,
            kv_block_audit=getattr(view, "kv_block_audit", None),
            audit_sweep=self._audit_sweep,
            write_check=self.write_check,
            provenance=(functools.partial(provenance.stage, view=view, upload=functools.partial(
                self._ring.upload, slot, name="provenance")) if provenance is not None else None),
        )
        self._ring.start_copy(slot)
        applicable = getattr(view, "divergence_applicable", True) is not False
        host = self._accumulator.host
        request_ids = getattr(view, "request_ids", None)
        blocks = getattr(view, "kv_block_audit", None)
        ids = tuple(str(r) for r in request_ids) if request_ids is not None else None
        if meta.audit_started:  # the holders of the audit's pass are this sample's
            holder_lens = None
            if audit.holders_include_batch:
                if meta.path == "live":
                    holder_lens = ("live", tuple(int(n) for n in view.seq_lens_cpu))
                elif meta.path == "dense":
                    holder_lens = ("dense", meta.batch, meta.width)
            self._audit_origin = (holder_lens, ids)
        origin = self._audit_origin if meta.audited else None
        self._pending.append(_Pending(
            slot, self._forward_ct, context, applicable, audit.page_size if meta.audited else 0, meta,
            (host[0], host[1]), micro_batch, ids,
            tuple(str(r) for r in blocks.held_request_ids) if blocks is not None else None,
            origin[0] if origin else None, origin[1] if origin else None,
            block_hashes=getattr(view, "kv_block_hashes", None),
            write_request_ids=self._write_request_ids() if self._write_check is not None else None,
            write_layers=(self._write_layers or {}) if self._write_check is not None else None,
        ))
        # Advanced only now: a sample that failed above leaves its slot free for the next one.
        self._next_slot = (slot + 1) % self._ring.slots
        self._samples_taken += 1

    # ------------------------------------------------------------------ host side
    def _deliver_ready(self) -> None:
        pending = self._pending
        while pending and self._ring.ready(pending[0].slot):
            self._deliver(pending.popleft())

    def _deliver(self, pending: _Pending) -> None:
        reading = read_sample(self._ring.read(pending.slot), pending.meta)
        if reading.faults:
            self._invalid_samples += 1
            first = [name for name in reading.faults if not self._view_faults[name]]
            for name in reading.faults:
                self._view_faults[name] += 1
            if first:  # each fault is logged the first time; later ones are counted (never a flood)
                _log.error(
                    "otel-swa sample at forward_ct=%d not delivered: the view shows %s (later samples with "
                    "the same fault are only counted: reporter.stats.view_faults)",
                    pending.forward_ct, ", ".join(reading.faults),
                )
            return
        page_size = pending.audit_page_size
        audit = reading.audit if page_size else None
        try:
            record = SwaDivergenceRecord(
                forward_ct=pending.forward_ct,
                verify_full=reading.verify_full + pending.host_totals[0],
                verify_swa=reading.verify_swa + pending.host_totals[1],
                swa_full_idx_divergence=reading.divergence,
                swa_out_of_window_tokens=reading.out_of_window,
                divergence_applicable=pending.divergence_applicable,
                swa_leaked_slots=audit[2] * page_size if audit else None,
                swa_stale_tokens=audit[3] if audit else None,
                swa_shared_slots=audit[4] if audit else None,
                swa_pages_in_use=audit[0] if audit else None,
                swa_pages_referenced=audit[1] if audit else None,
                swa_premature_evictions=reading.premature,
                swa_late_held_slots=reading.late_held,
                swa_read_checks=reading.read[0] if reading.read else None,
                swa_read_mismatches=reading.read[1] if reading.read else None,
                swa_read_unchecked=reading.read[2] if reading.read else None,
                kv_leaked_blocks=reading.block["leaked"] if reading.block else None,
                kv_freed_blocks_in_use=reading.block["freed_in_use"] if reading.block else None,
                kv_shared_blocks=reading.block["shared"] if reading.block else None,
                **_block_hash_fields(pending.block_hashes),
                **_provenance_fields(reading),
                verify_source=self.verify_source,
                micro_batch=pending.micro_batch,
                offenders=_offenders(reading, pending),
            )
        except (TypeError, ValueError) as exc:  # never let a bad value escape into the engine
            self._invalid_samples += 1
            if not self._invalid_warned:  # the first is logged, later ones counted (never a flood)
                self._invalid_warned = True
                _log.error("otel-swa sample at forward_ct=%d is invalid and was not delivered: %s (later invalid "
                           "samples are only counted: reporter.stats.invalid_samples)", pending.forward_ct, exc)
            return
        self._samples_delivered += 1
        self._delivered_at = self._forward_ct
        self._silence_reported = False
        for sink in self._sinks:
            try:
                sink(record, pending.context)
            except Exception:  # telemetry must never crash the engine
                self._sink_errors += 1
                _log.exception("otel-swa sink %r failed on record at forward_ct=%d", sink, record.forward_ct)


def _provenance_fields(reading: Any) -> "dict[str, int | None]":
    """The record's write check and provenance fields from the reading (``None``: not measured)."""
    write, prov = reading.write, reading.provenance
    return dict(
        kv_write_checks=write[0] if write else None,
        kv_write_mismatches=write[1] if write else None,
        kv_write_unchecked=write[2] if write else None,
        kv_stamp_checks=prov.stamp_checks if prov else None,
        kv_foreign_tokens=prov.foreign_tokens if prov else None,
        kv_stamp_unchecked=prov.stamp_unchecked if prov else None,
        kv_checksum_checks=prov.checksum_checks if prov else None,
        kv_corrupt_tokens=prov.corrupt_tokens if prov else None,
    )


def _provenance_offenders(reading: Any, pending: _Pending) -> "list[Offender]":
    """The first write mismatch, foreign token and corrupt token, with the batch's request ids."""
    offenders = []
    page = pending.audit_page_size
    write = reading.write_offender
    if write is not None and reading.write and reading.write[1] > 0:
        swa = write["swa_slot"]
        if pending.write_layers is not None:  # an attached write check (attach_write_check)
            ids = pending.write_request_ids
            entry = write["entry"]
            name, group, rows = pending.write_layers.get(write["layer"], (None, None, False))
            known = rows and 0 <= entry
            offenders.append(Offender(
                "kv_write_mismatches", request=ids[entry] if known and ids is not None and entry < len(ids) else None,
                row=entry if known else None, position=write["position"], full_slot=write["full_slot"], swa_slot=swa,
                layer=write["layer"], layer_name=name, kv_cache_group=group, pool=write["pool"],
            ))
        else:
            offenders.append(Offender(
                "kv_write_mismatches", request=_request(pending, write["entry"]), position=write["position"],
                full_slot=write["full_slot"], swa_slot=swa,
                swa_page=swa // page if page and swa is not None else None, layer=write["layer"], pool=write["pool"],
            ))
    prov = reading.provenance
    for fault, where in (("kv_foreign_tokens", prov.foreign_offender if prov else None),
                         ("kv_corrupt_tokens", prov.corrupt_offender if prov else None)):
        if where is None:
            continue
        swa = where["swa_slot"]
        offenders.append(Offender(
            fault, request=_request(pending, where["entry"]), row=where["row"], position=where["position"],
            full_slot=where["full_slot"], swa_slot=swa, swa_page=swa // page if page and swa is not None else None,
            pool=where["pool"], expected_token=where.get("expected_token"),
            expected_position=where.get("expected_position"), found_token=where.get("found_token"),
            found_position=where.get("found_position"),
        ))
    return offenders


def _check_micro_batch(micro_batch: Any) -> None:
    if micro_batch is not None and (type(micro_batch) is not int or not 0 <= micro_batch <= MICRO_BATCH_MAX):
        raise ValueError(f"micro_batch must be None or an int from 0 to {MICRO_BATCH_MAX}, got {micro_batch!r}")


def _request(pending: _Pending, entry: "int | None") -> "str | None":
    """The request id of batch entry ``entry`` (``None`` for a slot no batch entry reads: the sweep's)."""
    ids = pending.request_ids
    return ids[entry] if ids is not None and entry is not None and 0 <= entry < len(ids) else None


def _batch_token(pending: _Pending, holder: int) -> "tuple[int, int] | None":
    """``(batch entry, position)`` of audit holder ``holder`` when it is a live token of the batch
    (``holders_include_batch``: the batch's tokens are the first holders, request after request on
    the live path, as whole rows of ``max_context_len`` on the dense one), else ``None``."""
    layout = pending.batch_holders
    if layout is None:
        return None
    if layout[0] == "dense":
        _, batch, width = layout
        return divmod(holder, width) if width and holder < batch * width else None
    for entry, length in enumerate(layout[1]):
        if holder < length:
            return entry, holder
        holder -= length
    return None


def _offenders(reading: Any, pending: _Pending) -> "tuple[Offender, ...]":
    """The first offender of each fault the reading shows, with the batch's request ids."""
    offenders = []
    page = pending.audit_page_size
    counts, where = reading.audit, reading.audit_where
    if counts is not None and where is not None:
        if counts[2] > 0:
            offenders.append(Offender("swa_leaked_slots", swa_page=where["leaked_page_index"] + 1))
        if counts[3] > 0:
            token = _batch_token(pending, where["stale_holder"])
            swa = where["stale_swa_slot"]
            ids = pending.audit_request_ids
            offenders.append(Offender(
                "swa_stale_tokens", request=ids[token[0]] if token and ids is not None and token[0] < len(ids) else None,
                position=token[1] if token else None, full_slot=where["stale_full_slot"], swa_slot=swa,
                swa_page=swa // page if page else None,
            ))
        if counts[4] > 0:
            swa = where["shared_swa_slot"]
            offenders.append(Offender("swa_shared_slots", full_slot=where["shared_full_slot"], swa_slot=swa,
                                      swa_page=swa // page if page else None))
    premature = reading.premature_where
    if premature is not None:
        # a view without SGLang's slot mapping (vLLM: divergence not applicable) fills req_to_token
        # with block ids, not FULL slots: no slot is named then
        offenders.append(Offender(
            "swa_premature_evictions", request=_request(pending, premature["entry"]), row=premature["row"],
            position=premature["position"], full_slot=premature["full_slot"] if pending.divergence_applicable else None,
        ))
    read = reading.read_offender
    if read is not None and reading.read and reading.read[1] > 0:
        offenders.append(Offender(
            "swa_read_mismatches", request=_request(pending, read["entry"]), row=read["row"],
            position=read["position"], full_slot=read["full_slot"], swa_slot=read["swa_slot"],
            swa_page=read["swa_slot"] // page if page else None, layer=read["layer"],
        ))
    offenders.extend(_provenance_offenders(reading, pending))
    block = reading.block
    if block is not None:
        if block["leaked"] > 0:
            offenders.append(Offender("kv_leaked_blocks", block=block["leaked_block"]))
        ids = pending.held_request_ids
        for fault, count, prefix in (("kv_freed_blocks_in_use", "freed_in_use", "freed"),
                                     ("kv_shared_blocks", "shared", "shared")):
            if block[count] > 0:
                row = block[f"{prefix}_row"]
                offenders.append(Offender(
                    fault, request=ids[row] if ids is not None and 0 <= row < len(ids) else None,
                    position=block[f"{prefix}_position"], block=block[f"{prefix}_block"],
                    kv_cache_group=block[f"{prefix}_group"],
                ))
    offenders.extend(_block_hash_offenders(pending.block_hashes))
    return tuple(offenders)


def _block_hash_fields(found: Any) -> dict:
    """The record's block-hash provenance fields from the view's findings (``None``: not measured)."""
    if found is None:
        return {}
    return {"kv_cache_entries_checked": found.entries_checked, "kv_stale_cache_entries": found.stale_entries,
            "kv_foreign_blocks": found.foreign_blocks}


def _block_hash_offenders(found: Any) -> "list[Offender]":
    """The first stale prefix-cache entry and the first foreign block the view's findings name."""
    if found is None:
        return []
    return [Offender(fault, request=o.request, position=o.position, block=o.block, kv_cache_group=o.kv_cache_group,
                     other_request=o.other_request)
            for fault, count, o in (("kv_stale_cache_entries", found.stale_entries, found.first_stale),
                                    ("kv_foreign_blocks", found.foreign_blocks, found.first_foreign))
            if count > 0 and o is not None]
