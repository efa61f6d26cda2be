"""**An audit bounded by the holders** (:class:`SwaAuditSweep`, what the reporter runs). The audit
in one sample (:mod:`otel_swa.device.audit_counts`) reads the whole free list and the SWA pool's page cells at every sample: as SGLang sizes its
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
samples (1 when ``k + P + 2 <= B``: then the audit in one sample runs), and its
record, the one of the pass's last sample, carries the audit of the pool **as it was at the
pass's first sample** (the counts and offenders of the one-sample audit of that state, exactly;
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

The counts and first offenders are those of :func:`otel_swa.device.audit_counts.audit_holder_slots`
(the audit in one sample), in the same ``int64 [AUDIT_WIDTH]`` layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from otel_swa.device.audit_counts import _at, _first_when, audit_holder_slots, write_cells
from otel_swa.device.workspace import Workspace

__all__ = ["AUDIT_BUDGET", "AUDIT_BUDGET_CUDA", "SwaAuditSweep", "free_id_parts"]

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
        out: "torch.Tensor | list",
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
            out: the sample's audit cells; written only when a pass ends (a list: the cells handed
                over in it, :func:`~otel_swa.device.audit_counts.write_cells`).
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

    def _finish(self, out: "torch.Tensor | list", state: _Pass) -> None:
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
        write_cells(out, [in_use, in_use - leaked, leaked, stale, state.shared[0],
                          leak_at, stale_at, stale_full, stale_swa, state.shared[1],
                          state.shared[2]])
        self._pass = None
        self.passes += 1
        self.last_pass_samples = state.samples

