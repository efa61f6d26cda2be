"""The SWA slot audit: is every SWA slot in use held by exactly the live tokens that map into it?

Over the holders (the batch's live tokens and the engine's other holders, ``view.swa_audit``) and
the SWA free list, the audit counts leaked slots (pages in use no holder maps into), stale tokens
(holders whose SWA page is free) and shared slots (two FULL slots on one SWA slot), in passes over
several samples (:class:`~otel_swa.device.audit.SwaAuditSweep`, each pass's record carrying the pool
as it was at the pass's first sample). Fused into the sample's core pass: it reuses the slots the
core gathered for the batch.
"""

from __future__ import annotations

from typing import Any, Sequence

from otel_swa.checks.protocol import Check, CheckField, SampleBatch, Staging

__all__ = ["AUDIT_COUNTS", "AUDIT_OFFENDER_CELLS", "AUDIT_WIDTH", "SlotAuditCheck", "AuditPass", "CHECK"]

#: Values written by :func:`otel_swa.device.audit_counts.audit_counts` (all int64): pages in use, pages in use that live tokens
#: map into, leaked pages, stale tokens, shared SWA slots, then the first offender of each fault
#: (:data:`AUDIT_OFFENDER_CELLS`; meaningful only where its count is above 0).
AUDIT_COUNTS = 5
#: The first offenders' cells after the counts: the lowest leaked page (less 1); the first stale
#: holder (its index among the holders, its FULL slot, its SWA slot); a shared SWA slot (the lowest
#: when the slot table is swept, else the first holder's) and one FULL slot mapped into it.
AUDIT_OFFENDER_CELLS = (
    "leaked_page_index",  # the lowest leaked page, less 1 (pages are 1 .. num_swa_pages)
    "stale_holder", "stale_full_slot", "stale_swa_slot",
    "shared_swa_slot", "shared_full_slot",
)
AUDIT_WIDTH = AUDIT_COUNTS + len(AUDIT_OFFENDER_CELLS)


class AuditPass:
    """A reporter's audit state: its :class:`~otel_swa.device.audit.SwaAuditSweep` and where the
    pass under way began (``(holder layout, request ids)`` of that sample)."""

    __slots__ = ("sweep", "origin")

    def __init__(self, sweep: Any) -> None:
        self.sweep = sweep
        self.origin: "tuple | None" = None

    def reset_after_fork(self) -> None:
        """Forget the pass in progress (a forked child starts its own)."""
        self.sweep.reset()
        self.origin = None


def _batch_token(layout: "tuple | None", holder: int) -> "tuple[int, int] | None":
    """``(batch entry, position)`` of audit holder ``holder`` when it is a live token of the batch
    (``holders_include_batch``: the batch's tokens are the first holders, request after request on
    the live path, as whole rows of ``max_context_len`` on the dense one), else ``None``."""
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


class SlotAuditCheck(Check):
    name = "slot_audit"
    title = "SWA slot audit"
    line = "audit"
    fused = True
    always_summarised = True
    ran_when = "when the engine gives audit inputs"
    fields = (
        CheckField("swa_leaked_slots", "{slot}", "SWA slots of pages in use that no live token maps into",
                   role="fault", label="leaked SWA slots",
                   gauge=("slots.leaked", "SWA slots of pages in use that no live token maps into: allocated and "
                                          "unreachable")),
        CheckField("swa_stale_tokens", "{token}", "live tokens whose SWA page is on the free list",
                   role="fault", label="stale tokens",
                   gauge=("tokens.stale", "Live tokens whose SWA page is on the free list: the slot may be handed "
                                          "to another request")),
        CheckField("swa_shared_slots", "{slot}", "SWA slots that two distinct live FULL slots map to",
                   role="fault", label="shared SWA slots",
                   gauge=("slots.shared", "SWA slots that two distinct live FULL slots map to: two tokens write "
                                          "one slot")),
        CheckField("swa_pages_in_use", "{page}", "SWA pages allocated (not on the free list)",
                   gauge=("pages.in_use", "SWA pages allocated (not on the SWA free list) when the sample was "
                                          "taken")),
        CheckField("swa_pages_referenced", "{page}", "SWA pages in use that at least one live token maps into",
                   gauge=("pages.referenced", "SWA pages in use that at least one live token maps into (in use - "
                                              "referenced = leaked pages)")),
    )
    reason = "the SWA slot audit found faults (peak {found}); exit status 1"

    def default_part(self, kernels: Any, device: Any, options: "dict[str, Any]") -> AuditPass:
        return AuditPass(kernels.SwaAuditSweep(device, budget=options.get("audit_budget")))

    def keep(self, staging: Staging, staged: Any) -> Any:
        """After the core pass: where a pass began (its holders are this sample's), and, when a pass
        ended here, ``(page size, where it began)``."""
        meta, audit = staging.core, getattr(staging.view, "swa_audit", None)
        state = staging.parts[self.name]
        if meta.audit_started:
            layout = None
            if audit.holders_include_batch:
                if meta.path == "live":
                    layout = ("live", tuple(int(n) for n in staging.view.seq_lens_cpu))
                elif meta.path == "dense":
                    layout = ("dense", meta.batch, meta.width)
            state.origin = (layout, staging.request_ids)
        return (audit.page_size, state.origin) if meta.audited else None

    def read(self, cells: Sequence[int], kept: Any, batch: SampleBatch) -> "tuple[dict, list[dict]]":
        page, origin = kept
        pages_in_use, referenced, leaked_pages, stale, shared = cells[:AUDIT_COUNTS]
        fields = {"swa_leaked_slots": leaked_pages * page, "swa_stale_tokens": stale, "swa_shared_slots": shared,
                  "swa_pages_in_use": pages_in_use, "swa_pages_referenced": referenced}
        where = dict(zip(AUDIT_OFFENDER_CELLS, cells[AUDIT_COUNTS:AUDIT_WIDTH]))
        offenders = []
        if leaked_pages > 0:
            offenders.append(dict(fault="swa_leaked_slots", swa_page=where["leaked_page_index"] + 1))
        if stale > 0:
            token = _batch_token(origin[0] if origin else None, where["stale_holder"])
            ids = origin[1] if origin else None
            swa = where["stale_swa_slot"]
            offenders.append(dict(
                fault="swa_stale_tokens",
                request=ids[token[0]] if token and ids is not None and token[0] < len(ids) else None,
                position=token[1] if token else None, full_slot=where["stale_full_slot"], swa_slot=swa,
                swa_page=swa // page if page else None))
        if shared > 0:
            swa = where["shared_swa_slot"]
            offenders.append(dict(fault="swa_shared_slots", full_slot=where["shared_full_slot"], swa_slot=swa,
                                  swa_page=swa // page if page else None))
        return fields, offenders

    def summary(self, records: Sequence[Any]) -> str:
        audited = [r for r in records if self.present(r)]
        if not audited:
            return "n/a"
        peaks = {f.name: max(getattr(r, f.name) for r in audited) for f in self.fields if f.role == "fault"}
        verdict = "clean" if not any(peaks.values()) else "FAULTS"
        leaked, stale, shared = peaks.values()
        return (f"{verdict}: peak leaked {leaked} slots, stale {stale} tokens, shared {shared} slots "
                f"({len(audited)} samples)")


#: The SWA slot audit.
CHECK = SlotAuditCheck()
