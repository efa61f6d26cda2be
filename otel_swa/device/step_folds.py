"""Every layer of both pools hashed in one pass per forward step: the checksums' write path.

torch only; fixed shapes, no host read (a CUDA graph capture records it).

:class:`~otel_swa.device.kv_folds.PoolFolds` folds the layers of one pool; a forward step of a hybrid
model calls the layers of both pools (SGLang: the sliding-window and the full-attention layers
interleaved), each given its K/V. When the engine names every pool's layers
(``checksum_order``) and they all hash the same layout (dtype, row sizes, word), one step buffer
``[layers, T, words]`` takes the rows of every layer of both pools, one device operation per layer
(a ``cat`` of its K and V words into its row), and the last layer of the step hashes the whole
buffer once and folds it into both pools' tables::

    h  = hash of every row                               [layers, T]     6 operations
    F  = sum over layers of h[L] * W[L]                  [T, 4]          2 (W: (1, L + 1) in the
                                                                           columns of L's pool, 0 in
                                                                           the other's)
    table_p.index_add_(slots_p, F[:, 2p:2p + 2])                         1 per pool

so a decode step's checksums are ``layers + 10`` operations (the buffer's allocation included; it is
kept between steps of the same size up to :data:`KEEP_BYTES`), against ``layers + 10`` per pool
with a pool's own step buffer, or 9 per layer alone. The sums are the same integers in any grouping,
so the tables hold exactly what the per-pool folds write (``tests/core/test_step_folds.py`` compares
them).

A layer of another layout registered later (no engine today) ends the shared pass: what the buffer
holds is folded at once and the pools fold alone from then on. A step whose layers did not all call
(a layer that stores nothing) is folded at the next :meth:`StepFolds.start` with the rows it has, so
the missing layer's slots differ from their recomputed folds (a ``kv_corrupt_tokens`` naming it).
"""

from __future__ import annotations

from typing import Sequence

import torch

from otel_swa.device.checksum import word_dtype
from otel_swa.device.kv_folds import PoolFolds

__all__ = ["KEEP_BYTES", "StepFolds"]

#: The largest step buffer kept for the next step of the same size (a decode batch's; an extend
#: step's buffer is made at its step and freed after it).
KEEP_BYTES = 16 << 20


class StepFolds:
    """The shared step buffer of the pools' ordered layers (module docstring).

    Args:
        folds: the pools' :class:`PoolFolds` (index 0 FULL, 1 SWA; ``None`` without that pool).
        orders: per pool, the ids of its layers that call at every step that writes (``()``: none).

    Raises:
        ValueError: a layer id named twice.
    """

    def __init__(self, folds: "Sequence[PoolFolds | None]", orders: "Sequence[Sequence[int]]") -> None:
        self.folds = tuple(folds)
        self.pool_of = {layer_id: p for p, order in enumerate(orders) for layer_id in order}
        if len(self.pool_of) != sum(len(order) for order in orders):
            raise ValueError(f"a layer id is named in two pools' orders: {orders!r}")
        self.layers = len(self.pool_of)
        self.shared = self.layers > 0
        self._layout: "tuple | None" = None
        self._hasher = None  # the last hasher seen of that layout
        self._filled: "list[int]" = []  # layer ids in the rows of the buffer, in the order they came
        self._buffer: "torch.Tensor | None" = None  # [layers, T, row elements], the cache dtype
        self._rows: "tuple[torch.Tensor, ...] | None" = None  # its rows
        self._kept: "tuple[torch.Tensor, ...] | None" = None  # (buffer, *rows) kept for the next step
        self._slots: "list[torch.Tensor | None]" = [None] * len(self.folds)
        self._weights: "dict[tuple, torch.Tensor]" = {}
        if self.layers:  # the order of increasing layer ids (SGLang's), made outside any capture
            self._weight(tuple(sorted(self.pool_of)), next(f.table.device for f in self.folds if f is not None), False)

    def takes(self, layer_id: int) -> bool:
        """Whether ``layer_id``'s hash goes through the shared buffer (host only)."""
        return self.shared and layer_id in self.pool_of

    def start(self) -> None:
        """A new forward step (the stamp call): fold what an unfinished step left in the buffer."""
        if self._filled:
            self._fold(False)

    def add(self, pool: int, layer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, capturing: bool) -> None:
        """Put ``layer``'s (a :class:`PoolFolds` layer entry) words of the given ``k``, ``v`` into
        the step buffer, its pool's slots ``slots`` (``int64 [T]``); at the step's last layer hash
        and fold them all. One device operation (10 more at the last layer)."""
        hasher = layer.hasher
        if hasher is not self._hasher:
            self._check_layout(hasher, pool, layer, k, v, slots, capturing)
            if not self.shared:
                return
        tokens = int(slots.shape[0])
        rows = self._rows
        if rows is not None and (rows[0].shape[0] != tokens or layer.layer_id in self._filled):
            self._fold(capturing)  # a step of another size began without its stamp call
            rows = None
        if rows is None:
            rows = self._make_rows(hasher, tokens, slots.device, capturing)
        dtype = hasher.dtype
        # [T, row elements] already (SGLang hands its layers K and V so): no reshape to dispatch
        kk = k if k.dim() == 2 and k.shape[0] == tokens else k.reshape(tokens, -1)
        vv = v if v.dim() == 2 and v.shape[0] == tokens else v.reshape(tokens, -1)
        # the rows as the store casts them (every byte: the whole row), their words the buffer's words
        torch.cat((kk if kk.dtype == dtype else kk.to(dtype), vv if vv.dtype == dtype else vv.to(dtype)), dim=1,
                  out=rows[len(self._filled)])
        self._filled.append(layer.layer_id)
        self._slots[pool] = slots
        if len(self._filled) == self.layers:
            self._fold(capturing, hasher)

    def _check_layout(self, hasher, pool: int, layer, k, v, slots, capturing: bool) -> None:
        """A hasher not seen before: the first fixes the layout; one of another layout ends the
        shared pass (what the buffer holds folded now, every pool folding alone from now on)."""
        if self._layout is None:
            self._layout, self._hasher = hasher.layout, hasher
        elif hasher.layout == self._layout:
            self._hasher = hasher
        else:
            if self._filled:
                self._fold(capturing)
            if self._filled:
                self._fold(capturing)
            self.shared = False
            self.folds[pool].add(layer, k, v, slots, capturing)

    def _make_rows(self, hasher, tokens: int, device: torch.device, capturing: bool) -> "tuple[torch.Tensor, ...]":
        """The step buffer's rows, ``[T, row elements]`` each of the cache dtype (kept for the next
        step of the same size when small, not when made inside a capture)."""
        kept = self._kept
        if kept is not None and kept[0].shape[1] == tokens:
            rows = kept
        else:
            buffer = torch.empty((self.layers, tokens, hasher.k_elems + hasher.v_elems), dtype=hasher.dtype, device=device)
            rows = (buffer,) + tuple(buffer.unbind(0))
            if not capturing and buffer.numel() * buffer.element_size() <= KEEP_BYTES:
                self._kept = rows
        self._buffer, self._rows = rows[0], rows[1:]
        return self._rows

    def _fold(self, capturing: bool, hasher=None) -> None:
        """Hash the filled rows and add them to their pools' folds; empty the buffer."""
        filled, buffer = tuple(self._filled), self._buffer
        self._filled, self._buffer, self._rows = [], None, None
        if hasher is None:
            hasher = self._hasher
        words = buffer.view(word_dtype(hasher))  # [layers, T, words]: K's words then V's of each row
        h = hasher.hash_words(words if len(filled) == self.layers else words[:len(filled)], capturing)  # [rows, T]
        folded = (h.unsqueeze(2) * self._weight(filled, buffer.device, capturing)).sum(dim=0)  # [T, 2 x pools]
        for p in sorted({self.pool_of[i] for i in filled}):
            slots = self._slots[p]
            self.folds[p].table.index_add_(0, slots, folded[:, 2 * p:2 * p + 2])
        self._slots = [None] * len(self.folds)

    def _weight(self, filled: tuple, device: torch.device, capturing: bool) -> torch.Tensor:
        """``int64 [rows, 1, 2 x pools]``: ``(1, L + 1)`` in the columns of layer ``L``'s pool."""
        weight = self._weights.get(filled)
        if weight is None:
            rows = []
            for layer_id in filled:
                row = [0] * (2 * len(self.folds))
                p = self.pool_of[layer_id]
                row[2 * p], row[2 * p + 1] = 1, layer_id + 1
                rows.append([row])
            weight = torch.tensor(rows, dtype=torch.int64, device=device)
            if not capturing:
                self._weights[filled] = weight
        return weight
