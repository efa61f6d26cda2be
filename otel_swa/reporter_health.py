"""The reporter's health: its own counters (:attr:`ReporterHealth.stats`, which the telemetry exports
as ``kv_cache.swa.reporter.*`` metrics) and its liveness warning when it is on and not working
(:meth:`ReporterHealth.liveness_warning`).

Like SGLang's KV canary, which raises "canary path is not executing" when a kernel's run counter is
still 0 after its warm-up, the reporter says when it is on and delivers nothing: a
:class:`~otel_swa.record.LivenessWarning` handed to every sink that has a ``liveness(warning,
context)`` method. :class:`ReporterHealth` is a base of
:class:`~otel_swa.reporter.SwaDivergenceReporter`, whose state it reads.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Mapping

from otel_swa.device.sample import FAULTS
from otel_swa.record import LivenessWarning

__all__ = ["ReporterStats", "ReporterHealth"]

_log = logging.getLogger("otel_swa.reporter")

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


class ReporterHealth:
    """The reporter's counters and liveness warning (a base of the reporter)."""

    @property
    def stats(self) -> ReporterStats:
        queue = self._queue
        return ReporterStats(
            samples_taken=queue.taken, samples_delivered=queue.delivered, ring_full_waits=queue.ring_full_waits,
            sink_errors=queue.sink_errors, pending=len(queue.pending), skipped_captures=self._skipped_captures,
            invalid_samples=queue.invalid, view_faults=types.MappingProxyType(dict(queue.view_faults)),
            liveness_warnings=self._liveness_warnings,
        )

    def expect_steps_from(self, hook: str) -> None:
        """Expect the engine to step this reporter from ``hook`` (the engine method an instrumentor
        wrapped): when it is closed having delivered no sample, it gives its liveness warning naming
        ``hook`` (:meth:`liveness_warning`; :mod:`otel_swa.lifecycle` does the same at the end of
        the process)."""
        self._liveness_hook = hook

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
        queue = self._queue
        if final and (queue.delivered or self._silence_reported):
            return None
        cause = "no_forward_step" if self._forward_ct == 0 else "no_sample_delivered"
        warning = LivenessWarning(
            cause, forward_ct=self._forward_ct, steps=self._forward_ct - self._delivered_at,
            samples_delivered=queue.delivered, samples_taken=queue.taken, invalid_samples=queue.invalid,
            skipped_captures=self._skipped_captures, verify_source=self.verify_source, hook=hook,
        )
        self._silence_reported = True
        self._liveness_warnings += 1
        if not queue.call_sinks("liveness", warning, None):
            _log.warning("otel-swa reporter: %s", warning.summary())
        return warning
