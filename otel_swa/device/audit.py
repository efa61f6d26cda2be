"""The SWA slot audit: leaked SWA pages, stale mappings and shared SWA slots, on the device.

torch only, no host synchronisation: the counts are computed into a device tensor, so they can ride
in the same device-to-host copy as the sample (see ``otel_swa.reporter``).

Facts behind it (SGLang issues #27789 and #36081: SWA slots leaked; #27586: a live token's SWA slot
freed and handed out again): the SWA allocator hands out pages (``page_size`` slots; page id
``slot // page_size``; page 0 reserved), keeps the free ones on a free list, and every token a live
holder (a running request, the prefix cache) still reads maps its FULL slot to an SWA slot through
``full_to_swa_index_mapping`` (0 = none). So:

* a page that is not free and that no live token maps into is **leaked** (nothing will free it);
* a live token whose SWA page is on the free list is **stale** (another request may get it);
* an SWA slot that two distinct live FULL slots map to is **shared** (two tokens write one slot).
  The same FULL slot held twice (prefix sharing) is not a fault and is not counted.

Out-of-range ids (a free page id outside ``1..num_pages``, a FULL slot outside the mapping, an SWA
slot beyond the pool) are ignored rather than read out of bounds. FULL slot 0 is read like any
other: it is the engines' padding slot and its mapping 0, so it holds nothing. The slots of the
reserved page 0 (``1 .. page_size - 1``) are never handed out: a token mapped into one is neither
referenced nor stale, but two distinct FULL slots mapped into one count as sharing it.

The audit's parts: the counts on the device in one sample (:mod:`otel_swa.device.audit_counts`:
its work, its cost, and the holders the sample's own gathers give) and the audit bounded by the
holders over several samples, the one the reporter runs (:mod:`otel_swa.device.audit_sweep`: the
passes and the bound within which a fault is reported). This module holds the audit as host ints
(:func:`audit_swa_slots`, :class:`SwaSlotAudit`), and every name is importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from otel_swa.device.audit_counts import (
    AUDIT_COUNTS, AUDIT_OFFENDER_CELLS, AUDIT_WIDTH, audit_counts, audit_holder_slots, holder_slots,
)
from otel_swa.device.audit_sweep import (  # noqa: F401 (_STAMP_LIMIT: importable here, as before)
    _STAMP_LIMIT, AUDIT_BUDGET, AUDIT_BUDGET_CUDA, SwaAuditSweep, free_id_parts,
)

__all__ = ["AUDIT_WIDTH", "AUDIT_COUNTS", "AUDIT_OFFENDER_CELLS", "AUDIT_BUDGET", "AUDIT_BUDGET_CUDA", "SwaSlotAudit", "SwaAuditSweep",
           "audit_counts", "audit_holder_slots", "audit_swa_slots", "free_id_parts", "holder_slots"]


@dataclass(frozen=True)
class SwaSlotAudit:
    """Health of the SWA pool at one moment: leaked slots and stale mappings (all ints).

    Attributes:
        page_size: tokens per page of both pools.
        live_tokens: live tokens examined (positions ``< seq_len`` of the given rows, plus
            ``held_full_slots``).
        swa_slots_in_use: SWA slots not on the SWA free list, counted in whole pages
            (``pages in use x page_size``), the unit the SWA allocator hands out.
        swa_slots_referenced: slots of the SWA pages that at least one live token maps to
            (``pages x page_size``).
        leaked_swa_slots: slots of in-use SWA pages that no live token maps to: allocated, never
            freed, unreachable (nothing will free them). (SGLang #27789, #36081)
        stale_tokens: live tokens whose SWA slot lies on a page the SWA free list holds: the slot
            may be handed to another request while this token still reads it. (SGLang #27586)
        duplicate_swa_slots: SWA slots that two or more distinct live FULL slots map to.
    """

    page_size: int
    live_tokens: int
    swa_slots_in_use: int
    swa_slots_referenced: int
    leaked_swa_slots: int
    stale_tokens: int
    duplicate_swa_slots: int

    @property
    def ok(self) -> bool:
        """No leaked slot, no stale token, no SWA slot shared by two FULL slots."""
        return self.leaked_swa_slots == 0 and self.stale_tokens == 0 and self.duplicate_swa_slots == 0


def audit_swa_slots(
    full_to_swa_index_mapping: torch.Tensor,
    swa_free_page_ids: torch.Tensor,
    num_swa_pages: int,
    page_size: int,
    live_full_slots: torch.Tensor,
) -> SwaSlotAudit:
    """The audit as host ints: validates its input, runs :func:`audit_counts`, reads it back.

    Synchronises once (it validates ranges and returns ints): call it at sampling steps, outside
    any CUDA graph, never in the forward. The reporter uses :func:`audit_counts` directly instead,
    inside its asynchronous sample.

    Args: as :func:`audit_counts` (``live_full_slots`` = ``holder_full_slots``).

    Raises:
        ValueError: ``page_size`` or ``num_swa_pages`` below 1, a free page id or a live FULL slot
            outside its range.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if num_swa_pages < 1:
        raise ValueError(f"num_swa_pages must be >= 1, got {num_swa_pages}")
    device = full_to_swa_index_mapping.device
    free = swa_free_page_ids.to(device=device, dtype=torch.int64).reshape(-1)
    if free.numel() and (int(free.min()) < 1 or int(free.max()) > num_swa_pages):
        raise ValueError(f"SWA free list holds page ids outside 1..{num_swa_pages}")
    full = live_full_slots.to(device=device, dtype=torch.int64).reshape(-1)
    size = full_to_swa_index_mapping.shape[0]
    if full.numel() and (int(full.min()) < 0 or int(full.max()) >= size):
        raise ValueError(f"live FULL slots outside the mapping's range 0..{size - 1}")
    out = torch.zeros(AUDIT_WIDTH, dtype=torch.int64, device=device)
    in_use, referenced, leaked, stale, shared = audit_counts(
        out, full_to_swa_index_mapping, free, num_swa_pages, page_size, full
    ).tolist()[:AUDIT_COUNTS]
    return SwaSlotAudit(
        page_size=page_size,
        live_tokens=int(full.numel()),
        swa_slots_in_use=in_use * page_size,
        swa_slots_referenced=referenced * page_size,
        leaked_swa_slots=leaked * page_size,
        stale_tokens=stale,
        duplicate_swa_slots=shared,
    )
