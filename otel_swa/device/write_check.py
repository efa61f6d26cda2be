"""The write check: does the KV pool hold, at the slot the tables name, what the layer was given to store?

torch only; fixed shapes, no host read: it runs in an eager forward step or inside a captured CUDA
graph (:mod:`otel_swa.device.gate`).

The read check (:mod:`otel_swa.device.read_check`) recomputes attention through the same mapping
from the same pool, so a KV written to the wrong slot is read back "correctly" from there and no
read disagrees. The write check looks at the write itself: after a layer's forward (which writes the
step's K and V into the pool, then attends), for up to ``max_tokens`` of the step's new tokens (8 by
default, taken in turn across sampled steps), the K and V the layer was given, cast to the cache's
dtype as the store casts them, must equal bit for bit the pool's rows at the slot the engine's own
tables name:

* a layer whose buffers are the FULL pool's: the FULL slot, ``out_cache_loc``;
* a layer whose buffers are the SWA pool's (SGLang's sliding-window layers of a hybrid model): the
  SWA slot ``full_to_swa_index_mapping[out_cache_loc]``;
* a paged store (:attr:`LayerStore.block_size` set: vLLM's, :mod:`otel_swa.device.paged_write`):
  the slot the engine's own slot mapping gives the layer's KV cache group (no further mapping, for
  either kind), read at block ``slot // block_size``, offset ``slot % block_size`` of buffers
  ``[num_blocks, block_size, ...]`` of any strides (a gather of the compared rows, no copy of the
  cache).

A difference is a write at the wrong index (sgl-project/sglang#20181's class: write indices taken
from the wrong pool; a sliding-window layer writing at the raw FULL slot), a write into another
token's slot after this one, or a store that lost the values. Exact equality holds for every store
that casts with round-to-nearest-even (all of torch's and SGLang's stores); a cache of another dtype
than :data:`~otel_swa.device.checksum.HASHED_DTYPES` (fp8 caches store scaled values) is counted
unchecked. Tokens written to slot 0 (padding of a CUDA graph's batch, SGLang's convention) are not
tokens and are not counted.

Which layers: with ``layers="rotate"`` (default) one layer of each pool kind per sampled step, the
layers of a kind in turn (under a CUDA graph the layer each captured graph checks is the one whose
turn it was at its capture); ``"all"``: every layer called.

Results accumulate over a forward step into :attr:`WriteCheck.cells` (``int64 [WRITE_WIDTH]``,
:data:`WRITE_CELLS`): pairs (token, layer) compared, of which mismatched, not comparable, and the
first mismatch (batch entry, position, FULL slot, SWA slot, layer). Cost per checked layer: about 36
device operations on ``max_tokens`` rows; in a CUDA graph that cost is paid at every replayed step
(``graph_mode="masked"``) or only at sampled ones (``"conditional"``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from otel_swa.checks.write import WRITE_CELLS, WRITE_WIDTH, write_counts, write_offender_fields
from otel_swa.device.checksum import HASHED_DTYPES, rows_viewable
from otel_swa.device.gate import SamplingGate, commit_counts, masked

__all__ = ["WRITE_CELLS", "WRITE_WIDTH", "WRITE_CHECK_MODES", "LayerStore", "WriteCheck", "write_counts",
           "write_offender_fields"]

_C = {name: index for index, name in enumerate(WRITE_CELLS)}
#: ``rotate``: one layer of each pool kind per sampled step, in turn; ``all``: every layer.
WRITE_CHECK_MODES = ("rotate", "all")
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class LayerStore(NamedTuple):
    """What one attention layer stored in a forward step: the arguments of
    :meth:`otel_swa.device.provenance.KvProvenance.after_layer` (by keyword) and of
    :meth:`WriteCheck.check_layer`.

    Attributes:
        layer_id: the layer's id, recorded with a mismatch.
        swa: the buffers are the SWA pool's (indexed by ``full_to_swa_index_mapping[FULL slot]``:
            SGLang's sliding-window layers of a hybrid model); else the FULL pool's (indexed by FULL
            slot).
        k, v: what the layer was given to store, ``[T, ...]`` with the buffers' row elements per
            token (``[T, kv_heads * head_dim]`` or ``[T, kv_heads, head_dim]``), any float dtype, on
            the KV cache's device; ``None`` when the layer stores none (counted unchecked).
        k_buffer, v_buffer: the layer's KV buffers, ``[slots, ...]`` (SGLang:
            ``token_to_kv_pool.get_key_buffer(layer_id)`` / ``get_value_buffer``).
        out_cache_loc: ``int32``/``int64 [T]``, each token's FULL slot (0: padding, not counted).
        full_to_swa_index_mapping: ``int64 [num_full_slots]``; needed when ``swa``, and gives the
            offender's SWA slot otherwise.
        positions: ``int [T]`` (for the offender), or ``None``.
        extend_start_loc: ``int [B]`` the first token of each request (extend batches; for the
            offender's batch entry), or ``None`` (token ``i`` is entry ``i``).
        block_size: ``None`` (default): the buffers are ``[slots, ...]``, indexed by slot. An int
            >= 1: a paged store, the buffers are ``[num_blocks, block_size, ...]`` (any strides),
            ``out_cache_loc`` holds the slots of the layer's own KV cache group (``block *
            block_size + offset``; vLLM's slot mapping), read without any mapping; ``swa`` then only
            names the offender's pool (its slot goes to the ``swa_slot`` cell, the ``full_slot``
            cell holds -1).
    """

    layer_id: int
    swa: bool
    k: "torch.Tensor | None"
    v: "torch.Tensor | None"
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    out_cache_loc: torch.Tensor
    full_to_swa_index_mapping: "torch.Tensor | None" = None
    positions: "torch.Tensor | None" = None
    extend_start_loc: "torch.Tensor | None" = None
    block_size: "int | None" = None


class WriteCheck:
    """The write checks of one forward step (module docstring).

    Args:
        device: the KV cache's device.
        gate: the reporter's :class:`~otel_swa.device.gate.SamplingGate` (the eager/recorded path
            and the flag that masks a recorded check).
        max_tokens: new tokens compared per checked layer (int >= 1).
        layers: :data:`WRITE_CHECK_MODES`.

    Raises:
        ValueError: a bad argument (named, with the value).
    """

    def __init__(self, device: "torch.device | str", gate: SamplingGate, *, max_tokens: int = 8,
                 layers: str = WRITE_CHECK_MODES[0]) -> None:
        if type(max_tokens) is not int or max_tokens < 1:  # noqa: E721
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if layers not in WRITE_CHECK_MODES:
            raise ValueError(f"layers must be one of {', '.join(WRITE_CHECK_MODES)}, got {layers!r}")
        self.device = torch.device(device)
        self.gate = gate
        self.max_tokens = max_tokens
        self.layers = layers
        #: ``int64 [WRITE_WIDTH]`` on ``device``: this step's results so far (:data:`WRITE_CELLS`).
        self.cells = torch.zeros(WRITE_WIDTH, dtype=torch.int64, device=self.device)
        self._arange = torch.arange(max_tokens, dtype=torch.int64, device=self.device)
        self._start = torch.zeros((), dtype=torch.int64, device=self.device)  # the rotation, on the device
        self._turn = 0
        self._seen: "dict[bool, list[int]]" = {False: [], True: []}

    def wants(self, layer_id: int, swa: bool) -> bool:
        """Whether this step checks layer ``layer_id`` (whose buffers are the SWA pool's when
        ``swa``): host work only."""
        seen = self._seen[bool(swa)]
        if layer_id not in seen:
            seen.append(layer_id)
        return self.layers == "all" or seen.index(layer_id) == self._turn % len(seen)

    def check_layer(self, store: LayerStore) -> None:
        """Compare one layer's stores (module docstring; ``store``: :class:`LayerStore`); call after
        the layer's forward. Inputs it cannot compare (``k``/``v`` missing or of another size, a
        cache dtype outside :data:`~otel_swa.device.checksum.HASHED_DTYPES`, rows that are not
        contiguous, ``swa`` without a mapping) are counted unchecked, never raised."""
        layer_id, swa, k, v, k_buffer, v_buffer, out_cache_loc, mapping, positions, extend_start_loc, block_size = store
        tokens = int(out_cache_loc.shape[0])
        if tokens == 0:
            return
        count = min(self.max_tokens, tokens)
        cells = self.cells
        paged = block_size is not None
        with self.gate.region() as mask:
            idx = torch.remainder(self._arange[:count] + self._start, tokens)
            loc = out_cache_loc.index_select(0, idx).long()
            valid = loc.ne(0)
            if paged:
                n = int(k_buffer.shape[0]) * int(block_size) if k_buffer.dim() >= 2 else 0
                row = k_buffer[0, 0].numel() if n else 0
                v_row = v_buffer[0, 0].numel() if v_buffer.dim() >= 2 and v_buffer.shape[0] else 0
                shaped = (n > 0 and int(block_size) >= 1 and k_buffer.shape[1] == block_size
                          and v_buffer.shape[:2] == k_buffer.shape[:2])
            else:
                n = int(k_buffer.shape[0]) if k_buffer.dim() >= 1 else 0
                row = k_buffer[0].numel() if n else 0
                v_row = v_buffer[0].numel() if n and v_buffer.dim() >= 1 and v_buffer.shape[0] else 0
                shaped = n > 0 and v_buffer.shape[0] == n and rows_viewable(k_buffer) and rows_viewable(v_buffer)
            supported = (
                k is not None and v is not None and shaped and k_buffer.dtype in HASHED_DTYPES
                and v_buffer.dtype == k_buffer.dtype and k.numel() == tokens * row and v.numel() == tokens * v_row
                and (mapping is not None or not swa or paged)
            )
            if not supported:
                cells[_C["unchecked"]] += masked(valid.sum(), mask)
                return
            swa_slot = mapping.index_select(0, loc.clamp(0, mapping.shape[0] - 1)).long() if mapping is not None else None
            slot = (swa_slot if swa and not paged else loc).clamp(0, n - 1)
            if paged:
                block, offset = slot.div(int(block_size), rounding_mode="floor"), slot.remainder(int(block_size))
            bits = _BITS[k_buffer.element_size()]
            same = None
            for given, buffer in ((k, k_buffer), (v, v_buffer)):
                if paged:
                    stored = buffer[block, offset].reshape(count, -1).view(bits)
                else:
                    stored = buffer.view(n, -1).index_select(0, slot).view(bits)
                wrote = given.reshape(tokens, -1).index_select(0, idx).to(buffer.dtype).view(bits)
                equal = stored.eq(wrote).all(dim=1)
                same = equal if same is None else same.logical_and_(equal)
            bad = same.logical_not_().logical_and_(valid)
            found = bad.sum()
            first = torch.max(bad, 0).indices.reshape(1)
            if extend_start_loc is None:
                entry = idx
            else:
                entry = torch.searchsorted(extend_start_loc.long(), idx, right=True).sub_(1)
            position = positions.index_select(0, idx).long() if positions is not None else idx.new_full((count,), -1)
            none = idx.new_full((count,), -1)
            if paged:
                full_cell, swa_cell = (none, loc) if swa else (loc, none)
            else:
                full_cell, swa_cell = loc, swa_slot if swa_slot is not None else none
            where = torch.stack([entry, position, full_cell, swa_cell, idx.new_full((count,), int(layer_id)),
                                 idx.new_full((count,), int(bool(swa)))]).index_select(1, first).reshape(-1)
            commit_counts(cells, valid.sum(), found, where, mask)

    def take(self, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """This step's cells, copied into ``out`` (``int64 [WRITE_WIDTH]``; default a new tensor),
        then cleared, and the rotation of tokens and layers advanced. Device work in stream order."""
        if out is None:
            out = torch.empty_like(self.cells)
        out.copy_(self.cells)
        self.cells.zero_()
        self._start += self.max_tokens
        self._turn += 1
        return out

    def reset(self) -> None:
        """Forget this step's results (a forward that raised; a forked child)."""
        self.cells.zero_()
