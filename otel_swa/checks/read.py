"""The read check: did sliding-window attention read the KV the FULL-to-SWA mapping gives?

At a sampled step a few queries of the engine's sliding-window layers are recomputed from the KV
pool through the mapping and compared with the layer's own output
(:class:`~otel_swa.device.read_check.ReadCheck`, switched on by the engine with
:meth:`~otel_swa.reporter.SwaDivergenceReporter.enable_read_check`); the sample copies and clears its
cells. A query whose output disagrees beyond the dtype's rounding read other KV than the mapping's
(sglang 0.5.23's torch-native backend reads sliding-window layers at raw FULL indices).

The smallest whole check, and the worked example of ``docs/checks.md``.
"""

from __future__ import annotations

from typing import Any, Sequence

from otel_swa.checks.protocol import CheckField, InForwardCheck, SampleBatch, Staging, outcome_counter, outcome_summary
from otel_swa.checks.write import AttachedWriteCheck

__all__ = ["READ_CELLS", "READ_WIDTH", "read_counts", "read_offender_fields", "ReadCheckSpec", "CHECK"]

#: The cells of :attr:`otel_swa.device.read_check.ReadCheck.cells`, in order.
READ_CELLS = (
    "checked",  # queries recomputed and compared
    "mismatched",  # of which disagreed
    "unchecked",  # queries that could not be checked (an unsupported variant, a graph replay)
    "found",  # 1 once a disagreeing query was recorded below
    "entry",  # its batch entry
    "row",  # its req_to_token row
    "position",  # its position
    "full_slot",  # its FULL slot
    "swa_slot",  # its SWA slot (the FULL slot for a layer without a mapping)
    "layer",  # the layer_id
)
#: int64 cells a read check stages with the sample.
READ_WIDTH = len(READ_CELLS)
_C = {name: index for index, name in enumerate(READ_CELLS)}


def read_offender_fields(values: Sequence[int]) -> "dict[str, int] | None":
    """The first disagreeing query's cells as ints (``entry``, ``row``, ``position``,
    ``full_slot``, ``swa_slot``, ``layer``), or ``None`` when no query disagreed; ``values`` are
    the :data:`READ_WIDTH` staged ints."""
    if not values[_C["found"]]:
        return None
    return {name: int(values[_C[name]]) for name in READ_CELLS[_C["entry"]:]}


def read_counts(values: Sequence[int]) -> "tuple[int, int, int]":
    """``(checked, mismatched, unchecked)`` from the :data:`READ_WIDTH` staged ints."""
    return int(values[_C["checked"]]), int(values[_C["mismatched"]]), int(values[_C["unchecked"]])


class ReadCheckSpec(InForwardCheck):
    name = "read"
    title = "read check"
    line = "audit"
    fields = (
        CheckField("swa_read_checks", "{query}",
                   "queries of the sampled step whose sliding-window attention output was recomputed from the KV "
                   "pool through the mapping and compared with the engine's"),
        CheckField("swa_read_mismatches", "{query}",
                   "checked queries whose sliding-window attention output differs from one recomputed from the KV "
                   "pool through the mapping",
                   role="fault", label="read mismatches",
                   explain="{peak} checked query(ies) of a sliding-window layer read other KV than the mapping gives "
                           "(their attention output differs from the one recomputed from the pool)"),
        CheckField("swa_read_unchecked", "{query}",
                   "queries of sliding-window layers the read check could not recompute (an attention variant it "
                   "does not cover, a step replayed from a CUDA graph)",
                   role="info", label="unchecked reads"),
    )
    ran_when = "when the engine runs the read check"
    counters = (outcome_counter(
        "read_check.queries", "{query}",
        "Queries of sliding-window layers whose attention output the read check recomputed from the KV pool "
        "through the FULL-to-SWA mapping, by outcome (kv_cache.swa.read_check.outcome): agree, disagree "
        "(attention read other KV than the mapping's: must stay 0), unchecked (a variant the check does not cover)",
        "read_check.outcome", ("swa_read_checks", "swa_read_mismatches", "swa_read_unchecked"), ran_when),)
    reason = ("the read check found sliding-window attention reading other KV than the mapping gives (peak {found}); "
              "exit status 1")

    width = READ_WIDTH

    def keep(self, staging: Staging, staged: Any) -> Any:
        if isinstance(staged, AttachedReadCheck):
            return staged.request_ids()
        return None  # the reporter's own read check: its entry is the batch entry

    def read(self, cells: Sequence[int], kept: Any, batch: SampleBatch) -> "tuple[dict, list[dict]]":
        checked, mismatched, unchecked = read_counts(cells)
        fields = {"swa_read_checks": checked, "swa_read_mismatches": mismatched, "swa_read_unchecked": unchecked}
        where = read_offender_fields(cells)
        if where is None or not mismatched:
            return fields, []
        entry = where["entry"]
        if kept is not None:  # an attached check: its entry is a row of the engine's own batch
            request = kept[entry] if entry is not None and 0 <= entry < len(kept) else None
        else:
            request = batch.request(entry)
        return fields, [dict(fault="swa_read_mismatches", request=request, row=where["row"],
                             position=where["position"], full_slot=where["full_slot"], swa_slot=where["swa_slot"],
                             swa_page=batch.swa_page(where["swa_slot"]), layer=where["layer"])]

    def summary(self, records: Sequence[Any]) -> str:
        return outcome_summary(self, records, "queries disagreed", "WRONG READS")


class AttachedReadCheck(AttachedWriteCheck):
    """A read check the engine runs itself (a :class:`~otel_swa.device.read_check.ReadCheck` made
    with the model runner, e.g. vLLM's), with the request ids of the batch its cells hold (the
    reporter's part for :meth:`~otel_swa.reporter.SwaDivergenceReporter.attach_read_check`)."""

    __slots__ = ()


#: The read check.
CHECK = ReadCheckSpec()
