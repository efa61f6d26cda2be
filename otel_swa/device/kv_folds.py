"""Every layer's K/V bytes of a slot in two numbers: the folds of the layer hashes, per slot and pool.

torch only; the write side has fixed shapes and no host read (a CUDA graph capture records it).

A slot of a pool holds, per attention layer ``L`` of that pool, one K row and one V row. Their hash
``h_L`` (:mod:`otel_swa.device.checksum`: every byte, or the first ``checksum_bytes`` of one
designated layer with ``OTEL_SWA_PROVENANCE=prefix``; ``0 <= h_L < Q = 2**40 - 87``) is folded into
two ``int64`` per slot, 16 bytes per slot and pool whatever the number of layers::

    f1 = MARK + sum over the pool's layers L of  h_L           MARK = 2**62 (0: never written)
    f2 =        sum over the pool's layers L of  (L + 1) * h_L

``L`` is the layer's id in the model (SGLang's ``layer_id``, at most :data:`MAX_LAYER_ID`). Both are
exact integer sums, never reduced: ``f1 < 2**62 + 4096 * 2**40`` and ``f2 < 4095 * 4096 / 2 * 2**40
< 2**63``, so ``int64`` never overflows and no modular inverse is needed to read them.

Written at every forward step: the step's stamp call resets the folds of the slots it writes to
``(MARK, 0)`` (one ``index_copy_`` per pool), then the layers add their ``h_L`` and ``(L + 1) * h_L``
at those slots, hashing the K/V each was given to store. When the engine names the pool's layers in
the order it calls them (``order``), each layer's call is **one** device operation (a ``cat`` of its
K and V words into row ``L`` of a step buffer ``[layers, T, words]``) and the pool's last layer hashes
the whole buffer and folds it (9 more: the 6 of the hash, a weighted sum of 2, one ``index_add_``):
``layers + 10`` operations per pool and step (the buffer's allocation included), whatever the row
size. Without an order (or with one layer), each layer hashes and folds its own rows: 9 per layer. No per-row loop in
either. A slot the prefix cache keeps is not written again: its folds stay. :class:`KvProvenance
<otel_swa.device.provenance.KvProvenance>` with both pools' orders fills one step buffer for the
layers of both pools instead (:mod:`otel_swa.device.step_folds`: ``layers + 10`` a step, the same
sums).

Verified at a sampled step (:meth:`PoolFolds.verify`): the folds are recomputed from the bytes the
pool holds now, for every layer of the pool at once (one gather per K and per V buffer, one ``cat``,
the hash over ``[slots, layers, words]``, one weighted sum), and compared with the written ones:
``d1 = f1' - f1``, ``d2 = f2' - f2``.

What a comparison tells:

* bytes changed in **one layer** ``L`` of a slot: ``d1 = h'_L - h_L`` and ``d2 = (L + 1) * d1``. Any
  change confined to one 32-bit word of the row (one flipped bit or byte, anywhere in K or V) makes
  ``d1 != 0``, always; a change of several words is missed with probability about 2**-32
  (:mod:`otel_swa.device.checksum`). The layer is named exactly: ``L = d2 / d1 - 1``;
* bytes changed in **two layers** ``a != b``: missed only if ``d_a + d_b = 0`` and ``(a + 1) d_a + (b
  + 1) d_b = 0``, i.e. ``(a - b) d_a = 0``: both layers' hashes unchanged, each as likely as for one
  layer alone. The folds then name no layer when ``d2 / d1`` is not an integer layer id of the pool
  (``layer`` absent: several), and may name a wrong one when it is (equal changes in layers of equal
  parity, ``(a + b) / 2``);
* three or more layers: missed when both linear sums of the hash changes vanish together: for
  unrelated bytes about 2**-32 (``d1 = 0``) times the chance that ``d2`` then vanishes too.

Layers whose buffers cannot be hashed (an fp8 cache) are not folded; a pool without a hashed layer
is counted unchecked. A layer seen for the first time after its pool's slots were written would make
their recomputed folds differ: every layer of a pool must call at every step that writes (as every
attention layer of a forward does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from otel_swa.device.checksum import RowHasher, word_dtype as _word_dtype

__all__ = ["FOLD_MARK", "MAX_LAYER_ID", "PoolFolds", "layer_of"]

#: ``f1`` of a slot written since the folds were switched on (0: never written).
FOLD_MARK = 1 << 62
#: The largest layer id folded (the bound that keeps ``f2`` below 2**63); larger ones are not hashed.
MAX_LAYER_ID = 4094


class _Layer(NamedTuple):
    layer_id: int
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    hasher: RowHasher


class _Group(NamedTuple):
    """The layers of one hash layout, verified together."""

    hasher: RowHasher
    buffers: "list[tuple[torch.Tensor, torch.Tensor]]"
    words: "list[torch.Tensor] | None"  # the buffers' word views (K, V, K, V, ...), or None: made at each use
    weights: torch.Tensor  # int64 [layers, 2]: 1 and L + 1


def layer_of(d1: int, d2: int, layer_ids: "frozenset[int] | set[int]") -> "int | None":
    """The one layer whose bytes changed, from the differences of the folds (module docstring), or
    ``None`` when they name none of ``layer_ids`` (several layers changed)."""
    if d1 == 0 or d2 % d1:
        return None
    layer = d2 // d1 - 1
    return layer if layer in layer_ids else None


class PoolFolds:
    """The folds of one pool (module docstring).

    Args:
        slots: the pool's slots (the first dimension of its K/V buffers), int >= 1.
        device: the KV cache's device.
        prefix_bytes: bytes of each row hashed, or ``None`` for every byte.
        order: the ids of the pool's layers folded, in the order the engine calls them in a step
            (each exactly once per step that writes), or ``None`` (unknown: each layer folds alone).

    Attributes:
        table: ``int64 [slots, 2]``, ``(f1, f2)`` per slot.
    """

    def __init__(self, slots: int, device: torch.device, prefix_bytes: "int | None",
                 order: "tuple[int, ...] | None" = None) -> None:
        self.table = torch.zeros((slots, 2), dtype=torch.int64, device=device)
        if order is not None and (not order or len(set(order)) != len(order)
                                  or not all(type(i) is int and 0 <= i <= MAX_LAYER_ID for i in order)):  # noqa: E721
            raise ValueError(f"order must name distinct layer ids from 0 to {MAX_LAYER_ID}, got {order!r}")
        self.order = tuple(order) if order is not None else None
        # one layer alone folds cheaper by itself (9 operations against 11)
        self._index = {layer_id: i for i, layer_id in enumerate(self.order)} if self.order and len(self.order) > 1 else {}
        self._order_weights = (torch.tensor([[[1, i + 1]] for i in self.order], dtype=torch.int64, device=device)
                               if self.order else None)  # [layers, 1, 2]
        self._step: "torch.Tensor | None" = None  # the step buffer [layers, T, words] being filled
        self._uniform = True
        self._reset = torch.tensor([[FOLD_MARK, 0]], dtype=torch.int64, device=device)
        self.prefix_bytes = prefix_bytes
        self.layers: "dict[int, _Layer]" = {}
        self._weights: "dict[int, torch.Tensor]" = {}  # layer id -> int64 [1, 2] on the device
        self._groups: "list[_Group] | None" = None

    @property
    def layer_ids(self) -> frozenset:
        """The ids of the layers folded."""
        return frozenset(self.layers)

    def reset(self, slots: torch.Tensor) -> None:
        """``(MARK, 0)`` at ``slots`` (``int64 [T]``, inside the table): the slots a step writes,
        before its first layer. One device operation."""
        self.table.index_copy_(0, slots, self._reset.expand(slots.shape[0], 2))

    def layer(self, layer_id: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> "_Layer | None":
        """The layer folded under ``layer_id`` with these buffers (registered at its first call, again
        when its buffers change), or ``None`` when it is not hashed (dtype, layout, id). Host only."""
        known = self.layers.get(layer_id)
        if known is not None and known.k_buffer is k_buffer and known.v_buffer is v_buffer:
            return known
        if not 0 <= layer_id <= MAX_LAYER_ID:
            return None
        hasher = RowHasher(k_buffer, v_buffer, self.prefix_bytes)
        if not hasher.supported:
            return None
        if known is not None and known.hasher.layout == hasher.layout:
            hasher = known.hasher  # keep its constants
        entry = self.layers[layer_id] = _Layer(layer_id, k_buffer, v_buffer, hasher)
        self._groups = None
        # the order's step buffer needs one layout for all its layers (else each layer folds alone)
        self._uniform = len({e.hasher.layout for e in self.layers.values() if e.layer_id in self._index}) <= 1
        return entry

    def add(self, layer: _Layer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, capturing: bool) -> None:
        """Fold layer ``layer``'s hash of the given ``k``, ``v`` (``[T, ...]``, checked with
        :meth:`RowHasher.given_shape_ok`) into the folds of ``slots`` (``int64 [T]``, inside the table):
        with an ``order``, one device operation (10 more at the pool's last layer), else 9."""
        tokens = int(slots.shape[0])
        index = self._index.get(layer.layer_id)
        if index is None or not self._uniform:
            h = layer.hasher.of_given(k, v, tokens, capturing)
            self.table.index_add_(0, slots, h.unsqueeze(1) * self._weight(layer.layer_id, capturing))
            return
        hasher = layer.hasher
        step = self._step
        if index == 0 or step is None or step.shape[1] != tokens:
            step = self._step = torch.empty((len(self.order), tokens, hasher.words), dtype=_word_dtype(hasher),
                                            device=self.table.device)
        torch.cat(hasher.given_words(k, v, tokens), dim=1, out=step[index])
        if index == len(self.order) - 1:
            h = hasher.hash_words(step, capturing)  # [layers, T]
            self.table.index_add_(0, slots, (h.unsqueeze(2) * self._order_weights).sum(dim=0))
            self._step = None


    def _weight(self, layer_id: int, capturing: bool) -> torch.Tensor:
        """``int64 [1, 2]`` ``(1, layer_id + 1)`` on the device: made once outside capture (inside one
        by device operations only, not kept)."""
        weight = self._weights.get(layer_id)
        if weight is None:
            weight = self._reset.new_ones((1, 2))
            weight[:, 1:].fill_(layer_id + 1)
            if not capturing:
                self._weights[layer_id] = weight
        return weight

    def verify(self, slots: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor] | None":
        """Recompute the folds of ``slots`` (``int64 [n]``, inside the table) from the bytes the pool
        holds: ``(written, delta)``, ``bool [n]`` (the slot's folds were written) and ``int64 [n, 2]``
        (``f1' - f1``, ``f2' - f2``; 0 where nothing changed); ``None`` when no layer is folded.
        Per layout of the pool's layers (one in every engine today): ``2 x layers`` gathers, one
        ``cat``, 6 operations of the hash, 2 of the weighted sum; then 4 for the comparison."""
        groups = self._groups if self._groups is not None else self._make_groups()
        if not groups:
            return None
        stored = self.table.index_select(0, slots)
        now = None
        for group in groups:
            h = group.hasher.of_rows(group.buffers, slots, words=group.words)  # [n, layers]
            folded = (h.unsqueeze(2) * group.weights).sum(dim=1)  # [n, 2]
            now = folded if now is None else now.add_(folded)
        delta = now.sub_(stored)
        delta[:, 0].add_(FOLD_MARK)
        return stored[:, 0].ne(0), delta

    def _make_groups(self) -> "list[_Group]":
        by_layout: "dict[tuple, list[_Layer]]" = {}
        for entry in sorted(self.layers.values()):
            by_layout.setdefault(entry.hasher.layout, []).append(entry)
        groups = []
        for entries in by_layout.values():
            hasher = entries[0].hasher
            buffers = [(e.k_buffer, e.v_buffer) for e in entries]
            words = [hasher.word_rows(buffer, k) for pair in buffers for k, buffer in zip((True, False), pair)]
            views = all(w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                        for w, b in zip(words, (b for pair in buffers for b in pair)))
            weights = torch.tensor([[1, e.layer_id + 1] for e in entries], dtype=torch.int64,
                                   device=self.table.device)
            groups.append(_Group(hasher, buffers, words if views else None, weights))
        self._groups = groups
        return groups

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Carry the folds of ``src`` to ``dst`` (``int64 [n]`` each)."""
        self.table.index_copy_(0, dst, self.table.index_select(0, src))
