"""The SWA slot audit in one sample: leaked SWA pages, stale mappings and shared SWA slots, on the device.

torch only, no host synchronisation: the counts are computed into a device tensor, so they can ride
in the same device-to-host copy as the sample (see ``otel_swa.reporter``).

What is leaked, stale and shared, and how out-of-range ids are read: :mod:`otel_swa.device.audit`
(the facts behind the audit, SGLang issues #27789, #36081 and #27586).

Cost. The audit reads the ``n`` holder slots and the ``k`` free page ids, and sweeps the SWA pool's
page cells (``num_swa_pages + 2``): never a table over the FULL pool. Free pages and the pages
holders map into are one bit per page cell (a bool table cleared and written at the ids, then
counted; the pages holders map into are read from the shared-slot table below when it is swept);
in a healthy pool the pages are the free ones plus those holders map into, so the sweep is
O(n + k) too (leaked pages add to it). Shared SWA slots: every holder writes its FULL slot into
its SWA slot's cell (``table[slot_i] = full_i``; with duplicates one writer wins) and reads the
cell back; a holder that reads another FULL slot shares its slot, and the distinct slots of those
holders are marked in a bit per SWA slot (counted when the SWA pool's slots are at most ``4 n``;
otherwise found without a sweep: each such holder writes its own index into its slot's cell, and
the holders that read their own index back are one per slot). Routing an element to cell 0 is a
multiplication by a 0/1 mask (``masked_fill_`` and ``where`` branch per element and run several
times slower on the CPU when the mask is random). Every temporary of ``n`` elements is a
:class:`~otel_swa.device.workspace.Workspace` buffer (kept on the CPU, where a fresh one of a few
hundred KB is an ``mmap`` whose pages fault in as they are written; from the caching allocator on
CUDA). No atomic operation is involved (the old pool-wide ``index_add_`` piled them on index 0 on
a GPU), and no host sync.

When the batch's live tokens are holders too, the sample's own gathers give their FULL and SWA
slots (:func:`audit_holder_slots`, ``SwaAuditInputs.holders_include_batch``): the audit then
gathers only the other holders.

The audit bounded by the holders, over several samples, is :mod:`otel_swa.device.audit_sweep`; the
audit as host ints, :func:`otel_swa.device.audit.audit_swa_slots`.
"""

from __future__ import annotations

from typing import Callable

import torch

from otel_swa.checks.slot_audit import AUDIT_COUNTS, AUDIT_OFFENDER_CELLS, AUDIT_WIDTH

from otel_swa.device.workspace import Workspace

__all__ = ["AUDIT_WIDTH", "AUDIT_COUNTS", "AUDIT_OFFENDER_CELLS", "audit_counts", "audit_holder_slots", "holder_slots",
           "write_cells"]



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
            leaked_pages, stale_tokens, shared_swa_slots]``, then the first offenders
            (:data:`AUDIT_OFFENDER_CELLS`). Multiply page counts by ``page_size`` for slots.
        full_to_swa_index_mapping: ``int64`` (or ``int32``) ``[num_full_slots]``, the SWA slot of
            each FULL slot.
        swa_free_page_ids: ``int [k]``, the SWA pool's free page ids (slot ids when
            ``page_size == 1``), every free list together.
        num_swa_pages: pages of the SWA pool (ids ``1 .. num_swa_pages``), host int >= 1.
        page_size: slots per page, host int >= 1.
        holder_full_slots: ``int [n]``, the FULL slot of every token a live holder still reads;
            give all holders, or the missing ones' pages show as leaked; a holder given twice is
            two holders (its stale token counts twice). Ids outside the mapping hold nothing.
        workspace: where the id tables live (see the module docstring); default a new one, whose
            CPU tables are then made for this call only.

    Work: 12 passes over the ``n`` holders (one of them the gather from the mapping; one more at
    page size > 1), 4 over the ``k`` free ids, about 7 over the ``num_swa_pages + 2`` page cells,
    and, when the ``swa_slots + 1`` slot cells are at most ``4 n``, a fill, a comparison, a clear
    and a count over them (else, in their place, one more scatter and about 7 more passes over the
    holders). No host sync.

    Raises:
        ValueError: ``num_swa_pages`` or ``page_size`` below 1.
    """
    if num_swa_pages < 1 or page_size < 1:
        raise ValueError(f"num_swa_pages and page_size must be >= 1, got {num_swa_pages} and {page_size}")
    mapping = full_to_swa_index_mapping
    ws = workspace if workspace is not None else Workspace(mapping.device)
    keys, slot = holder_slots(mapping, holder_full_slots, (num_swa_pages + 1) * page_size, ws)
    return audit_holder_slots(out, keys, slot, swa_free_page_ids, num_swa_pages, page_size, ws)


def holder_slots(
    mapping: torch.Tensor, holder_full_slots: torch.Tensor, swa_slots: int, ws: Workspace | None = None
) -> "tuple[torch.Tensor, torch.Tensor]":
    """The holders' FULL slots as table keys and their SWA slots, as :func:`audit_holder_slots` takes them.

    Args:
        mapping: ``full_to_swa_index_mapping``, ``int [num_full_slots]``.
        holder_full_slots: ``int [n]`` on the same device.
        swa_slots: SWA slot ids ``0 .. swa_slots - 1`` exist (``(num_swa_pages + 1) x page_size``).
        ws: where the results and temporaries are written (default: fresh tensors).

    Returns:
        ``(keys, slot)``, ``[n]`` each: ``keys`` the FULL slots clamped into ``0 .. num_full_slots
        - 1`` (the holders' dtype), ``slot`` ``int64``, the SWA slot clamped into ``0 ..
        swa_slots`` (``swa_slots``: beyond the pool), 0 where the holder's FULL slot is outside the
        mapping. Five passes over the holders (one gather); on the CPU, when every FULL slot is in the
        mapping (read there without a sync), three: its range, the gather and a clamp, and ``keys`` is
        ``holder_full_slots`` itself. No host sync on a GPU.
    """
    full = holder_full_slots.reshape(-1)
    size = mapping.shape[0]
    if size < 1:  # no FULL slot: nothing is held
        full = full[:0]
    ws = ws if ws is not None else Workspace(mapping.device)
    n = full.numel()
    if n and full.device.type == "cpu":
        # on the CPU the range is read without a sync: every FULL slot in the mapping (a healthy
        # engine) needs no clamped copy, no out-of-range mask and no fill (two passes instead of five)
        if _within(full, 0, size - 1):
            slot = torch.index_select(mapping, 0, full, out=ws.get("audit.gathered", n, mapping.dtype))
            if slot.dtype != torch.int64:
                slot = slot.to(torch.int64)
            return full, slot.clamp_(0, swa_slots)
    # Every temporary of n elements goes to a workspace buffer: on the CPU a fresh one of a few
    # hundred KB is an mmap whose pages fault in as they are written (the cost of a pass).
    keys = torch.clamp(full, 0, max(size - 1, 0), out=ws.get("audit.keys", n, full.dtype))
    outside = torch.ne(keys, full, out=ws.get("audit.outside", n, torch.bool))  # all False on a healthy engine:
    # the fill below then never branches wrong
    slot = torch.index_select(mapping, 0, keys, out=ws.get("audit.gathered", n, mapping.dtype))
    if slot.dtype != torch.int64:
        slot = slot.to(torch.int64)
    slot.clamp_(0, swa_slots).masked_fill_(outside, 0)
    return keys, slot


def audit_holder_slots(
    out: "torch.Tensor | list",
    keys: torch.Tensor,
    slot: torch.Tensor,
    swa_free_page_ids: torch.Tensor,
    num_swa_pages: int,
    page_size: int,
    ws: Workspace,
) -> "torch.Tensor | list":
    """The audit counts from the holders' keys and SWA slots (:func:`holder_slots`, or the
    sample's own gathers of the batch's live tokens) into ``out``; see :func:`audit_counts`
    (``out`` may be a list: :func:`write_cells`).

    ``keys`` (``int [n]``, FULL slots) and ``slot`` (``int64 [n]``, SWA slots in ``0 ..
    swa_slots``, 0 for a holder that holds nothing) are valid table indices; ``slot`` is
    overwritten. No host sync.
    """
    pages = num_swa_pages
    spare_page = pages + 1  # the cell of SWA ids beyond the pool (page 0 takes "none" and bad ids)
    swa_slots = (pages + 1) * page_size

    # One bool table of three rows of page cells (``pages + 2`` each: "none", the pool's pages, the
    # spare cell), cleared at once: free pages (then, negated, the pages in use), the pages a holder
    # maps into, and at page size 1 (a page is a slot) the shared SWA slots.
    n = slot.numel()
    cells = pages + 2
    rows = 3 if page_size == 1 else 2
    table = ws.get("audit.cells", rows * cells, torch.bool).view(rows, cells).zero_()
    is_free, cell_present = table[0], table[1]

    # Free pages: written at the free ids clamped into the cells (ids below 1 go to cell 0, ids
    # beyond the pool to the spare cell, both cleared again: neither is ever free).
    free = swa_free_page_ids.reshape(-1)
    if free.dtype != torch.int64:  # index_fill_ takes int64 indices only
        free = free.long()
    if free.numel() and free.device.type == "cpu" and _within(free, 1, pages):
        # on the CPU the range is read without a sync: ids all in the pool (a healthy engine) need
        # no clamped copy and no clearing of cells 0 and spare
        is_free.index_fill_(0, free, True)
    elif free.numel():
        free_keys = torch.clamp(free, 0, spare_page, out=ws.get("audit.free_keys", free.numel(), torch.int64))
        is_free.index_fill_(0, free_keys, True)
        is_free.index_fill_(0, ws.constant((0, spare_page)), False)  # cells 0 and spare in one pass

    page = slot if page_size == 1 else torch.div(slot, page_size, rounding_mode="floor", out=ws.get("audit.page", n, torch.int64))

    # Stale: holders whose page is on the free list (cells 0 and spare never are).
    on_free = torch.index_select(is_free, 0, page, out=ws.get("audit.on_free", n, torch.bool))
    stale = torch.count_nonzero(on_free)
    zero = ws.zeros(1)[0]  # (a view: no device operation) the offender cells of a fault counted 0 on the CPU
    stale_at = _first_when(stale, lambda: on_free, zero)
    stale_swa = _at_when(slot, stale_at, zero)  # read before the shared-slot pass below overwrites slot

    in_use_cells = is_free.logical_not_()[1:spare_page]  # the free table becomes "in use"

    # Shared SWA slots: SWA slots that two distinct held FULL slots map to (the same FULL slot held
    # twice is prefix sharing, not a fault). Every holder writes its FULL slot into its SWA slot's
    # cell and reads the cell back: a holder that reads another FULL slot shares its SWA slot; the
    # distinct SWA slots of those holders are the shared ones. Cells 0 and spare never count.
    # When the SWA pool's cells are few against the holders (at most 4 n), the table is cleared to
    # -1 first (FULL slots are >= 0), and it also says which pages a holder maps into: those with
    # a written cell. Otherwise only the cells written just before are read, and the pages a holder
    # maps into are a presence bit per page cell, written by one more scatter.
    small = swa_slots + 1 <= max(4 * n, pages + 2)
    owner = ws.get("audit.swa", swa_slots + 1, keys.dtype)
    if small:
        owner.fill_(-1)
    owner.scatter_(0, slot, keys)

    # Pages in use that a holder maps into (row 1 of the table, cells 1 .. pages).
    present = cell_present[1:spare_page]
    if small:
        if page_size == 1:
            torch.ge(owner[1:swa_slots], 0, out=present)
        else:
            written = torch.ge(owner[page_size:swa_slots], 0, out=ws.get("audit.written", swa_slots - page_size, torch.bool))
            torch.any(written.view(pages, page_size), 1, out=present)
    else:
        cell_present.scatter_(0, page, ws.ones(page.numel(), torch.bool))
    present.logical_and_(in_use_cells)
    # 1 where the holder shares, else 0, as int64: on the CPU twice as fast as a bool result, and
    # the multiplication below then needs no conversion
    back = torch.index_select(owner, 0, slot, out=ws.get("audit.back", n, owner.dtype))
    sharing = torch.ne(back, keys, out=ws.get("audit.sharing", n, torch.int64))
    shared_slot = slot.mul_(sharing)  # the others to cell 0; a multiplication, as masked_fill_ and
    # where branch per element and run several times slower on the CPU with a random mask
    if small:  # the shared SWA slots marked in a bit per slot cell: row 2 of the table at page size 1
        marked = table[2] if page_size == 1 else ws.get("audit.shared", swa_slots + 1, torch.bool).zero_()
        marked.scatter_(0, shared_slot, ws.ones(shared_slot.numel(), torch.bool))
    # the counts over the pool's cells, a flat count per row (a count along a dimension widens its
    # input into a fresh int64 tensor on the CPU: one pass and a page-faulting buffer more)
    in_use, referenced = torch.count_nonzero(in_use_cells), torch.count_nonzero(present)
    leaked = in_use - referenced
    # the lowest page in use that no holder maps into: its index in the page cells 1 .. pages (the
    # reader adds the 1); referenced pages are in use, so "in use and not referenced" is "differ"
    leaked_at = _first_when(leaked, lambda: torch.ne(in_use_cells, present, out=ws.get("audit.leaked", pages, torch.bool)), zero)
    # the first offender of each: the stale holder's FULL slot; the lowest shared SWA slot and a
    # FULL slot mapped into it (the one its owner cell kept) from the slot table, or, for a large
    # pool, the first holder of a distinct shared slot
    if small:
        shared = torch.count_nonzero(marked[1:swa_slots])
        lowest = _first_when(shared, lambda: marked[1:swa_slots], zero)
        shared_swa = zero if lowest is zero else lowest + 1
        # in the holders' dtype: the stack into ``out`` below widens them
        shared_full = _at_when(owner[1:swa_slots], lowest, zero, widen=False)
        stale_full = _at_when(keys, stale_at, zero, widen=False)
    else:  # a large pool of large pages against few holders: distinct values among the holders
        first = _first_of_each_value(owner, shared_slot, ws.arange(shared_slot.numel(), owner.dtype))
        distinct = first.logical_and_(shared_slot > 0).logical_and_(shared_slot < swa_slots)
        shared = torch.count_nonzero(distinct)
        shared_at = _first_when(shared, lambda: distinct, zero)
        shared_swa = _at_when(shared_slot, shared_at, zero)
        if stale_at is zero and shared_at is zero:
            stale_full = shared_full = zero
        else:
            stale_full, shared_full = _at(keys, torch.stack([stale_at, shared_at]), widen=False)

    return write_cells(out, [in_use, referenced, leaked, stale, shared,
                             leaked_at, stale_at, stale_full, stale_swa, shared_swa, shared_full])


def write_cells(out: "torch.Tensor | list", values: "list[torch.Tensor]") -> "torch.Tensor | list":
    """The audit's cells (``values``: :data:`AUDIT_WIDTH` 0-dim integer tensors) stacked into
    ``out`` (``int64 [AUDIT_WIDTH]``), or, when ``out`` is a list, handed over in it (no device
    operation: the sample writes them with its own cells in its one ``cat``). Returns ``out``."""
    if isinstance(out, list):
        out[:] = values
    else:
        torch.stack(values, out=out)
    return out


def _within(values: torch.Tensor, low: int, high: int) -> bool:
    """Whether every element of the non-empty CPU tensor ``values`` lies in ``low .. high``: one
    ``aminmax``, its results read on the host (CPU tensors: no sync, no device operation)."""
    least, most = torch.aminmax(values)
    return int(least.numpy()) >= low and int(most.numpy()) <= high


def _first_when(count: torch.Tensor, mask: "Callable[[], torch.Tensor]", zero: torch.Tensor) -> torch.Tensor:
    """:func:`_first` of ``mask()``, an offender's index; on the CPU, where reading the 0-dim
    ``count`` is no synchronisation, ``zero`` itself (a 0-dim ``int64`` 0) without the pass over
    the mask when ``count`` is 0 (the offender cells are read only where their count is above 0).
    A reduction to a first index is one of the slowest passes on the CPU (about 3 ns per element
    here, against 0.3-0.7 for a subtraction or a count)."""
    if count.device.type == "cpu" and not int(count.numpy()):  # (a host read: no device operation)
        return zero
    return _first(mask())


def _at_when(values: torch.Tensor, index: torch.Tensor, zero: torch.Tensor, widen: bool = True) -> torch.Tensor:
    """:func:`_at`, or ``zero`` itself without the gather when ``index`` is ``zero`` (an offender of
    a fault :func:`_first_when` counted 0 on the CPU: its cell is never read)."""
    return zero if index is zero else _at(values, index, widen)


def _first(mask: torch.Tensor) -> torch.Tensor:
    """0-dim ``int64``: the index of the first True of the bool ``mask`` (0 when none or empty): one
    pass, ``max`` returning the first index of its maximum."""
    if mask.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=mask.device)
    return torch.max(mask, 0).indices


def _at(values: torch.Tensor, index: torch.Tensor, widen: bool = True) -> torch.Tensor:
    """``values[index]`` in ``int64`` (``widen=False``: in ``values``' dtype, for a caller whose
    ``stack`` into ``int64`` widens it): 0-dim for a 0-dim ``index``, else ``[len(index)]`` (zeros
    when ``values`` is empty)."""
    flat = index.reshape(-1)
    if values.numel() == 0:
        picked = torch.zeros(flat.shape, dtype=torch.int64, device=values.device)
    else:
        picked = values.index_select(0, flat)
        if widen:
            picked = picked.to(torch.int64)
    return picked.reshape(index.shape)

