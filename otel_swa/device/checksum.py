"""Content checksums: a hash of the K and V bytes of one token, as one ``int64`` per slot.

torch only; fixed shapes, no host read: the write side runs inside a captured forward.

What is hashed: the first ``prefix_bytes`` bytes (default 64; ``None``: the whole row) of the token's
K row and of its V row in the cache's dtype, read as little-endian words (32-bit when the row's
byte count allows it, else 16- or 8-bit). SGLang's KV canary hashes the first 16 bytes in its
``partial`` mode and the whole row in ``all`` (``sglang/srt/kv_canary/config.py``); its
perturbations flip byte 0 of a slot's K row in the first layer of a pool, which every prefix sees.

The hash (every intermediate below 2**63, so plain ``int64`` torch operations)::

    h(row) = sum over words j of  g_j(w_j)
    g_j(w) = y ^ (y >> 16),  y = ((w ^ key_j) * mult_j) mod 2**32

with ``key_j`` and odd ``mult_j`` drawn per word position from a fixed integer mix, then bit 63 set
(0 stays "never hashed"). Each ``g_j`` is a bijection of 32-bit words (xor, an odd multiplier mod
2**32 and a xor-shift all are), and the sum is taken without reduction (at most 2**20 words of
2**32), so **any change confined to one word of the hashed bytes always changes the hash** (a
single flipped byte or bit: certain). Changes to several words collide when their ``g`` changes
cancel: about 2**-32 for unrelated bytes (another token's KV in the slot). A 32-bit word is taken
signed (the low 32 bits of the products are the same), so only 16-bit words need a mask.

Cost: about 9 device operations over ``[tokens, words]`` per hash, the K and V words together (the
words are views of the given rows; one ``cat`` copies the hashed prefix), and 4 for the table's
write.
"""

from __future__ import annotations

import torch

__all__ = ["CHECKSUM_MODES", "HASHED_DTYPES", "RowHasher", "rows_viewable"]

#: ``prefix``: the first ``prefix_bytes`` of each row (default); ``all``: every byte; ``off``.
CHECKSUM_MODES = ("prefix", "all", "off")
#: Cache dtypes whose bytes are hashed as written: the given K/V are cast to them first. Anything
#: else (fp8 caches stored as uint8 with scales; integer caches) is counted unchecked.
HASHED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_M32 = 0xFFFFFFFF
_WORDS = {4: (torch.int32, 0xFFFFFFFF), 2: (torch.int16, 0xFFFF), 1: (torch.uint8, 0xFF)}


def _layout(row_bytes: int, prefix_bytes: "int | None") -> "tuple[int, int]":
    """``(bytes hashed, word size)`` for a row of ``row_bytes``."""
    size = row_bytes if prefix_bytes is None else min(prefix_bytes, row_bytes)
    for word in (4, 2, 1):
        if row_bytes % word == 0 and size >= word:
            return size - size % word, word
    return 0, 1


class RowHasher:
    """The hash of K and V rows of one layer's buffers (module docstring).

    Args:
        k_buffer, v_buffer: the layer's KV buffers, ``[slots, ...]`` (every row one token's K or V,
            contiguous within the row); their dtypes and row sizes fix the layout.
        prefix_bytes: bytes of each row hashed (int >= 1), or ``None`` for the whole row.

    Attributes:
        supported: whether these buffers can be hashed (a dtype of :data:`HASHED_DTYPES`, rows
            contiguous); when not, every slot of them is counted unchecked.
    """

    def __init__(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, prefix_bytes: "int | None") -> None:
        self.dtype = k_buffer.dtype
        self.device = k_buffer.device
        self.supported = (
            k_buffer.dtype in HASHED_DTYPES and v_buffer.dtype == k_buffer.dtype and k_buffer.dim() >= 1
            and v_buffer.dim() >= 1 and k_buffer.shape[0] == v_buffer.shape[0]
            and rows_viewable(k_buffer) and rows_viewable(v_buffer)
        )
        self.k_elems = _row_elems(k_buffer)
        self.v_elems = _row_elems(v_buffer)
        size = k_buffer.element_size()
        k_bytes, k_word = _layout(self.k_elems * size, prefix_bytes)
        v_bytes, v_word = _layout(self.v_elems * size, prefix_bytes)
        self.word = min(k_word, v_word)
        self.k_take = k_bytes // size if k_bytes % size == 0 else 0  # elements of each row hashed
        self.v_take = v_bytes // size if v_bytes % size == 0 else 0
        if self.k_take == 0 or self.v_take == 0 or (self.k_take * size) % self.word or (self.v_take * size) % self.word:
            self.supported = False
        self.words = (self.k_take + self.v_take) * size // self.word if self.supported else 0
        self._consts: "tuple[torch.Tensor, torch.Tensor] | None" = None

    # ------------------------------------------------------------------ the hash
    def _constants(self, recording_capture: bool) -> "tuple[torch.Tensor, torch.Tensor]":
        """``(key, mult)``, ``int64 [words]`` each: made once, outside capture (made inside one
        they are a temporary of the graph, recomputed at every replay, never kept)."""
        if self._consts is not None:
            return self._consts
        j = torch.arange(self.words, dtype=torch.int64, device=self.device)
        x = (j * 0x9E3779B1 + 0x7F4A7C15) & _M32
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & _M32
        x ^= x >> 12
        key = x.clone()
        mult = ((x * 0x297A2D39) & 0x7FFFFFFF) | 1  # odd, < 2**31
        if not recording_capture:
            self._consts = (key, mult)
        return key, mult

    def _hash(self, k_rows: torch.Tensor, v_rows: torch.Tensor, capturing: bool) -> torch.Tensor:
        """``int64 [n]`` from ``[n, k_take]`` and ``[n, v_take]`` rows of ``dtype`` (the last
        dimension contiguous)."""
        word_dtype, mask = _WORDS[self.word]
        words = torch.cat([_words(k_rows, word_dtype), _words(v_rows, word_dtype)], dim=1).long()
        if self.word == 2:
            words &= mask  # the sign-extended int16 word back to its unsigned value
        key, mult = self._constants(capturing)
        x = words.bitwise_xor_(key).mul_(mult).bitwise_and_(_M32)
        x ^= x >> 16
        return x.sum(dim=1).add_(-(1 << 63))  # bit 63: hashed (0 stays "never hashed")

    def of_given(self, k: torch.Tensor, v: torch.Tensor, tokens: int, capturing: bool = False) -> torch.Tensor:
        """The checksums of the K and V a layer was given to store, ``int64 [tokens]``: ``k``,
        ``v`` with ``tokens`` rows (any shape ``[tokens, ...]`` of the row's elements), cast to the
        cache dtype as the store casts them (the hashed prefix only)."""
        kk = k.reshape(tokens, -1)[:, :self.k_take]
        vv = v.reshape(tokens, -1)[:, :self.v_take]
        if kk.dtype != self.dtype:
            kk = kk.to(self.dtype)
        if vv.dtype != self.dtype:
            vv = vv.to(self.dtype)
        return self._hash(kk, vv, capturing)

    def of_pool(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                capturing: bool = False) -> torch.Tensor:
        """The checksums of the bytes the pool holds at ``slots`` (``int64 [n]``, clamped into the
        buffers), ``int64 [n]``."""
        n = k_buffer.shape[0]
        index = slots.clamp(0, n - 1)
        kk = k_buffer.view(n, -1)[:, :self.k_take].index_select(0, index)
        vv = v_buffer.view(n, -1)[:, :self.v_take].index_select(0, index)
        return self._hash(kk, vv, capturing)

    def given_shape_ok(self, k: torch.Tensor, v: torch.Tensor, tokens: int) -> bool:
        """Whether ``k`` and ``v`` hold ``tokens`` rows of this layer's row sizes (metadata only)."""
        return k.numel() == tokens * self.k_elems and v.numel() == tokens * self.v_elems


def _words(rows: torch.Tensor, word_dtype: torch.dtype) -> torch.Tensor:
    """``rows`` (``[n, elements]``) read as words: a view when the strides allow one, else a copy."""
    try:
        return rows.view(word_dtype)
    except RuntimeError:
        return rows.contiguous().view(word_dtype)


def _row_elems(buffer: torch.Tensor) -> int:
    return int(buffer[0].numel()) if buffer.dim() >= 1 and buffer.shape[0] else 0


def rows_viewable(buffer: torch.Tensor) -> bool:
    """Whether ``buffer.view(slots, -1)`` is a view (each row contiguous, rows evenly strided)."""
    if buffer.dim() == 1:
        return True
    try:
        buffer.view(buffer.shape[0], -1)
    except RuntimeError:
        return False
    return True
