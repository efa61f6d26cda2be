"""Content checksums: a hash of the K and V bytes of one token in one layer, below 2**40.

torch only; fixed shapes, no host read: the write side runs inside a captured forward.

What is hashed: the first ``prefix_bytes`` bytes (``None``, the default of provenance: the whole
row) of the token's K row and of its V row in the cache's dtype, read as little-endian words
(32-bit when the row's byte count allows it, else 16- or 8-bit) taken as torch reads them: ``int32``
and ``int16`` signed, ``uint8`` unsigned. The bytes, never a rounding: a bf16 or fp16 row is hashed
as its 2-byte words. SGLang's KV canary hashes the first 16 bytes in its ``partial`` mode and the
whole row in ``all`` (``sglang/srt/kv_canary/config.py``), of layer 0 of each sub-pool only.

The hash (every intermediate below 2**63, so plain ``int64`` torch operations)::

    h(row) = (sum over words j of  g_j(w_j))  mod Q,      Q = 2**40 - 87 (a prime)
    g_j(w) = y ^ (y >> 16),  y = (w * mult_j + keymult_j) mod 2**32  = ((w + key_j) * mult_j) mod 2**32

with ``key_j`` and odd ``mult_j`` drawn per word position from a fixed integer mix
(``keymult_j = key_j * mult_j mod 2**32``). Each ``g_j`` is injective on the words of its width (an
odd multiplier mod 2**32 and a xor-shift are bijections of 32-bit values, and distinct words stay
distinct mod 2**32 after the shift by ``key_j``), and a single word's change moves the sum by less
than 2**32 < Q, so **any change confined to one word of the hashed bytes always changes the hash**
(a single flipped byte or bit: certain). Changes to several words collide when their ``g`` changes
cancel mod Q: about 2**-32 for unrelated bytes (another token's KV in the slot). ``Q`` keeps the
hash below 2**40 so that the folds over layers (:mod:`otel_swa.device.kv_folds`) stay exact in
``int64``.

Cost: 7 device operations over ``[tokens, words]`` per hash of one layer, the K and V words
together (one ``cat`` of views of the given rows; the word-to-``int64`` widening happens inside the
``addcmul``), and the same 7 for the rows of every layer of a pool at once at a sample
(:meth:`RowHasher.of_rows`, after one gather per buffer).

On the CPU a sample's hash (:meth:`RowHasher.of_rows`, thousands of rows of every layer) is bound
by memory, not by operations: there it computes the same values in ``int32`` lanes (half the bytes
of ``int64``, and x86's 32-bit multiply and arithmetic shift are vector instructions where the
64-bit ones are not) over chunks of about :data:`CPU_CHUNK_WORDS` words, each gathered and hashed
while it is in the cache (8 operations a chunk). ``(w * mult + keymult) mod 2**32`` is the wrapped
``int32`` product and sum (their low 32 bits are the same bits), ``y >> 16`` of the unsigned value
is the arithmetic shift masked to 16 bits, and the unsigned values are the ``int32`` ones widened
and masked to their low 32 bits before the sum. ``tests/core/test_provenance.py`` holds
both forms equal bit for bit on words of every width, extremes included.
"""

from __future__ import annotations

import torch

__all__ = ["CHECKSUM_MODES", "CPU_CHUNK_WORDS", "HASH_PRIME", "HASHED_DTYPES", "RowHasher", "rows_viewable", "hash_constants", "word_dtype"]

#: ``all`` (default): every byte of every attention layer's K and V rows; ``prefix``: the first
#: ``checksum_bytes`` of each row of one designated layer per pool (cheaper; misses every other layer
#: and every later byte); ``off``.
CHECKSUM_MODES = ("all", "prefix", "off")
#: The prime the hash is reduced by: every hash is below 2**40 (module docstring).
HASH_PRIME = (1 << 40) - 87
#: Cache dtypes whose bytes are hashed as written: the given K/V are cast to them first. Anything
#: else (fp8 caches stored as uint8 with scales; integer caches) is counted unchecked.
HASHED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_M32 = 0xFFFFFFFF
#: Words a chunk of a sample's hash on the CPU holds (module docstring): 1 MiB of ``int32``, a size
#: that stays in a core's cache beside its temporaries (on this project's CPU benchmark 0.4 - 0.5x
#: the time of one pass over a sample's 4,096 rows x 3 layers x 256 words; smaller chunks pay more
#: operations than they save).
CPU_CHUNK_WORDS = 1 << 18
_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


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
        self._consts32: "tuple[torch.Tensor, torch.Tensor] | None" = None

    @property
    def layout(self) -> tuple:
        """What fixes the hash of a row: the dtype, the row sizes and the part hashed, the word size
        (layers of equal layout are hashed together)."""
        return (self.dtype, self.k_elems, self.v_elems, self.k_take, self.v_take, self.word)

    # ------------------------------------------------------------------ the hash
    def _constants(self, recording_capture: bool) -> "tuple[torch.Tensor, torch.Tensor]":
        """``(keymult, mult)``, ``int64 [words]`` each (:func:`hash_constants`): made once, outside
        capture (made inside one they are a temporary of the graph, recomputed at every replay,
        never kept)."""
        if self._consts is not None:
            return self._consts
        consts = hash_constants(self.words, self.device)
        if not recording_capture:
            self._consts = consts
        return consts

    def _hash_words(self, words: torch.Tensor, capturing: bool) -> torch.Tensor:
        """``int64 [...]`` from words ``[..., words]`` of the word dtype: 6 device operations."""
        keymult, mult = self._constants(capturing)
        x = torch.addcmul(keymult, words, mult).bitwise_and_(_M32)  # widened to int64 inside
        x ^= x >> 16
        return x.sum(dim=-1).remainder_(HASH_PRIME)

    def _hash(self, k_rows: torch.Tensor, v_rows: torch.Tensor, capturing: bool) -> torch.Tensor:
        """``int64 [n]`` from ``[n, k_take]`` and ``[n, v_take]`` rows of ``dtype`` (the last
        dimension contiguous)."""
        word_dtype = _WORDS[self.word]
        return self._hash_words(torch.cat([_words(k_rows, word_dtype), _words(v_rows, word_dtype)], dim=1), capturing)

    def given_words(self, k: torch.Tensor, v: torch.Tensor, tokens: int) -> "tuple[torch.Tensor, torch.Tensor]":
        """The hashed words of the K and V a layer was given to store (``[tokens, ...]``, cast to the
        cache dtype as the store casts them): ``[tokens, k words]`` and ``[tokens, v words]``, views
        when the given rows allow."""
        kk, vv = self._as_stored(k, v, tokens)
        word_dtype = _WORDS[self.word]
        return _words(kk, word_dtype), _words(vv, word_dtype)

    def _as_stored(self, k: torch.Tensor, v: torch.Tensor, tokens: int) -> "tuple[torch.Tensor, torch.Tensor]":
        """The hashed part of the given rows, ``[tokens, elements]``, cast to the cache dtype."""
        kk = k.reshape(tokens, -1)[:, :self.k_take]
        vv = v.reshape(tokens, -1)[:, :self.v_take]
        return (kk if kk.dtype == self.dtype else kk.to(self.dtype)), (vv if vv.dtype == self.dtype else vv.to(self.dtype))

    def hash_words(self, words: torch.Tensor, capturing: bool = False) -> torch.Tensor:
        """The hashes of rows of words ``[..., words]`` (K's then V's words of each row, the word dtype
        of this layout), ``int64 [...]``: 6 device operations whatever the leading dimensions."""
        return self._hash_words(words, capturing)

    def of_given(self, k: torch.Tensor, v: torch.Tensor, tokens: int, capturing: bool = False) -> torch.Tensor:
        """The hashes of the K and V a layer was given to store, ``int64 [tokens]`` in ``0 ..
        HASH_PRIME - 1``: ``k``, ``v`` with ``tokens`` rows (any shape ``[tokens, ...]`` of the
        row's elements), cast to the cache dtype as the store casts them (the hashed prefix only)."""
        return self._hash(*self._as_stored(k, v, tokens), capturing)

    def of_pool(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor,
                capturing: bool = False) -> torch.Tensor:
        """The hashes of the bytes the pool holds at ``slots`` (``int64 [n]``, clamped into the
        buffers), ``int64 [n]``."""
        return self.of_rows([(k_buffer, v_buffer)], slots.clamp(0, k_buffer.shape[0] - 1), capturing)[:, 0]

    def word_rows(self, buffer: torch.Tensor, k: bool) -> torch.Tensor:
        """The hashed words of every row of ``buffer`` (this layout's K buffer when ``k``, else its
        V buffer), ``[slots, words]``: a view when the strides allow one (:func:`rows_viewable`
        buffers of a 4-byte aligned row), else a copy (keep it only while the buffer is unchanged)."""
        n = buffer.shape[0]
        return _words(buffer.view(n, -1)[:, :(self.k_take if k else self.v_take)], _WORDS[self.word])

    def of_rows(self, buffers: "list[tuple[torch.Tensor, torch.Tensor]]", slots: torch.Tensor,
                capturing: bool = False, words: "list[torch.Tensor] | None" = None) -> torch.Tensor:
        """The hashes of the rows at ``slots`` (``int64 [n]``, already inside the buffers) of several
        layers of this layout at once, ``int64 [n, layers]``: per buffer one gather, one ``cat``, then
        the 6 operations of the hash over ``[n, layers, words]``.

        Args:
            buffers: ``(k_buffer, v_buffer)`` per layer, each of this hasher's layout.
            words: the :meth:`word_rows` of those buffers (K, V, K, V, ...), when the caller keeps them.
        """
        if words is None:
            words = [self.word_rows(buffer, k) for pair in buffers for k, buffer in zip((True, False), pair)]
        layers = len(words) // 2
        if self.device.type != "cpu":
            rows = torch.cat([w.index_select(0, slots) for w in words], dim=1)
            return self._hash_words(rows.view(slots.shape[0], layers, self.words), capturing)
        step = max(1, CPU_CHUNK_WORDS // max(1, layers * self.words))  # rows of a chunk
        chunks = []
        for start in range(0, slots.shape[0], step):
            part = slots[start:start + step]
            rows = torch.cat([w.index_select(0, part) for w in words], dim=1)
            chunks.append(self._hash_words_lanes(rows.view(part.shape[0], layers, self.words)))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks) if chunks else torch.zeros(
            (0, layers), dtype=torch.int64, device=self.device)

    def _hash_words_lanes(self, words: torch.Tensor) -> torch.Tensor:
        """:meth:`_hash_words` in ``int32`` lanes (module docstring; the CPU's form), ``int64 [...]``
        from words ``[..., words]``: 8 device operations, the same values."""
        if self._consts32 is None:
            keymult, mult = self._constants(False)
            # the constants' bits as int32 (mult < 2**31 already; keymult below 2**32)
            self._consts32 = (torch.where(keymult >= 1 << 31, keymult - (1 << 32), keymult).to(torch.int32),
                              mult.to(torch.int32))
        keymult, mult = self._consts32
        y = torch.addcmul(keymult, words, mult)  # (w * mult + keymult) mod 2**32, wrapped
        y ^= (y >> 16).bitwise_and_(0xFFFF)  # y ^ (y >> 16) of the unsigned bits
        # the unsigned values summed in int64 (a widening copy and a sum of int64 run at 2 - 3x the
        # speed of a sum of int32 into int64 on the CPU)
        return y.to(torch.int64).bitwise_and_(_M32).sum(dim=-1).remainder_(HASH_PRIME)

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


def hash_constants(words: int, device: "torch.device | str" = "cpu") -> "tuple[torch.Tensor, torch.Tensor]":
    """The hash's per-word constants ``(keymult, mult)``, ``int64 [words]`` each (module docstring):
    ``key`` and the odd ``mult < 2**31`` from a fixed integer mix of the word's index ``j``,
    ``keymult = key * mult mod 2**32``."""
    j = torch.arange(words, dtype=torch.int64, device=device)
    x = (j * 0x9E3779B1 + 0x7F4A7C15) & _M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & _M32
    x ^= x >> 12
    mult = ((x * 0x297A2D39) & 0x7FFFFFFF) | 1  # odd, < 2**31
    return (x * mult) & _M32, mult


def word_dtype(hasher: RowHasher) -> torch.dtype:
    """The torch dtype ``hasher``'s words are read as (``int32``, ``int16`` or ``uint8``)."""
    return _WORDS[hasher.word]
