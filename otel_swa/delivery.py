"""The samples in flight: the preallocated device-to-host ring, the queue of staged samples, and their
delivery, as records, to the sinks.

A sample is staged into the next ring slot (:meth:`SampleQueue.take`: the device side of
:mod:`otel_swa.sampling`, then an asynchronous copy to the slot's pinned host row); it is delivered
when its copy is complete (:meth:`SampleQueue.deliver_ready` polls without blocking;
:meth:`SampleQueue.drain` waits), in the order taken. Nothing is dropped: a sample that finds every
slot in flight waits for the oldest. A sample whose view was unusable, or whose values cannot form a
record, is counted and logged once per kind, never delivered; a sink that raises is counted and
logged, never propagated (telemetry must not crash the engine it observes).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable

import torch

import otel_swa.device as device_kernels
from otel_swa.checks import SampleBatch, Staging
from otel_swa.device import FAULTS, DeviceToHostRing, Workspace
from otel_swa.sampling import PendingSample, SampleLayout

__all__ = ["SampleQueue"]

_log = logging.getLogger("otel_swa.reporter")


class SampleQueue:
    """The ring, the pending samples and the sinks of one reporter.

    Args:
        device: the device of the engine's KV cache tensors.
        ring_size: ring slots (samples in flight at once).
        parts: the checks' device parts by check name (:mod:`otel_swa.checks`), shared with the
            reporter, which adds the ones the engine switches on.
        sinks: callables ``sink(record, context)``.

    Counters (host ints, since the last :meth:`reset`): ``taken``, ``delivered``,
    ``ring_full_waits``, ``sink_errors``, ``invalid`` and ``view_faults`` (per fault of
    :data:`otel_swa.device.FAULTS`).
    """

    def __init__(self, device: torch.device, ring_size: int, parts: "dict[str, Any]",
                 sinks: "Iterable[Callable[[Any, Any], None]]") -> None:
        self.layout = SampleLayout()
        self.ring = DeviceToHostRing(ring_size, self.layout.width, device)
        self.workspace = Workspace(device)
        self.parts = parts
        self.sinks: list = list(sinks)
        self.reset()

    def reset(self) -> None:
        """Forget every pending sample and zero the counters (a forked child's fresh start)."""
        self.pending: collections.deque[PendingSample] = collections.deque()
        self.next_slot = 0
        self.taken = self.delivered = self.ring_full_waits = self.sink_errors = self.invalid = 0
        self.view_faults = {name: 0 for name in FAULTS}
        self._invalid_warned = False

    # ------------------------------------------------------------------ device side
    def take(self, view: Any, context: Any, forward_ct: int, micro_batch: "int | None", totals: torch.Tensor,
             host_totals: "list[int]", verify_source: str) -> int:
        """Stage a sample of ``view`` (already validated) into the next slot and start its copy;
        return how many older samples were delivered first because every slot was in flight (0 or 1).

        ``totals``: the accumulator's device totals; ``host_totals``: its host part now."""
        delivered = 0
        ring = self.ring
        if len(self.pending) == ring.slots:  # every slot is in flight: wait for the oldest, never drop it
            self.ring_full_waits += 1
            head = self.pending.popleft()
            ring.wait(head.slot)
            delivered = self.deliver(head, verify_source)
        slot = self.next_slot
        request_ids = getattr(view, "request_ids", None)
        ids = tuple(str(r) for r in request_ids) if request_ids is not None else None
        staging = Staging(device_kernels, view, self.workspace, self.parts,
                          lambda host, name="sample": ring.upload(slot, host, name), ids)
        kept = self.layout.stage(ring.stage[slot], totals, view, staging)
        ring.start_copy(slot)
        meta = staging.core
        self.pending.append(PendingSample(
            slot, forward_ct, context, getattr(view, "divergence_applicable", True) is not False, meta,
            (host_totals[0], host_totals[1]), micro_batch,
            SampleBatch(ids, view.swa_audit.page_size if meta.audited else 0), kept,
        ))
        # Advanced only now: a sample that failed above leaves its slot free for the next one.
        self.next_slot = (slot + 1) % ring.slots
        self.taken += 1
        return delivered

    # ------------------------------------------------------------------ host side
    def deliver_ready(self, verify_source: str) -> int:
        """Deliver, in order, every pending sample whose copy is complete (no waiting); return how
        many became records."""
        pending, ring = self.pending, self.ring
        delivered = 0
        while pending and ring.ready(pending[0].slot):
            delivered += self.deliver(pending.popleft(), verify_source)
        return delivered

    def drain(self, verify_source: str) -> int:
        """Deliver every pending sample, waiting for the copies still in flight; return how many
        became records."""
        delivered = 0
        while self.pending:
            self.ring.wait(self.pending[0].slot)
            delivered += self.deliver(self.pending.popleft(), verify_source)
        return delivered

    def deliver(self, pending: PendingSample, verify_source: str) -> int:
        """Read ``pending``'s row (its copy complete), build its record and hand it to every sink;
        1 when it was delivered, 0 when it was invalid (counted, logged once per kind)."""
        values = self.ring.read(pending.slot)
        reading = self.layout.read(values, pending)
        if reading.faults:
            self.invalid += 1
            first = [name for name in reading.faults if not self.view_faults[name]]
            for name in reading.faults:
                self.view_faults[name] += 1
            if first:  # each fault is logged the first time; later ones are counted (never a flood)
                _log.error(
                    "otel-swa sample at forward_ct=%d not delivered: the view shows %s (later samples with "
                    "the same fault are only counted: reporter.stats.view_faults)",
                    pending.forward_ct, ", ".join(reading.faults),
                )
            return 0
        try:
            record = self.layout.record(values, pending, reading, verify_source)
        except (TypeError, ValueError) as exc:  # never let a bad value escape into the engine
            self.invalid += 1
            if not self._invalid_warned:  # the first is logged, later ones counted (never a flood)
                self._invalid_warned = True
                _log.error("otel-swa sample at forward_ct=%d is invalid and was not delivered: %s (later invalid "
                           "samples are only counted: reporter.stats.invalid_samples)", pending.forward_ct, exc)
            return 0
        self.delivered += 1
        for sink in self.sinks:
            try:
                sink(record, pending.context)
            except Exception:  # telemetry must never crash the engine
                self.sink_errors += 1
                _log.exception("otel-swa sink %r failed on record at forward_ct=%d", sink, record.forward_ct)
        return 1

    def call_sinks(self, method: str, *args: Any, count_errors: bool = True) -> bool:
        """Call ``method(*args)`` on every sink that has it (``flush``, ``liveness``,
        ``reset_after_fork``); an exception is logged and, with ``count_errors``, counted in
        ``sink_errors``. Whether any sink had it."""
        called = False
        for sink in list(self.sinks):
            fn = getattr(sink, method, None)
            if not callable(fn):
                continue
            called = True
            try:
                fn(*args)
            except Exception:  # telemetry must never crash the engine
                self.sink_errors += count_errors
                _log.exception("otel-swa sink %r failed in %s()", sink, method)
        return called
