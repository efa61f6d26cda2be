"""One sample of the reporter: staged on the device, read back into a record on the host.

The device side (:meth:`SampleLayout.stage`, at the sampled step, on the current stream): every check
that is not fused into the sample's core pass stages its cells into its slice of the ring's row
(:meth:`otel_swa.checks.protocol.Check.stage`, in :data:`otel_swa.checks.CHECKS` order), then the core
pass (:func:`otel_swa.device.sample.stage_sample`: the divergence and out-of-window counts, the
view's fault evidence, and the cells of the checks fused into it: the SWA slot audit and the window
check), then every check keeps its host values (request ids, layer names...). The host side
(:meth:`SampleLayout.record`, once the copy reached the host): the core is read
(:func:`otel_swa.device.sample.read_sample`), then each check that ran reads its fields and its first
offenders from its slice, in :data:`~otel_swa.checks.CHECKS` order, into one
:class:`~otel_swa.record.SwaDivergenceRecord`.

A row of the ring: ``[core cells (STAGE_WIDTH, the fused checks' inside) | each other check's cells]``.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Sequence

from otel_swa.checks import CHECKS, SampleBatch, Staging
from otel_swa.checks.protocol import Check
from otel_swa.device.sample import FUSED_CELLS, STAGE_WIDTH, SampleMeta, SampleReading, read_sample, stage_sample
from otel_swa.record import Offender, SwaDivergenceRecord

__all__ = ["PendingSample", "SampleLayout"]

_log = logging.getLogger("otel_swa.reporter")
#: (check, part) pairs whose failure was logged (each is logged once per process, then left out quietly).
_failed: "set[tuple[str, str]]" = set()


def _check_failed(check: Check, part: str, exc: BaseException) -> None:
    """A check's own code raised: its fields are left out of this sample (the others' are not, and
    the engine's step goes on); logged the first time for this check and part."""
    if (check.name, part) not in _failed:
        _failed.add((check.name, part))
        _log.error("otel-swa check %r failed in %s(): %s: %s; its fields are left out of the samples where it "
                   "fails (logged once)", check.name, part, type(exc).__name__, exc,
                   exc_info=(type(exc), exc, exc.__traceback__))


class PendingSample(NamedTuple):
    """A sample staged and not yet delivered (host values taken at its step).

    Attributes:
        slot: its ring slot.
        forward_ct: the reporter's forward count at the sampled step.
        context: the OpenTelemetry context of that step.
        divergence_applicable: the view's (``False``: no FULL-to-SWA mapping, vLLM).
        meta: the core pass's :class:`~otel_swa.device.sample.SampleMeta`.
        host_totals: the accumulator's host part when the sample was taken.
        micro_batch: the micro-batch the step ran, or ``None``.
        batch: the batch's request ids and the slot audit's page size (offenders).
        kept: per check that ran, by name, what it keeps for its host part.
    """

    slot: int
    forward_ct: int
    context: Any
    divergence_applicable: bool
    meta: SampleMeta
    host_totals: "tuple[int, int]"
    micro_batch: "int | None"
    batch: SampleBatch
    kept: "dict[str, Any]"


class SampleLayout:
    """Where each check's cells lie in a row of the reporter's ring, and the two sides of a sample.

    Attributes:
        width: ``int64`` cells of a row: the core's and every check's.
        cells: ``(check, slice of the row)`` per check, in :data:`~otel_swa.checks.CHECKS` order.
    """

    def __init__(self, checks: Sequence[Check] = CHECKS) -> None:
        offset = STAGE_WIDTH
        cells = []
        for check in checks:
            if check.fused:
                cells.append((check, FUSED_CELLS[check.name]))
                continue
            width = check.width
            cells.append((check, slice(offset, offset + width)))
            offset += width
        self.width = offset
        self.cells: "tuple[tuple[Check, slice], ...]" = tuple(cells)

    # ------------------------------------------------------------------ device side
    def stage(self, row: Any, totals: Any, view: Any, staging: Staging) -> "dict[str, Any]":
        """Stage one sample of ``view`` into ``row`` (``int64 [width]`` on the device); return what
        each check that ran keeps (by name). ``staging.core`` is set to the core pass's meta; the
        core pass takes the slot audit's sweep (fused into it) from ``staging.parts``."""
        staged = {}
        for check, cells in self.cells:
            if not check.fused:
                try:
                    value = check.stage(staging, row[cells])
                except Exception as exc:  # a check's bug never stops the engine's step
                    _check_failed(check, "stage", exc)
                    continue
                if value is not None:
                    staged[check.name] = value
        audit = staging.parts.get("slot_audit")
        staging.core = stage_sample(
            row[:STAGE_WIDTH], totals, view.req_to_token, view.full_to_swa_index_mapping, view.req_pool_indices,
            view.seq_lens, getattr(view, "seq_lens_cpu", None), getattr(view, "swa_audit", None), staging.upload,
            req_pool_indices_cpu=getattr(view, "req_pool_indices_cpu", None), workspace=staging.workspace,
            sliding_window=getattr(view, "sliding_window", None),
            swa_eviction_allowance=getattr(view, "swa_eviction_allowance", None),
            extend_lens_cpu=getattr(view, "extend_lens_cpu", None),
            audit_sweep=audit.sweep if audit is not None else None,
        )
        kept = {}
        for check, _ in self.cells:
            if not check.fused and check.name not in staged:
                continue
            try:
                value = check.keep(staging, staged.get(check.name))
            except Exception as exc:
                _check_failed(check, "keep", exc)
                continue
            if value is not None or not check.fused:
                kept[check.name] = value
        return kept

    # ------------------------------------------------------------------ host side
    def read(self, values: Sequence[int], pending: PendingSample) -> SampleReading:
        """The core of a sample whose ``values`` (the row's ints) reached the host."""
        return read_sample(values, pending.meta, fused=False)

    def record(self, values: Sequence[int], pending: PendingSample, reading: SampleReading,
               verify_source: str) -> SwaDivergenceRecord:
        """The record of a sample: the core's five fields, each check's fields and offenders. A check
        whose reading raises, or gives a field it does not declare or a value that is no int >= 0,
        or an offender :class:`~otel_swa.record.Offender` refuses, is left out of this record
        (logged once for that check): the other checks' fields are kept.

        Raises:
            TypeError, ValueError: a value the record refuses (a negative total).
        """
        fields: "dict[str, Any]" = {}
        offenders = []
        kept = pending.kept
        for check, cells in self.cells:
            if check.name not in kept:
                continue
            try:
                found, where = check.read(values[cells], kept[check.name], pending.batch)
                names = check.names
                bad = [(k, v) for k, v in found.items()
                       if k not in names or not (v is None or (type(v) is int and v >= 0))]  # noqa: E721
                if bad:
                    raise ValueError(f"field {bad[0][0]}={bad[0][1]!r}: expected one of its own fields, an int >= 0")
                made = [Offender(**o) for o in where]
            except Exception as exc:  # a check's bug never stops the engine's step nor loses the others
                _check_failed(check, "read", exc)
                continue
            fields.update(found)
            offenders.extend(made)
        return SwaDivergenceRecord(
            forward_ct=pending.forward_ct,
            verify_full=reading.verify_full + pending.host_totals[0],
            verify_swa=reading.verify_swa + pending.host_totals[1],
            swa_full_idx_divergence=reading.divergence,
            swa_out_of_window_tokens=reading.out_of_window,
            divergence_applicable=pending.divergence_applicable,
            verify_source=verify_source,
            micro_batch=pending.micro_batch,
            offenders=tuple(offenders),
            **fields,
        )
