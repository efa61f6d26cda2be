"""The write check: is each new token's K/V stored at the slot the engine's tables name?

After each attention layer stores the step's new K/V, a sampled step compares, for a bounded number
of (token, layer) pairs, what the layer was given to store with what the pool holds at the slot
the tables name (:class:`~otel_swa.device.write_check.WriteCheck`: provenance's own, or one the
engine runs on its KV cache's device and attaches with
:meth:`~otel_swa.reporter.SwaDivergenceReporter.attach_write_check`). A write to the wrong index,
into another token's slot or the wrong pool, is a mismatch.
"""

from __future__ import annotations

from typing import Any, Sequence

from otel_swa.checks.protocol import AttachedCheck, CheckField, InForwardCheck, SampleBatch, Staging, outcome_counter, outcome_summary

__all__ = ["WRITE_CELLS", "WRITE_WIDTH", "write_counts", "write_offender_fields", "WriteCheckSpec",
           "AttachedWriteCheck", "CHECK"]

#: The cells of :attr:`otel_swa.device.write_check.WriteCheck.cells`, in order.
WRITE_CELLS = (
    "checked",  # (token, layer) pairs compared
    "mismatched",  # of which the pool held other values
    "unchecked",  # pairs that could not be compared (a cache dtype or layout not covered)
    "found",  # 1 once a mismatch was recorded below
    "entry",  # its batch entry (the token's index in the step for a decode batch)
    "position",  # its position (-1 when the caller gave no positions)
    "full_slot",  # its FULL slot (out_cache_loc; -1 for a paged store of the SWA kind)
    "swa_slot",  # its SWA slot (-1 without a mapping; a paged store of the SWA kind: its own slot)
    "layer",  # the layer_id
    "swa",  # 1 when the layer's buffers are the SWA pool's, 0 for the FULL pool's
)
WRITE_WIDTH = len(WRITE_CELLS)
_C = {name: index for index, name in enumerate(WRITE_CELLS)}


def write_counts(values: Sequence[int]) -> "tuple[int, int, int]":
    """``(checked, mismatched, unchecked)`` from the :data:`WRITE_WIDTH` staged ints."""
    return int(values[_C["checked"]]), int(values[_C["mismatched"]]), int(values[_C["unchecked"]])


def write_offender_fields(values: Sequence[int]) -> "dict[str, int | str | None] | None":
    """The first mismatch (``entry``, ``position``, ``full_slot``, ``swa_slot``, ``layer``, ``pool``
    (``"full"``/``"swa"``); a position or slot not known is ``None``), or ``None`` when nothing
    mismatched."""
    if not values[_C["found"]]:
        return None
    fields: dict = {name: int(values[_C[name]]) for name in WRITE_CELLS[_C["entry"]:_C["layer"] + 1]}
    fields["pool"] = "swa" if values[_C["swa"]] else "full"
    for name in ("position", "full_slot", "swa_slot"):
        if fields[name] < 0:
            fields[name] = None
    return fields


class AttachedWriteCheck(AttachedCheck):
    """A write check the engine runs itself (:class:`~otel_swa.checks.protocol.AttachedCheck`;
    ``check``: the :class:`~otel_swa.device.write_check.WriteCheck`)."""

    __slots__ = ()
    what = "the write check"


class WriteCheckSpec(InForwardCheck):
    name = "write"
    title = "write check"
    line = "provenance"
    fields = (
        CheckField("kv_write_checks", "{pair}",
                   "(token, layer) pairs whose stored K and V were compared with what the layer was given to store"),
        CheckField("kv_write_mismatches", "{pair}",
                   "token-layer pairs whose K/V in the pool differs from what the layer was given to store",
                   role="fault", label="KV write mismatches",
                   explain="{peak} token-layer pair(s) of a step's new tokens were not stored at the slot the tables "
                           "name (the pool holds other K/V there: a write to the wrong index)"),
        CheckField("kv_write_unchecked", "{pair}",
                   "token-layer pairs the write check could not compare (a quantized cache, a layout it does not "
                   "cover)",
                   role="info", label="unchecked KV writes"),
    )
    ran_when = "when the engine runs the write check"
    counters = (outcome_counter(
        "write_check.tokens", "{token}",
        "New tokens' K/V writes (one token at one layer each) the write check compared with what the KV pool "
        "holds at the slot the engine's tables name, by outcome (kv_cache.swa.write_check.outcome): agree, "
        "disagree (the pool holds other values there: a write to the wrong index; must stay 0), unchecked (a "
        "quantized cache or a layout the check does not cover)",
        "write_check.outcome", ("kv_write_checks", "kv_write_mismatches", "kv_write_unchecked"), ran_when),)
    reason = ("the write check and provenance found KV that is not the KV of the token the tables name (peak "
              "{found}); exit status 1")

    width = WRITE_WIDTH

    def keep(self, staging: Staging, staged: Any) -> Any:
        return AttachedCheck.kept(staged)  # None: provenance's own write check, its entry the batch entry

    def read(self, cells: Sequence[int], kept: Any, batch: SampleBatch) -> "tuple[dict, list[dict]]":
        checked, mismatched, unchecked = write_counts(cells)
        fields = {"kv_write_checks": checked, "kv_write_mismatches": mismatched, "kv_write_unchecked": unchecked}
        where = write_offender_fields(cells)
        if where is None or not mismatched:
            return fields, []
        swa = where["swa_slot"]
        if kept is None:  # provenance's own write check: its entry is the batch entry
            return fields, [dict(fault="kv_write_mismatches", request=batch.request(where["entry"]),
                                 position=where["position"], full_slot=where["full_slot"], swa_slot=swa,
                                 swa_page=batch.swa_page(swa), layer=where["layer"], pool=where["pool"])]
        return fields, [dict(fault="kv_write_mismatches", **AttachedCheck.names(kept, where["entry"], where["layer"]),
                             position=where["position"], full_slot=where["full_slot"], swa_slot=swa,
                             layer=where["layer"], pool=where["pool"])]

    def summary(self, records: Sequence[Any]) -> str:
        return outcome_summary(self, records, "(token, layer) stores mismatched", "WRONG WRITES")


#: The write check.
CHECK = WriteCheckSpec()
