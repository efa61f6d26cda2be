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
slot beyond the pool) are ignored rather than read out of bounds.

Cost. The audit reads only the ``n`` holder slots and the ``k`` free page ids: O(n + k) work, none
of it proportional to the pool sizes, and no table over the FULL pool. Distinct values (distinct
free pages, distinct referenced pages, SWA slots reached twice) are found without sorting and
without clearing a table: every element writes its own index ``i`` into a table cell addressed by
its value (``table[value_i] = i``; with duplicates one writer wins), then reads the cell back; the
elements that read their own index are one per distinct value. Free-list membership is a stamp
(one per audit) written into the free pages' cells. The tables are as long as the SWA id ranges (SWA
pages, SWA slots) but never scanned; they are kept by a
:class:`~otel_swa.device.workspace.Workspace` on the CPU and taken from the caching allocator for
each audit on CUDA (the small stamp table is kept on every device). No atomic operation is involved
(the old pool-wide ``index_add_`` piled them on index 0 on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from otel_swa.device.workspace import Workspace

__all__ = ["AUDIT_WIDTH", "SwaSlotAudit", "audit_counts", "audit_swa_slots"]

#: Values written by :func:`audit_counts`: pages in use, pages in use that live tokens map into,
#: leaked pages, stale tokens, shared SWA slots (all int64).
AUDIT_WIDTH = 5

_INDEX = torch.int32  # table cells hold element indices (< 2**31 elements per audit)


def _first_of_each_value(table: torch.Tensor, keys: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``bool [n]``: True for one element per distinct value of ``keys`` (``int64 [n]``, valid
    indices of ``table``); ``order`` is ``arange(n)`` in the table's dtype. (``scatter_``, not
    ``index_put_``: the same writes, four times faster on the CPU.)"""
    table.scatter_(0, keys, order)
    return table.index_select(0, keys) == order


def audit_counts(
    out: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor,
    swa_free_page_ids: torch.Tensor,
    num_swa_pages: int,
    page_size: int,
    holder_full_slots: torch.Tensor,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Write the audit counts into ``out`` (``int64 [AUDIT_WIDTH]`` on the device) and return it.

    Args:
        out: destination, ``int64 [AUDIT_WIDTH]``: ``[pages_in_use, pages_referenced,
            leaked_pages, stale_tokens, shared_swa_slots]``. Multiply page counts by ``page_size``
            for slots.
        full_to_swa_index_mapping: ``int64`` (or ``int32``) ``[num_full_slots]``, the SWA slot of
            each FULL slot.
        swa_free_page_ids: ``int [k]``, the SWA pool's free page ids (slot ids when
            ``page_size == 1``), every free list together.
        num_swa_pages: pages of the SWA pool (ids ``1 .. num_swa_pages``), host int >= 1.
        page_size: slots per page, host int >= 1.
        holder_full_slots: ``int [n]``, the FULL slot of every token a live holder still reads;
            give all holders, or the missing ones' pages show as leaked.
        workspace: where the id tables live (see the module docstring); default a new one, whose
            CPU tables are then made for this call only.

    Work: O(n + k) device operations, independent of the pool sizes; no host sync.

    Raises:
        ValueError: ``num_swa_pages`` or ``page_size`` below 1.
    """
    if num_swa_pages < 1 or page_size < 1:
        raise ValueError(f"num_swa_pages and page_size must be >= 1, got {num_swa_pages} and {page_size}")
    mapping = full_to_swa_index_mapping
    device = mapping.device
    ws = workspace if workspace is not None else Workspace(device)
    pages = num_swa_pages
    swa_slots = (pages + 1) * page_size
    size = mapping.shape[0]

    free = swa_free_page_ids.reshape(-1)
    if free.dtype != torch.int64:
        free = free.long()
    full = holder_full_slots.reshape(-1)
    if full.dtype != torch.int64:
        full = full.long()
    k, n = free.numel(), full.numel()
    order_k = ws.arange(k, _INDEX)
    order_n = ws.arange(n, _INDEX)
    page_table = ws.get("audit.pages", pages + 2, _INDEX)  # ids 0..pages, and pages + 1
    free_mark = ws.kept("audit.free", pages + 2, _INDEX, fill=0)  # kept: holds the stamp of the last audit
    stamp = ws.stamp()
    if stamp == 1:  # the first audit on this table, or the stamps wrapped: no cell may carry it yet
        free_mark.fill_(0)

    # Free pages: valid ids 1..pages; the others are sent to cell 0 (page 0 never counts). Routing
    # is a multiplication by the mask throughout: masked_fill and where branch on every element and
    # run seven times slower on the CPU when the mask is random.
    free_keys = free.clamp(0, pages + 1)
    free_ok = (free_keys == free) & (free_keys != 0) & (free_keys != pages + 1)
    free_keys.mul_(free_ok)
    distinct_free = torch.count_nonzero(_first_of_each_value(page_table, free_keys, order_k) & free_ok)
    free_mark.index_fill_(0, free_keys, stamp)  # this audit's free pages carry its stamp

    # Holders: their SWA slot and page (page 0 is reserved: never counted). A holder whose FULL slot
    # lies outside the mapping maps nowhere: its page is 0.
    keys = full.clamp(0, size - 1)
    full_ok = keys == full
    swa = mapping.index_select(0, keys)
    if swa.dtype != torch.int64:
        swa = swa.long()
    in_pool = full_ok & (swa > 0) & (swa < swa_slots)
    if page_size == 1:
        page = swa.clamp(0, pages + 1).mul_(full_ok)
        mapped = in_pool
    else:
        page = torch.div(swa, page_size, rounding_mode="floor").clamp_(0, pages + 1).mul_(full_ok)
        mapped = in_pool & (page >= 1)

    # Is a holder's page on the free list? Its cell carries this audit's stamp (older stamps: no).
    on_free_list = free_mark.index_select(0, page) == stamp
    stale = torch.count_nonzero(mapped & on_free_list)

    # Pages in use that a holder maps into: distinct pages over holders whose page is not free.
    # No routing needed: the holders of one page all agree on "in use" (a page-wide fact); holders
    # mapping nowhere have page 0 or the spare page, which never count.
    in_use_ref = mapped & ~on_free_list
    referenced = torch.count_nonzero(_first_of_each_value(page_table, page, order_n) & in_use_ref)

    # Shared SWA slots: SWA slots that two distinct held FULL slots map to (FULL slot 0 is padding;
    # the same FULL slot held twice is prefix sharing, not a fault). Every holder writes its FULL
    # slot into its SWA slot's cell; a holder that reads back another FULL slot shares its SWA slot
    # with one; the distinct SWA slots of those holders are the shared ones. No table over the FULL
    # pool is needed.
    held = in_pool & (full != 0)
    slot_table = ws.get("audit.swa", swa_slots, torch.int64)  # FULL slot ids, then element indices
    slot_keys = swa * held  # SWA slot 0 ("none") takes the holders that do not count
    slot_table.scatter_(0, slot_keys, keys)
    sharing = (slot_table.index_select(0, slot_keys) != keys) & held
    slot_keys.mul_(sharing)
    shared = torch.count_nonzero(_first_of_each_value(slot_table, slot_keys, ws.arange(n)) & sharing)

    in_use = pages - distinct_free
    torch.stack([in_use, referenced, in_use - referenced, stale, shared], out=out)
    return out


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
    ).tolist()
    return SwaSlotAudit(
        page_size=page_size,
        live_tokens=int(full.numel()),
        swa_slots_in_use=in_use * page_size,
        swa_slots_referenced=referenced * page_size,
        leaked_swa_slots=leaked * page_size,
        stale_tokens=stale,
        duplicate_swa_slots=shared,
    )
