"""Provenance of a paged KV cache: stamps and checksums per slot of each KV cache group, whose slots
are ``block x block_size + offset`` and whose requests each keep a block table.

torch only. The stamps, the checksums and their verification are :mod:`otel_swa.device.provenance`'s
(:class:`~otel_swa.device.provenance.KvProvenance`, its module docstring gives what a comparison
tells and the bounds); what differs for a paged engine (vLLM's v1 KV cache, the structures in
:mod:`otel_swa.views.vllm_provenance`):

* **the slot spaces.** Each KV cache group is a pool of ``num_blocks x block_size`` slots: the FULL
  pool is the full-attention group, the SWA pool the sliding-window group. A group's tokens are
  found through its own block table (``int [rows, max_blocks]`` of block ids), not through a
  FULL-to-SWA mapping: position ``p`` of row ``r`` lies at slot ``table[r, p // block_size] x
  block_size + p % block_size`` (:class:`BlockSlots`). Block 0 is the null block (vLLM's
  ``BlockPool`` reserves it and puts it where a sliding-window table dropped a block): a position in
  it has no slot (SWA slot 0, not verified). The two groups of a hybrid model share one tensor per
  layer pair with disjoint block ids: a block of one group overwritten through the other changes
  the bytes the first group's folds were taken from (a corrupt token, naming the layer whose bytes
  changed), and its stamps when that group's table names it too (a foreign token).
* **the writes.** Each group's stamps are written at its first layer's store in a forward step
  (:meth:`PagedProvenance.stamp_group`: the group's own slot mapping, the step's token ids and
  positions, the chain read through the group's block table), the folds of those slots reset there;
  written twice on a step that admits a request (:attr:`PagedProvenance.passes`: a prefix-cache hit
  in the step on a block the step writes reads its previous position's stamp from that block);
  every layer of the group then folds the hash of the K/V it was given
  (:meth:`~otel_swa.device.provenance.KvProvenance.after_layer` with a paged
  :class:`~otel_swa.device.write_check.LayerStore`). Padding (slot ``-1``) is written at slot 0, in
  the null block, which never holds a live token.
* **the verification.** The bytes a slot holds are read through the layer's paged K and V views
  (``[num_blocks, block_size, heads, head_size]``, any strides: vLLM's CPU_ATTN keeps K transposed
  within each block and head, :func:`otel_swa.device.paged_write.cpu_attn_kv_views`), one gather per
  layer (:class:`PagedFolds`). The sample's view is the scheduler's (``provenance_view`` below).

What a sample's view gives (``view.kv_provenance``, e.g. :func:`otel_swa.views.vllm_provenance.
provenance_view`): ``seq_lens_cpu`` (per batch entry, the positions whose KV was written before the
step: ``0 .. seq_len - 1`` are verified), ``req_to_token`` (the FULL group's :class:`BlockSlots`),
``swa_req_to_token`` (the SWA group's), ``req_pool_indices`` (``int64 [B]``: each entry's row in
both tables), ``token_ids``, ``request_ids``, and the window fields of
:class:`~otel_swa.device.provenance.KvProvenance` (``sliding_window``, ``extend_lens_cpu``,
``swa_eviction_allowance``) for the SWA positions taken.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from otel_swa.device.checksum import RowHasher
from otel_swa.device.kv_folds import FOLD_MARK, PoolFolds
from otel_swa.device.provenance import KvProvenance
from otel_swa.device.provenance_reading import PROVENANCE_POOLS, ProvenanceMeta, ProvenanceReading
from otel_swa.device.stamps import write_stamps

__all__ = ["BlockSlots", "PagedRows", "PagedFolds", "PagedProvenance", "PagedMeta"]


class BlockSlots:
    """A block table read as a ``req_to_token`` table: ``slots[rows, positions]`` is the slot of
    each position (``table[row, position // block_size] x block_size + position % block_size``,
    ``int64``), ``shape`` is ``(rows, max_blocks x block_size)``.

    Args:
        table: ``int32``/``int64 [rows, max_blocks]``, block ids (0: the null block).
        block_size: tokens per block (the size the slots count in), int >= 1.
    """

    def dim(self) -> int:
        return 2

    def __init__(self, table: torch.Tensor, block_size: int) -> None:
        if table.dim() != 2 or type(block_size) is not int or block_size < 1:  # noqa: E721
            raise ValueError(f"table must be [rows, max_blocks] and block_size an int >= 1, got "
                             f"{tuple(table.shape)} and {block_size!r}")
        self.table = table
        self.block_size = block_size
        self.shape = (int(table.shape[0]), int(table.shape[1]) * block_size)

    def blocks(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The block id of each ``(row, position)`` (``int64 [n]``)."""
        columns = torch.div(positions.long(), self.block_size, rounding_mode="floor")
        return self.table[rows.long(), columns.clamp_(0, self.table.shape[1] - 1)].long()

    def __getitem__(self, key: "tuple[torch.Tensor, torch.Tensor]") -> torch.Tensor:
        rows, positions = key
        return self.blocks(rows, positions).mul_(self.block_size).add_(positions.long() % self.block_size)

    def live_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Like ``[rows, positions]``, with 0 where the block is the null block (no slot)."""
        blocks = self.blocks(rows, positions)
        slots = blocks * self.block_size + positions.long() % self.block_size
        return slots.masked_fill_(blocks.eq(0), 0)


class PagedRows:
    """A paged K or V view read as ``[slots, ...]`` rows, without a copy: what the read check
    (:meth:`otel_swa.device.read_check.ReadCheck.check_layer`) gathers from (``shape``, ``dim()``,
    ``dtype``, ``device``, ``index_select(0, slots)``).

    Args:
        view: ``[num_blocks, block_size, heads, head_size]`` (any strides: e.g.
            :func:`otel_swa.device.paged_write.cpu_attn_kv_views`); slot ``s`` is ``view[s //
            block_size, s % block_size]``.
    """

    def __init__(self, view: torch.Tensor) -> None:
        self.view = view
        self.block_size = int(view.shape[1])
        self.shape = torch.Size((int(view.shape[0]) * self.block_size,) + tuple(view.shape[2:]))
        self.dtype = view.dtype
        self.device = view.device

    def dim(self) -> int:
        return len(self.shape)

    def index_select(self, dim: int, slots: torch.Tensor) -> torch.Tensor:
        """The rows at ``slots`` (``int64 [n]``, inside the view): ``[n, heads, head_size]``, a copy."""
        if dim != 0:
            raise ValueError(f"paged rows are selected along dimension 0, got {dim}")
        slots = slots.long()
        return self.view[torch.div(slots, self.block_size, rounding_mode="floor"), slots % self.block_size]


class _PagedLayer(NamedTuple):
    layer_id: int
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    hasher: RowHasher


class PagedFolds(PoolFolds):
    """:class:`~otel_swa.device.kv_folds.PoolFolds` of a paged pool: a layer's buffers are its K and
    V views ``[num_blocks, block_size, ...]`` (any strides), slot ``s`` at ``[s // block_size, s %
    block_size]``; the hash is the one of the rows the layer was given (:meth:`RowHasher.of_given`),
    so the write side is :class:`PoolFolds`'s and :meth:`verify` gathers each layer's rows. Same
    arguments as :class:`PoolFolds`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # layer id -> ((K, V row elements), K and V stand-ins of one row each)
        self._rows: "dict[int, tuple[tuple[int, int], torch.Tensor, torch.Tensor]]" = {}

    def layer(self, layer_id: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> "Any":
        """The layer under ``layer_id`` (registered at its first call and when its views change:
        another storage, shape or strides), or ``None`` when it is not hashed. Host only."""
        known = self.layers.get(layer_id)
        if (known is not None and known.k_buffer.data_ptr() == k_buffer.data_ptr()
                and known.k_buffer.shape == k_buffer.shape and known.k_buffer.stride() == k_buffer.stride()
                and known.v_buffer.data_ptr() == v_buffer.data_ptr() and known.v_buffer.stride() == v_buffer.stride()):
            return known
        if k_buffer.dim() < 3 or v_buffer.dim() < 3 or k_buffer.shape[:2] != v_buffer.shape[:2]:
            return None
        # the base registers the hash layout on contiguous stand-ins of one row each
        elems = int(k_buffer[0, 0].numel()), int(v_buffer[0, 0].numel())
        stand_in = self._rows.get(layer_id)
        if stand_in is None or stand_in[0] != elems or stand_in[1].dtype != k_buffer.dtype:
            stand_in = self._rows[layer_id] = (elems, torch.zeros((1, elems[0]), dtype=k_buffer.dtype,
                                                                  device=k_buffer.device),
                                               torch.zeros((1, elems[1]), dtype=v_buffer.dtype, device=v_buffer.device))
        entry = super().layer(layer_id, stand_in[1], stand_in[2])
        if entry is None:
            return None
        entry = self.layers[layer_id] = _PagedLayer(layer_id, k_buffer, v_buffer, entry.hasher)
        return entry

    def verify(self, slots: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor] | None":
        """:meth:`PoolFolds.verify` over the paged views: per layer one gather of its K rows and one
        of its V rows at ``slots`` (``int64 [n]``), the hash, the weighted sums."""
        if not self.layers:
            return None
        stored = self.table.index_select(0, slots)
        now = torch.zeros_like(stored)
        n = int(slots.shape[0])
        for entry in self.layers.values():
            size = entry.k_buffer.shape[1]
            blocks = torch.div(slots, size, rounding_mode="floor").clamp_(0, entry.k_buffer.shape[0] - 1)
            offsets = slots % size
            h = entry.hasher.of_given(entry.k_buffer[blocks, offsets], entry.v_buffer[blocks, offsets], n)
            now[:, 0].add_(h)
            now[:, 1].add_(h, alpha=entry.layer_id + 1)
        delta = now.sub_(stored)
        delta[:, 0].add_(FOLD_MARK)
        return stored[:, 0].ne(0), delta


class PagedProvenance(KvProvenance):
    """Stamps and checksums of a paged KV cache of two groups (module docstring).

    Args:
        device, gate: as :class:`~otel_swa.device.provenance.KvProvenance`.
        full_slots: slots of the full-attention group (``num_blocks x block_size``).
        swa_slots: slots of the sliding-window group, or ``None`` without one.
        options: :class:`~otel_swa.device.provenance.KvProvenance`'s other keyword arguments
            (``checksum``, ``checksum_order``, ``budget``, ``write_check``...).
    """

    def __init__(self, device: "torch.device | str", gate: Any, *, full_slots: int, swa_slots: "int | None" = None,
                 **options: Any) -> None:
        super().__init__(device, gate, full_slots=full_slots, swa_slots=swa_slots, **options)
        #: how many times :meth:`stamp_group` writes the stamps (2: a step that may hit the prefix
        #: cache on blocks it writes itself; 1 is enough where no request of the step was admitted
        #: in it, as the engine may say before the forward)
        self.passes = 2
        self.folds = tuple(None if f is None else _paged_folds(f) for f in self.folds)
        # each layer's store folds into its own paged pool (PoolFolds.add): no shared step buffer
        # (KvProvenance's StepFolds was made for the flat folds just replaced)
        self._step_folds = None

    def stamp_group(self, *, swa: bool, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_table: torch.Tensor, block_size: int, query_start_loc: torch.Tensor) -> None:
        """Stamp the slots one KV cache group writes in this forward step, and reset their folds
        (call at the group's first layer, before its store is folded). Fixed shapes, no host read.

        Args:
            swa: the group is the sliding-window one (else the full-attention one).
            input_ids, positions: ``int [>= T]``, the step's token ids and positions (the runner's
                buffers; the first ``T`` are used).
            slot_mapping: ``int [T]``, the group's slot of each token (``-1``: padding).
            block_table: ``int [>= B, max_blocks]``, the group's block table, row ``i`` = batch
                entry ``i``.
            block_size: tokens per block of the slot mapping.
            query_start_loc: ``int [B + 1]``, each entry's first token (the attention metadata's).
        """
        pool = 1 if swa else 0
        stamps = self.stamps[pool]
        if stamps is None:
            return
        tokens = int(slot_mapping.shape[0])
        batch = int(query_start_loc.shape[0]) - 1
        if tokens == 0 or batch < 1:
            return
        slots = slot_mapping.long().clamp(0, stamps.shape[0] - 1)  # padding (-1) to slot 0, the null block's
        rows = torch.arange(batch, device=slots.device)
        table = BlockSlots(block_table[:batch], block_size)
        # twice (``passes``): a request admitted with a prefix-cache hit on a block another request of
        # the step writes (vLLM caches a block's hash when it allocates it) reads its previous
        # position's stamp from that block, which the first pass wrote; the second reads it (the
        # others' stamps come out the same)
        for _ in range(self.passes):
            write_stamps(stamps, input_ids[:tokens], positions[:tokens], slots, rows, table, query_start_loc[:-1])
        folds = self.folds[pool]
        if folds is not None:
            folds.reset(slots)
        self._written = None

    def _swa_slots(self, view: Any, mapping: Any, rows: torch.Tensor, positions: torch.Tensor,
                   full: torch.Tensor) -> torch.Tensor:
        return view.swa_req_to_token.live_slots(rows, positions)

    def stage(self, out: torch.Tensor, view: Any, upload: "Callable[[np.ndarray], torch.Tensor] | None" = None
              ) -> "ProvenanceMeta | None":
        """:meth:`KvProvenance.stage` over the view's ``kv_provenance`` (module docstring); ``None``
        (nothing staged) without one. The reading's offenders also name their ``block`` (the slot's,
        in the offender's pool) and ``kv_cache_group`` (the view's ``kv_cache_groups``: the group
        index of each pool, when given)."""
        inner = getattr(view, "kv_provenance", None)
        if inner is None:
            return None
        meta = super().stage(out, inner, upload)
        if meta is None:
            return None
        sizes = (inner.req_to_token.block_size, inner.swa_req_to_token.block_size)
        return PagedMeta(meta.taken, meta.over_budget, meta.checksums, meta.layer_ids, meta.host_slot_of,
                         block_sizes=sizes, groups=tuple(getattr(inner, "kv_cache_groups", None) or (None, None)))


@dataclass(frozen=True)
class PagedMeta(ProvenanceMeta):
    """:class:`~otel_swa.device.provenance_reading.ProvenanceMeta` of a paged pool: the offenders of
    its reading also name the ``block`` of their slot and their ``kv_cache_group``.

    Attributes:
        block_sizes: tokens per block of the FULL and of the SWA pool.
        groups: the KV cache group index of each pool (``None``: not known).
    """

    block_sizes: "tuple[int, int]" = (1, 1)
    groups: "tuple[int | None, int | None]" = (None, None)

    def read(self, values: Any) -> ProvenanceReading:
        reading = super().read(values)
        return replace(reading, foreign_offender=self._where(reading.foreign_offender),
                       corrupt_offender=self._where(reading.corrupt_offender))

    def _where(self, where: "dict | None") -> "dict | None":
        if where is None:
            return None
        pool = PROVENANCE_POOLS.index(where["pool"])
        slot = where["swa_slot"] if pool == 1 else where["full_slot"]
        return {**where, "block": None if slot is None else slot // self.block_sizes[pool],
                "kv_cache_group": self.groups[pool]}


def _paged_folds(folds: PoolFolds) -> PagedFolds:
    """A :class:`PagedFolds` of the same size, device, hashed part and order as ``folds``."""
    return PagedFolds(int(folds.table.shape[0]), folds.table.device, folds.prefix_bytes, folds.order)
