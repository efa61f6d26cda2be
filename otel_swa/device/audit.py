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

**An audit bounded by the holders** (:class:`SwaAuditSweep`, what the reporter runs). The audit
above reads the whole free list and the SWA pool's page cells at every sample: as SGLang sizes its
pools (the SWA pool ``swa_full_tokens_ratio`` 0.8 of the FULL pool, mostly free) that is millions
of ids per sample, whatever the batch. The sweep does the same audit, with the same counts and
first offenders, as a *pass* over several samples, each sample reading the holders only at the
first and last sample of a pass and otherwise a fixed budget of ``B`` elements
(:data:`AUDIT_BUDGET`, 32,768 on the CPU; :data:`AUDIT_BUDGET_CUDA` on a GPU):

1. first sample (``s``): the holders' FULL and SWA slots (``n``, gathered then), their pages
   stamped in a table of page cells (``held[page] = p``, ``p`` the pass's number, a byte: after
   254 passes both stamp tables are cleared and the numbers start over), the shared SWA slots found
   among them (distinct values by each holder writing its index into its slot's cell and reading it
   back: :math:`O(n)`, no table cleared; on the CPU, where a count is read without a sync, only
   when some holder reads another FULL slot back), their pages, FULL and SWA slots kept; the free list taken as it is at ``s`` (a reference to the view's
   tensors, never copied: engines replace their free lists, they do not write into them);
2. the next samples: ``B`` ids of that free list a sample, stamped (``free[id] = p``), then ``B``
   page cells a sample: in use (``free != p``), referenced (in use and ``held == p``), the lowest
   page in use and not referenced;
3. the last sample: the stale holders (their page's ``free == p``) and the record.

So a pass of a free list of ``k`` ids over ``P`` pages takes ``N = ceil(k / B) + ceil(P / B)``
samples (1 when ``k + P + 2 <= B``: then the audit above runs, in one sample), and its
record, the one of the pass's last sample, carries the audit of the pool **as it was at the
pass's first sample** (the counts and offenders of this module's audit of that state, exactly;
the samples in between carry no audit). Per sample the work is ``O(n)`` at the first and last
sample of a pass and ``O(B)`` at every sample, independent of ``P`` and ``k``.

The bound (samples counted among those whose view gives audit inputs). Passes follow each other:
the next one starts at the sample after a pass's record. Let a fault (a leaked, stale or shared SWA
page) be in the pool at samples ``t .. t + N_1 - 1``, ``N_1`` the length of the pass in progress at
``t`` (started at ``s <= t``). Either that pass started at ``t`` and audits it, or it ends at ``s +
N_1 - 1 <= t + N_1 - 2`` and the next pass starts at a sample in ``t + 1 .. t + N_1 - 1``, while the
fault is still there. The pass that audits it ends ``N_2 - 1`` samples after its start. So **a
fault that lasts ``N_1`` samples is reported at sample ``t + N_1 + N_2 - 2`` at the latest, within
``2 N - 2`` samples**, ``N`` the longest pass: ``ceil(k / B) + ceil(P / B) <= 2 ceil(P / B)`` for
a free list without duplicates (``k <= P``). A leaked page stays leaked (nothing frees it), so every
leak is reported. Nothing is reported that was not in the pool at a pass's first sample: the counts
are those of that state, from the slots and the free list as they were then; a table cell holds
this pass's number only where this pass wrote it (no other pass since the tables were last cleared
has that number, every cell ever used is cleared with them, and the tables are the sweep's own).
Shown by ``tests/core/test_audit_sweep.py``: every pass against a plain recount
of the pool at its first sample, and faults made at each sample of a pass reported within the bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from otel_swa.device.workspace import Workspace

__all__ = ["AUDIT_WIDTH", "AUDIT_COUNTS", "AUDIT_OFFENDER_CELLS", "AUDIT_BUDGET", "AUDIT_BUDGET_CUDA", "SwaSlotAudit", "SwaAuditSweep",
           "audit_counts", "audit_holder_slots", "audit_swa_slots", "free_id_parts", "holder_slots"]

#: Values written by :func:`audit_counts` (all int64): pages in use, pages in use that live tokens
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
        low, high = (int(v) for v in torch.aminmax(full))
        if low >= 0 and high < size:
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
    out: torch.Tensor,
    keys: torch.Tensor,
    slot: torch.Tensor,
    swa_free_page_ids: torch.Tensor,
    num_swa_pages: int,
    page_size: int,
    ws: Workspace,
) -> torch.Tensor:
    """The audit counts from the holders' keys and SWA slots (:func:`holder_slots`, or the
    sample's own gathers of the batch's live tokens) into ``out``; see :func:`audit_counts`.

    ``keys`` (``int [n]``, FULL slots) and ``slot`` (``int64 [n]``, SWA slots in ``0 ..
    swa_slots``, 0 for a holder that holds nothing) are valid table indices; ``slot`` is
    overwritten. No host sync.
    """
    pages = num_swa_pages
    spare_page = pages + 1  # the cell of SWA ids beyond the pool (page 0 takes "none" and bad ids)
    swa_slots = (pages + 1) * page_size

    # Free pages: a bool per page cell, written at the free ids clamped into the cells (ids below 1
    # go to cell 0, ids beyond the pool to the spare cell, both cleared again: neither is ever free).
    free = swa_free_page_ids.reshape(-1)
    if free.dtype != torch.int64:  # index_fill_ takes int64 indices only
        free = free.long()
    free_keys = torch.clamp(free, 0, spare_page, out=ws.get("audit.free_keys", free.numel(), torch.int64))
    is_free = ws.get("audit.free", pages + 2, torch.bool).zero_()
    is_free.index_fill_(0, free_keys, True)
    is_free[0] = False
    is_free[spare_page] = False

    n = slot.numel()
    page = slot if page_size == 1 else torch.div(slot, page_size, rounding_mode="floor", out=ws.get("audit.page", n, torch.int64))

    # Stale: holders whose page is on the free list (cells 0 and spare never are).
    on_free = torch.index_select(is_free, 0, page, out=ws.get("audit.on_free", n, torch.bool))
    stale = torch.count_nonzero(on_free)
    zero = ws.zeros(1)[0]  # (a view: no device operation) the offender cells of a fault counted 0 on the CPU
    stale_at = _first_when(stale, lambda: on_free, zero)
    stale_swa = _at(slot, stale_at)  # read before the shared-slot pass below overwrites slot

    in_use_cells = is_free.logical_not_()[1:spare_page]  # the free table becomes "in use"
    in_use = torch.count_nonzero(in_use_cells)

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

    # Pages in use that a holder maps into.
    if small:
        written = torch.ge(owner[page_size:swa_slots], 0, out=ws.get("audit.written", swa_slots - page_size, torch.bool))
        present = written if page_size == 1 else written.view(pages, page_size).any(1)
    else:
        cells = ws.get("audit.present", pages + 2, torch.bool).zero_()
        cells.scatter_(0, page, ws.ones(page.numel(), torch.bool))
        present = cells[1:spare_page]
    referenced = torch.count_nonzero(present.logical_and_(in_use_cells))
    leaked = in_use - referenced
    # the lowest page in use that no holder maps into: its index in the page cells 1 .. pages (the
    # reader adds the 1); referenced pages are in use, so "in use and not referenced" is "differ"
    leaked_at = _first_when(leaked, lambda: torch.ne(in_use_cells, present, out=ws.get("audit.leaked", pages, torch.bool)), zero)
    # 1 where the holder shares, else 0, as int64: on the CPU twice as fast as a bool result, and
    # the multiplication below then needs no conversion
    back = torch.index_select(owner, 0, slot, out=ws.get("audit.back", n, owner.dtype))
    sharing = torch.ne(back, keys, out=ws.get("audit.sharing", n, torch.int64))
    shared_slot = slot.mul_(sharing)  # the others to cell 0; a multiplication, as masked_fill_ and
    # where branch per element and run several times slower on the CPU with a random mask
    # the first offender of each: the stale holder's FULL slot; the lowest shared SWA slot and a
    # FULL slot mapped into it (the one its owner cell kept) from the slot table, or, for a large
    # pool, the first holder of a distinct shared slot
    if small:
        marked = ws.get("audit.shared", swa_slots + 1, torch.bool).zero_()
        marked.scatter_(0, shared_slot, ws.ones(shared_slot.numel(), torch.bool))
        shared = torch.count_nonzero(marked[1:swa_slots])
        lowest = _first_when(shared, lambda: marked[1:swa_slots], zero)
        shared_swa = zero if lowest is zero else lowest + 1
        shared_full = _at(owner[1:swa_slots], lowest)
        stale_full = _at(keys, stale_at)
    else:  # a large pool of large pages against few holders: distinct values among the holders
        first = _first_of_each_value(owner, shared_slot, ws.arange(shared_slot.numel(), owner.dtype))
        distinct = first.logical_and_(shared_slot > 0).logical_and_(shared_slot < swa_slots)
        shared = torch.count_nonzero(distinct)
        shared_at = _first_when(shared, lambda: distinct, zero)
        shared_swa = _at(shared_slot, shared_at)
        stale_full, shared_full = _at(keys, torch.stack([stale_at, shared_at]))

    torch.stack([in_use, referenced, leaked, stale, shared,
                 leaked_at, stale_at, stale_full, stale_swa, shared_swa, shared_full], out=out)
    return out


def _first_when(count: torch.Tensor, mask: "Callable[[], torch.Tensor]", zero: torch.Tensor) -> torch.Tensor:
    """:func:`_first` of ``mask()``, an offender's index; on the CPU, where reading the 0-dim
    ``count`` is no synchronisation, ``zero`` itself (a 0-dim ``int64`` 0) without the pass over
    the mask when ``count`` is 0 (the offender cells are read only where their count is above 0).
    A reduction to a first index is one of the slowest passes on the CPU (about 3 ns per element
    here, against 0.3-0.7 for a subtraction or a count)."""
    if count.device.type == "cpu" and not int(count.numpy()):  # (a host read: no device operation)
        return zero
    return _first(mask())


def _first(mask: torch.Tensor) -> torch.Tensor:
    """0-dim ``int64``: the index of the first True of the bool ``mask`` (0 when none or empty): one
    pass, ``max`` returning the first index of its maximum."""
    if mask.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=mask.device)
    return torch.max(mask, 0).indices


def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` in ``int64``: 0-dim for a 0-dim ``index``, else ``[len(index)]`` (zeros when
    ``values`` is empty)."""
    flat = index.reshape(-1)
    if values.numel() == 0:
        picked = torch.zeros(flat.shape, dtype=torch.int64, device=values.device)
    else:
        picked = values.index_select(0, flat).to(torch.int64)
    return picked.reshape(index.shape)


#: Elements the sweep (:class:`SwaAuditSweep`) reads per sample beyond the holders on the CPU:
#: free-list ids or SWA page cells. A pool whose free list and page cells fit in it is audited in
#: one sample. Chosen from ``benchmarks/bench_sample.py`` table 1 (2 CPU cores): a budget's chunk
#: costs a tenth of a 56K-token sample, and the pass's first and last samples (the holders' part)
#: are spread over the pass.
AUDIT_BUDGET = 32768
#: The budget on CUDA devices, where a pass over millions of ids is a few kernels of microseconds.
AUDIT_BUDGET_CUDA = 1 << 20

#: The stamp tables hold one byte per SWA page: 254 passes, then they are cleared and start over.
#: A byte, not an ``int32``: the holders' scatter into them and the gather from them at a pass's
#: first and last samples touch a quarter of the cache lines (on the CPU those passes over tables
#: larger than the caches cost their cache misses).
_STAMP_DTYPE = torch.uint8
_STAMP_LIMIT = 255


def free_id_parts(swa_free_page_ids: Any, device: "torch.device | None" = None) -> "tuple[torch.Tensor, ...]":
    """The free list as a tuple of 1-D index tensors: ``swa_free_page_ids`` is a tensor, a sequence
    of tensors (an allocator's free lists as they are: SGLang keeps ``free_pages`` and
    ``release_pages``), or a zero-argument callable returning either.

    Raises:
        TypeError: not a tensor of ``int32``/``int64`` (nor a sequence of them).
        ValueError: a tensor that is not 1-D, or on another ``device`` than the one given.
    """
    value = swa_free_page_ids() if callable(swa_free_page_ids) else swa_free_page_ids
    parts = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    for part in parts:
        if not isinstance(part, torch.Tensor) or part.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"swa_free_page_ids must be int32/int64 tensors, got {type(part).__name__}"
                            f"{'' if not isinstance(part, torch.Tensor) else ' of ' + str(part.dtype)}")
        if part.dim() != 1 or (device is not None and part.device != device):
            raise ValueError(f"swa_free_page_ids must be 1-D tensors on {device}, got shape {tuple(part.shape)} "
                             f"on {part.device}")
    return tuple(part for part in parts if part.numel())


class _Pass:
    """A pass of the sweep in progress: what it took at its first sample and how far it has got."""

    __slots__ = ("stamp", "parts", "part", "offset", "pages", "page_size", "next_page", "counts", "leak_at",
                 "shared", "n", "keys_dtype", "slot_dtype", "samples", "host_counts")

    def __init__(self, stamp, parts, pages, page_size, shared, n, keys_dtype):
        self.stamp = stamp
        self.parts = parts  # the free list as it was at the first sample (references, never copied)
        self.part = self.offset = 0  # where the stamping of the free list has got to
        self.pages = pages
        self.page_size = page_size
        self.next_page = 1  # the first page cell not swept yet (cells 1 .. pages)
        self.counts = None  # int64 [2]: page cells swept that are in use, and leaked (so far)
        self.host_counts = None  # the same as host ints, on the CPU (where ``counts`` stays None)
        self.leak_at = None  # 0-dim int64: the lowest leaked page so far, less 1 (_NO_LEAK: none)
        self.shared = shared  # int64 [3]: shared SWA slots, one of them, a FULL slot mapped into it
        self.n = n  # holders
        self.keys_dtype = keys_dtype  # of the kept FULL slots
        self.slot_dtype = torch.int64  # of the kept SWA slots and pages
        self.samples = 0


_NO_LEAK = 2**62


class SwaAuditSweep:
    """The SWA slot audit bounded by the holders: :func:`audit_holder_slots`' counts and first
    offenders, as a pass over several samples (module docstring: the passes and the bound).

    Args:
        device: the device of the engine's tensors.
        budget: free-list ids or SWA page cells read per sample beyond the holders (int >= 1;
            default :data:`AUDIT_BUDGET`, :data:`AUDIT_BUDGET_CUDA` on a CUDA device); a pool whose
            free list and page cells add up to at most ``budget - 2`` is audited in one sample
            (:func:`audit_holder_slots`).

    Attributes (host, after each :meth:`stage`):
        started: whether that sample began a pass (its holders are the ones the pass audits).
        passes: passes completed.
        last_pass_samples: samples of the last completed pass.

    Its tables (two one-byte stamp cells per SWA page, one holder-dtype cell per SWA slot) are its own:
    one sweep per reporter. No host sync.

    Raises:
        ValueError: ``budget`` is not an int >= 1.
    """

    def __init__(self, device: "torch.device | str", budget: "int | None" = None) -> None:
        self.device = torch.device(device)
        if budget is None:
            budget = AUDIT_BUDGET_CUDA if self.device.type == "cuda" else AUDIT_BUDGET
        if type(budget) is not int or budget < 1:  # noqa: E721
            raise ValueError(f"the audit budget must be an int >= 1 (elements per sample), got {budget!r}")
        self.budget = budget
        self._ws = Workspace(self.device)
        self._stamp = 0
        self._cells = 0  # the most cells of a stamp table used so far (all of them are cleared at a wrap)
        self._pass: "_Pass | None" = None
        self.started = False
        self.passes = 0
        self.last_pass_samples = 0

    @property
    def in_progress(self) -> bool:
        """Whether a pass has started and not yet given its record."""
        return self._pass is not None

    def reset(self) -> None:
        """Forget the pass in progress (its samples give no record)."""
        self._pass = None

    def stage(
        self,
        out: torch.Tensor,
        holders: "Callable[[], tuple[torch.Tensor, torch.Tensor] | None]",
        swa_free_page_ids: Any,
        num_swa_pages: int,
        page_size: int,
        workspace: Workspace,
    ) -> bool:
        """One sample of the audit; ``True`` when a pass ended here: ``out`` (``int64
        [AUDIT_WIDTH]``) then holds its counts and first offenders (:func:`audit_counts`' layout),
        those of the pool at the pass's first sample.

        Args:
            out: the sample's audit cells; written only when a pass ends.
            holders: called at a pass's first sample only: the holders' ``(keys, slot)`` as
                :func:`holder_slots` gives them (``keys`` the FULL slots in the mapping's range,
                ``slot`` ``int64`` SWA slots in ``0 .. swa_slots``, overwritten), or ``None`` when
                they cannot all be had now (no pass starts).
            swa_free_page_ids: the free list (see :func:`free_id_parts`), read at a pass's first
                sample; its tensors are read over the pass's samples and must not be written into
                meanwhile (engines replace their free lists: SGLang's are new tensors at every
                change).
            num_swa_pages, page_size: of the SWA pool (ints >= 1), read at a pass's first sample.
            workspace: the caller's scratch buffers (the one-sample audit writes there).

        Raises:
            ValueError: ``num_swa_pages`` or ``page_size`` below 1.
            TypeError, ValueError: a free list that :func:`free_id_parts` refuses.
        """
        self.started = False
        state = self._pass
        if state is None:
            if num_swa_pages < 1 or page_size < 1:
                raise ValueError(f"num_swa_pages and page_size must be >= 1, got {num_swa_pages} and {page_size}")
            parts = free_id_parts(swa_free_page_ids, self.device)
            k = sum(int(part.numel()) for part in parts)
            if k + num_swa_pages + 2 <= self.budget:  # the whole audit in this sample
                held = holders()
                if held is None:
                    return False
                free = (parts[0] if len(parts) == 1 else torch.cat([p.long() for p in parts])) if parts else \
                    torch.zeros(0, dtype=torch.int64, device=self.device)
                audit_holder_slots(out, held[0], held[1], free, num_swa_pages, page_size, workspace)
                self.started = True
                self.passes += 1
                self.last_pass_samples = 1
                return True
            state = self._start(holders, parts, num_swa_pages, page_size)
            if state is None:
                return False
            self.started = True
        state.samples += 1
        if state.part < len(state.parts):
            self._stamp_free(state)
            return False
        self._sweep_pages(state)
        if state.next_page <= state.pages:
            return False
        self._finish(out, state)
        return True

    # -- the steps of a pass ------------------------------------------------------------------------
    def _table(self, name: str, cells: int) -> torch.Tensor:
        self._cells = max(self._cells, cells)
        return self._ws.kept(name, cells, _STAMP_DTYPE, fill=0)

    def _start(self, holders, parts, pages: int, page_size: int) -> "_Pass | None":
        held = holders()
        if held is None:
            return None
        keys, slot = held
        if self._stamp + 1 >= _STAMP_LIMIT:  # once every 254 passes: the tables start over
            for name in ("sweep.free", "sweep.held"):
                self._table(name, max(self._cells, pages + 2)).zero_()
            self._stamp = 0
        self._stamp += 1
        stamp = self._stamp
        ws = self._ws
        n = slot.numel()
        swa_slots = (pages + 1) * page_size
        # the holders as they are now, for the pass's last sample (the stale holders and the first
        # one); their SWA slots and pages in int32 when every slot id is one (half the bytes copied,
        # and gathered by at the last sample)
        narrow = torch.int32 if swa_slots < 2**31 else torch.int64
        kept_keys = ws.kept("sweep.keys", n, keys.dtype)
        kept_keys.copy_(keys)
        ws.kept("sweep.slot", n, narrow).copy_(slot)
        if page_size == 1:
            page = slot
        else:
            page = torch.div(slot, page_size, rounding_mode="floor", out=ws.get("sweep.page_index", n, torch.int64))
            ws.kept("sweep.page", n, narrow).copy_(page)
        # the pages holders map into (cells 0 and pages + 1, "none" and beyond the pool, are never swept)
        self._table("sweep.held", pages + 2).scatter_(0, page, self._stamps(stamp, n))
        self._table("sweep.free", pages + 2)  # made (zeros) before the first stamp
        state = _Pass(stamp, parts, pages, page_size, self._shared(keys, slot, swa_slots), n, keys.dtype)
        state.slot_dtype = narrow
        if self.device.type == "cpu":
            state.host_counts = [0, 0]
        else:
            state.counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        state.leak_at = torch.full((), _NO_LEAK, dtype=torch.int64, device=self.device)
        self._pass = state
        return state

    def _stamps(self, stamp: int, n: int) -> torch.Tensor:
        """``uint8 [n]`` of ``stamp`` (a kept buffer, filled again when the stamp changes): the
        source of the stamping scatters (``scatter_`` with a source: on the CPU twice as fast as
        ``index_fill_`` with a scalar)."""
        size = max(n, self.budget)
        buffer = self._ws.kept("sweep.stamps", size, _STAMP_DTYPE)
        if getattr(self, "_stamps_of", None) != (stamp, buffer.data_ptr(), size):
            buffer.fill_(stamp)
            self._stamps_of = (stamp, buffer.data_ptr(), size)
        return buffer[:n]

    def _shared(self, keys: torch.Tensor, slot: torch.Tensor, swa_slots: int) -> torch.Tensor:
        """``int64 [3]``: the SWA slots that two distinct holders' FULL slots map to, one of them and
        a FULL slot mapped into it. Each holder writes its FULL slot into its SWA slot's cell and
        reads it back; those that read another FULL slot share their slot; the distinct slots
        among them are counted by each writing its index into its slot's cell (the one that reads
        its own index back counts: one per slot), less the cells of "none" (0) and beyond the pool
        (``swa_slots``). Only cells written here are read: no table is cleared. ``slot`` is kept."""
        ws, n = self._ws, slot.numel()
        if n == 0:
            return torch.zeros(3, dtype=torch.int64, device=self.device)
        owner = ws.kept("sweep.owner", swa_slots + 1, keys.dtype)
        owner.scatter_(0, slot, keys)
        back = torch.index_select(owner, 0, slot, out=ws.get("sweep.back", n, owner.dtype))
        sharing = torch.ne(back, keys, out=ws.get("sweep.sharing", n, torch.int64))
        shared_slot = sharing.mul_(slot)  # the others to cell 0 (a multiplication: no branch per element)
        if self.device.type == "cpu" and not int(shared_slot.max()):
            # (a host read: no sync on the CPU) no holder shares an SWA slot of the pool (those mapped
            # to 0, "none", share cell 0, never counted): shared 0, without the passes below (the
            # offender cells are read only where their count is above 0)
            return ws.zeros(3)
        order = ws.arange(n, owner.dtype)
        owner.scatter_(0, shared_slot, order)
        winner = torch.index_select(owner, 0, shared_slot, out=back).sub_(order)  # 0: one holder per value
        # the values 0 and swa_slots are among them when the holder their cell names has that value
        ends = torch.stack([owner[0], owner[swa_slots]]).clamp_(0, n - 1)
        ends_value = torch.index_select(shared_slot, 0, ends)
        present = torch.count_nonzero(ends_value[0] == 0) + torch.count_nonzero(ends_value[1] == swa_slots)
        shared = n - torch.count_nonzero(winner) - present
        zero = ws.zeros(1)[0]
        shared_at = _first_when(shared, lambda: (winner == 0).logical_and_(shared_slot > 0).logical_and_(shared_slot < swa_slots),
                                zero)
        return torch.stack([shared, _at(shared_slot, shared_at), _at(keys, shared_at)])

    def _stamp_free(self, state: _Pass) -> None:
        """Stamp up to ``budget`` ids of the pass's free list (``free[id] = stamp``; ids below 1 to
        cell 0 and above the pool to the spare cell, never swept and cleared by :meth:`_finish`
        before it reads them: never free)."""
        chunk, room = [], self.budget
        while room and state.part < len(state.parts):
            part = state.parts[state.part]
            piece = part[state.offset:state.offset + room]
            chunk.append(piece)
            room -= piece.numel()
            state.offset += piece.numel()
            if state.offset >= part.numel():
                state.part, state.offset = state.part + 1, 0
        ids = chunk[0] if len(chunk) == 1 else torch.cat([c.long() for c in chunk])
        spare = state.pages + 1
        keys = self._ws.get("sweep.ids", ids.numel(), torch.int64)  # scatter_ takes int64 indices only
        if ids.dtype == torch.int64:
            torch.clamp(ids, 0, spare, out=keys)
        else:
            keys.copy_(ids).clamp_(0, spare)
        table = self._table("sweep.free", spare + 1)
        table.scatter_(0, keys, self._stamps(state.stamp, keys.numel()))

    def _sweep_pages(self, state: _Pass) -> None:
        """Count up to ``budget`` page cells: the free ones, the ones free or referenced (every page
        but the leaked), and the lowest leaked one so far. Every cell holds this pass's stamp or an
        older one, so ``cell - stamp`` is 0 exactly where this pass wrote it, and ``max(free, held)
        - stamp`` where either did (arithmetic and counts: on the CPU several times faster than
        comparisons into booleans)."""
        start = state.next_page
        stop = min(state.pages + 1, start + self.budget)
        stamp, ws, m = state.stamp, self._ws, stop - start
        free = self._table("sweep.free", state.pages + 2)[start:stop]
        held = self._table("sweep.held", state.pages + 2)[start:stop]
        accounted = torch.maximum(free, held, out=ws.get("sweep.accounted", m, _STAMP_DTYPE)).sub_(stamp)
        in_use = torch.count_nonzero(torch.sub(free, stamp, out=ws.get("sweep.in_use", m, _STAMP_DTYPE)))
        leaked = torch.count_nonzero(accounted)
        if state.host_counts is not None:  # (on the CPU: read without a sync, added on the host)
            state.host_counts[0] += int(in_use.numpy())
            state.host_counts[1] += int(leaked.numpy())
        else:
            state.counts += torch.stack([in_use, leaked])
        # the first leaked cell of this range (its page less 1), or _NO_LEAK when there is none
        if self.device.type != "cpu" or (int(leaked.numpy()) and int(state.leak_at.numpy()) == _NO_LEAK):
            first = torch.max(accounted != 0, 0)
            at = torch.where(first.values, first.indices + (start - 1), _NO_LEAK)
            torch.minimum(state.leak_at, at, out=state.leak_at)
        state.next_page = stop

    def _finish(self, out: torch.Tensor, state: _Pass) -> None:
        """The pass's last sample: the stale holders, then the counts and first offenders into ``out``."""
        ws, n = self._ws, state.n
        keys = ws.kept("sweep.keys", n, state.keys_dtype)
        slot = ws.kept("sweep.slot", n, state.slot_dtype)
        page = slot if state.page_size == 1 else ws.kept("sweep.page", n, state.slot_dtype)
        table = self._table("sweep.free", state.pages + 2)
        table[0] = 0  # ("none" and beyond the pool: never free, whatever ids the free list held)
        table[state.pages + 1] = 0
        on_free = torch.index_select(table, 0, page, out=ws.get("sweep.on_free", n, _STAMP_DTYPE)).sub_(state.stamp)
        stale = n - torch.count_nonzero(on_free)  # 0 where the holder's page is on the free list
        zero = ws.zeros(1)[0]
        stale_at = _first_when(stale, lambda: on_free == 0, zero)
        # (on the CPU with no stale holder, the offender cells are not read: no gather for them)
        stale_full, stale_swa = (zero, zero) if stale_at is zero else (_at(keys, stale_at), _at(slot, stale_at))
        counts = state.counts if state.host_counts is None else torch.tensor(state.host_counts, device=self.device)
        in_use, leaked = counts[0], counts[1]
        leak_at = torch.where(state.leak_at == _NO_LEAK, 0, state.leak_at)
        torch.stack([in_use, in_use - leaked, leaked, stale, state.shared[0],
                     leak_at, stale_at, stale_full, stale_swa, state.shared[1],
                     state.shared[2]],
                    out=out)
        self._pass = None
        self.passes += 1
        self.last_pass_samples = state.samples


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
