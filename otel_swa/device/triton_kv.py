"""Triton kernels of provenance: the every-step KV write path (stamps, content folds) and a sample's verification.

Imported only where triton is installed (:func:`otel_swa.device.kernel_select.write_kernels` picks
them for a CUDA KV cache); the torch functions they replace stay the reference and the CPU path, and
these kernels give the same bits (``tests/kernels`` runs both, on CPU under Triton's interpreter,
``TRITON_INTERPRET=1``, and on a CUDA device).

* :func:`stamp_and_reset`: :func:`otel_swa.device.stamps.write_stamps` for the FULL pool and the
  SWA pool at its mapping, and the reset of both pools' folds at the written slots
  (:meth:`otel_swa.device.kv_folds.PoolFolds.reset`): one kernel instead of about 36 operations.
* :func:`fold_layer`: one layer's hash of the K and V it was given to store
  (:meth:`otel_swa.device.checksum.RowHasher.of_given`) added to its pool's folds at the slots the
  step writes (:meth:`otel_swa.device.kv_folds.PoolFolds.add`): one kernel per layer, the slots
  (``out_cache_loc``, through the SWA mapping for an SWA layer, clamped as the torch path clamps
  them) computed inside it, the folds added with integer atomics (exact sums: the order the
  programs add in changes no bit). A step costs ``1 + layers`` kernels, and one cast per layer only
  where the given K/V are not in the cache dtype.
* :func:`verify_folds`: a sample's recomputed folds of a pool
  (:meth:`otel_swa.device.kv_folds.PoolFolds.verify`): every layer's rows read through a table of
  the layers' buffer addresses, hashed, folded and compared, one kernel instead of ``2 x layers + 13``
  operations.
* :func:`stage_pool`: a sample's whole verification of one pool
  (``KvProvenance._verify``: the stamps compared, the folds recomputed and compared, the counts and
  the first offenders into the pool's cells) in two kernels instead of about 40 operations and the
  recomputed folds: ``_slots_kernel``, one program per taken slot, into a scratch ``int64 [11, n]``;
  ``_reduce_kernel``, one program, the counts and the first foreign and corrupt slot (the first
  index, 0 when none, as ``torch.max(mask, 0).indices`` gives it).

The write side has fixed shapes, no host read and no allocation: a CUDA graph capture records it.
The arithmetic is the torch code's, ``int64`` operations that never overflow, so the bits are the same.

Where they may differ, outside what any engine gives: the torch path reads every previous stamp
before it writes any, a kernel's programs interleave, so a step that writes a slot whose stamp
another of its tokens reads as its previous position's could differ (no engine writes the slot of a
position before the one it stamps in the same step); several tokens writing one slot in a step (the
padding slot 0) leave the stamp of one of them, which one being the device's choice (as with
torch's ``index_copy_`` on CUDA). Slots are clamped into the tables before every write (the torch
``index_copy_`` raises on an index outside them).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from otel_swa.device.checksum import HASH_PRIME, RowHasher
from otel_swa.device.kv_folds import FOLD_MARK, PoolFolds
from otel_swa.device.provenance_reading import _C, PROVENANCE_CELLS
from otel_swa.device import stamps as _s

__all__ = ["stamp_and_reset", "fold_layer", "verify_folds", "stage_pool"]


@triton.jit
def _hash_chunk(ptr, row_stride, t, start, words, base, BLOCK: tl.constexpr):
    """Sum over the words ``start .. start + BLOCK - 1`` (below ``words``) of row ``t`` of
    ``g_j(w_j)``, ``j = base + word index`` (:mod:`otel_swa.device.checksum`)."""
    i = start + tl.arange(0, BLOCK)
    mask = i < words
    w = tl.load(ptr + t * row_stride + i, mask=mask, other=0).to(tl.int64)
    j = (base + i).to(tl.int64)
    # hash_constants(j): key and odd mult from a fixed integer mix of j
    x = (j * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    mult = ((x * 0x297A2D39) & 0x7FFFFFFF) | 1
    keymult = (x * mult) & 0xFFFFFFFF
    y = (keymult + w * mult) & 0xFFFFFFFF
    y ^= y >> 16
    return tl.sum(tl.where(mask, y, 0), axis=0)


@triton.jit
def _row_hash(k_ptr, k_stride, k_words, v_ptr, v_stride, v_words, row, BLOCK: tl.constexpr):
    """The hash of row ``row``'s K words then V words (:meth:`RowHasher.hash_words`), in ``0 .. Q - 1``."""
    acc = tl.zeros([], dtype=tl.int64)
    for start in range(0, k_words, BLOCK):
        acc += _hash_chunk(k_ptr, k_stride, row, start, k_words, 0, BLOCK)
    for start in range(0, v_words, BLOCK):
        acc += _hash_chunk(v_ptr, v_stride, row, start, v_words, k_words, BLOCK)
    return acc % 1099511627689  # HASH_PRIME


# Integers that follow the batch or the cache are not specialized on (a value of 1 or a multiple of
# 16 would compile another variant), nor the given rows' alignment: one compiled kernel serves every
# batch size, so the warm-up before an engine's first capture compiles all there is.
@triton.jit(do_not_specialize=["k_stride", "v_stride", "map_size", "table_size", "weight"],
            do_not_specialize_on_alignment=["k_ptr", "v_ptr", "loc_ptr"])
def _fold_kernel(k_ptr, k_stride, k_words, v_ptr, v_stride, v_words, loc_ptr, map_ptr, map_size,
                 table_ptr, table_size, weight, SWA: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = _row_hash(k_ptr, k_stride, k_words, v_ptr, v_stride, v_words, t, BLOCK)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    if SWA:
        slot = tl.load(map_ptr + tl.minimum(tl.maximum(slot, 0), map_size - 1)).to(tl.int64)
    slot = tl.minimum(tl.maximum(slot, 0), table_size - 1)
    tl.atomic_add(table_ptr + slot * 2, h, sem="relaxed")
    tl.atomic_add(table_ptr + slot * 2 + 1, h * weight, sem="relaxed")


def fold_layer(table: torch.Tensor, hasher: RowHasher, k: torch.Tensor, v: torch.Tensor, layer_id: int,
               out_cache_loc: torch.Tensor, mapping: "torch.Tensor | None" = None) -> None:
    """Add layer ``layer_id``'s hashes of the given ``k``, ``v`` to the folds ``table`` at the slots
    the step writes: what ``PoolFolds.add`` does with the slots ``KvProvenance`` computes. One kernel
    (and the cast of ``k``/``v`` to the cache dtype where they are not in it).

    Args:
        table: a pool's folds, ``int64 [slots, 2]``, contiguous.
        hasher: the layer's :class:`~otel_swa.device.checksum.RowHasher` (supported).
        k, v: ``[T, ...]`` the layer was given to store (``hasher.given_shape_ok(k, v, T)``).
        layer_id: the layer's id (``f2`` adds ``(layer_id + 1) * h``).
        out_cache_loc: ``int32``/``int64 [T]``, each token's FULL slot.
        mapping: ``full_to_swa_index_mapping`` (``int [num_full_slots]``) for a layer of the SWA pool
            (its slot is ``mapping[out_cache_loc]``), ``None`` for the FULL pool.
    """
    tokens = int(out_cache_loc.shape[0])
    kw, vw = hasher.given_words(k, v, tokens)
    block = min(1024, triton.next_power_of_2(max(int(kw.shape[1]), int(vw.shape[1]), 1)))
    swa = mapping is not None
    _fold_kernel[(tokens,)](
        kw, kw.stride(0), int(kw.shape[1]), vw, vw.stride(0), int(vw.shape[1]), out_cache_loc,
        mapping if swa else out_cache_loc, int(mapping.shape[0]) if swa else 1,
        table, int(table.shape[0]), layer_id + 1, SWA=swa, BLOCK=block)


@triton.jit
def _mix(tok, posm):
    """:func:`otel_swa.device.stamps.mix`."""
    x = tok * 0x9E37F + posm * 0x7F4A7
    x ^= x >> 17
    x &= 0x7FFFFFFF
    x *= 0x5BD1E995
    x ^= x >> 31
    x >>= 11
    return x & 0xFFFFF


@triton.jit(do_not_specialize=["r2t_stride", "r2t_col", "width", "tokens", "batch", "full_size", "swa_size",
                               "map_size"],
            do_not_specialize_on_alignment=["ids_ptr", "pos_ptr", "loc_ptr", "rpi_ptr", "starts_ptr"])
def _stamp_kernel(ids_ptr, pos_ptr, loc_ptr, rpi_ptr, r2t_ptr, r2t_stride, r2t_col, width, starts_ptr, tokens, batch,
                  full_ptr, full_size, swa_ptr, swa_size, map_ptr, map_size, ffold_ptr, sfold_ptr,
                  EXTEND: tl.constexpr, HAS_SWA: tl.constexpr, FOLDS: tl.constexpr, SWA_FOLDS: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if EXTEND:  # program b: request b's tokens, starts[b] .. starts[b + 1] - 1 (the last: .. tokens - 1)
        lo = tl.load(starts_ptr + pid).to(tl.int64)
        hi = tl.load(starts_ptr + tl.minimum(pid + 1, batch - 1)).to(tl.int64)
        hi = tl.where(pid + 1 < batch, hi, tokens)
        row = tl.load(rpi_ptr + pid).to(tl.int64)
        first_pos = tl.load(pos_ptr + tl.minimum(tl.maximum(lo, 0), tokens - 1)).to(tl.int64)
        prev_full = tl.load(r2t_ptr + row * r2t_stride + tl.minimum(tl.maximum(first_pos - 1, 0), width - 1) * r2t_col)
        prev = tl.load(full_ptr + tl.minimum(tl.maximum(prev_full.to(tl.int64), 0), full_size - 1))
        prev = tl.where(first_pos == 0, -2 * 4611686018427387904, prev)  # the anchor: a known chain 0
        carry = tl.zeros([], dtype=tl.int64)
        n_iter = hi - lo
    else:  # a decode batch: token t is request t's only one
        lo = pid * BLOCK
        carry = tl.zeros([], dtype=tl.int64)
        n_iter = BLOCK
    for start in range(0, n_iter, BLOCK):
        t = lo + start + tl.arange(0, BLOCK)
        if EXTEND:
            mask = t < hi
        else:
            mask = t < tokens
        tok = tl.load(ids_ptr + t, mask=mask, other=0).to(tl.int64) & 0xFFFFF
        pos = tl.load(pos_ptr + t, mask=mask, other=0).to(tl.int64)
        posm = pos & 0x3FFFFF
        f = _mix(tok, posm)
        if EXTEND:
            sums = tl.cumsum(tl.where(mask, f, 0), axis=0) + carry
            carry += tl.sum(tl.where(mask, f, 0), axis=0)
            p = prev
        else:
            sums = f
            row = tl.load(rpi_ptr + t, mask=mask, other=0).to(tl.int64)
            prev_full = tl.load(r2t_ptr + row * r2t_stride + tl.minimum(tl.maximum(pos - 1, 0), width - 1) * r2t_col,
                                mask=mask, other=0)
            p = tl.load(full_ptr + tl.minimum(tl.maximum(prev_full.to(tl.int64), 0), full_size - 1),
                        mask=mask, other=0)
            p = tl.where(pos == 0, -2 * 4611686018427387904, p)
        chain = ((p >> 42) + sums) & 0xFFFFF
        code = tl.minimum(p >> 62, -1)
        stamp = posm + tok * 4194304 + chain * 4398046511104 + code * 4611686018427387904
        loc = tl.load(loc_ptr + t, mask=mask, other=0).to(tl.int64)
        full_slot = tl.minimum(tl.maximum(loc, 0), full_size - 1)
        tl.store(full_ptr + full_slot, stamp, mask=mask)
        if FOLDS:
            tl.store(ffold_ptr + full_slot * 2, tl.full([BLOCK], 4611686018427387904, tl.int64), mask=mask)
            tl.store(ffold_ptr + full_slot * 2 + 1, tl.zeros([BLOCK], dtype=tl.int64), mask=mask)
        if HAS_SWA:
            swa_slot = tl.load(map_ptr + tl.minimum(tl.maximum(loc, 0), map_size - 1), mask=mask, other=0)
            swa_slot = tl.minimum(tl.maximum(swa_slot.to(tl.int64), 0), swa_size - 1)
            tl.store(swa_ptr + swa_slot, stamp, mask=mask)
            if SWA_FOLDS:
                tl.store(sfold_ptr + swa_slot * 2, tl.full([BLOCK], 4611686018427387904, tl.int64), mask=mask)
                tl.store(sfold_ptr + swa_slot * 2 + 1, tl.zeros([BLOCK], dtype=tl.int64), mask=mask)


def stamp_and_reset(
    full: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    extend_start_loc: "torch.Tensor | None" = None,
    swa: "torch.Tensor | None" = None,
    mapping: "torch.Tensor | None" = None,
    full_folds: "torch.Tensor | None" = None,
    swa_folds: "torch.Tensor | None" = None,
) -> None:
    """``write_stamps`` of the step into ``full`` (and into ``swa`` at ``mapping[out_cache_loc]``
    when both are given), and the folds ``full_folds`` / ``swa_folds`` (``int64 [slots, 2]``, or
    ``None``) of the written slots reset to ``(FOLD_MARK, 0)``: one kernel.

    Args: as :func:`otel_swa.device.stamps.write_stamps` (``extend_start_loc`` sorted, its first
    entry 0: SGLang's), the stamp tables and the folds contiguous.
    """
    tokens = int(out_cache_loc.shape[0])
    batch = int(req_pool_indices.shape[0])
    if tokens == 0 or batch == 0:
        return
    extend = extend_start_loc is not None
    has_swa = swa is not None and mapping is not None
    block = 128 if not extend else 256
    grid = (batch,) if extend else (triton.cdiv(tokens, block),)
    _stamp_kernel[grid](
        token_ids, positions, out_cache_loc, req_pool_indices, req_to_token, req_to_token.stride(0), req_to_token.stride(1),
        int(req_to_token.shape[1]), extend_start_loc if extend else out_cache_loc, tokens, batch,
        full, int(full.shape[0]), swa if has_swa else full, int(swa.shape[0]) if has_swa else 1,
        mapping if has_swa else out_cache_loc, int(mapping.shape[0]) if has_swa else 1,
        full_folds if full_folds is not None else full, swa_folds if swa_folds is not None else full,
        EXTEND=extend, HAS_SWA=has_swa, FOLDS=full_folds is not None,
        SWA_FOLDS=has_swa and swa_folds is not None, BLOCK=block)


@triton.jit
def _slot_folds(slot, addr_ptr, stride_ptr, weight_ptr, layers, k_words, v_words, WORD: tl.constexpr,
                BLOCK: tl.constexpr):
    """``(f1 - MARK, f2)`` of ``slot`` recomputed from every layer's rows (the address table)."""
    f1 = tl.zeros([], dtype=tl.int64)
    f2 = tl.zeros([], dtype=tl.int64)
    for layer in range(0, layers):
        k_addr = tl.load(addr_ptr + 2 * layer)
        v_addr = tl.load(addr_ptr + 2 * layer + 1)
        if WORD == 4:
            k_ptr = k_addr.to(tl.pointer_type(tl.int32))
            v_ptr = v_addr.to(tl.pointer_type(tl.int32))
        elif WORD == 2:
            k_ptr = k_addr.to(tl.pointer_type(tl.int16))
            v_ptr = v_addr.to(tl.pointer_type(tl.int16))
        else:
            k_ptr = k_addr.to(tl.pointer_type(tl.uint8))
            v_ptr = v_addr.to(tl.pointer_type(tl.uint8))
        h = _row_hash(k_ptr, tl.load(stride_ptr + 2 * layer), k_words, v_ptr, tl.load(stride_ptr + 2 * layer + 1),
                      v_words, slot, BLOCK)
        f1 += h
        f2 += h * tl.load(weight_ptr + layer)
    return f1, f2


@triton.jit(do_not_specialize=["layers"], do_not_specialize_on_alignment=["slots_ptr"])
def _verify_kernel(slots_ptr, table_ptr, addr_ptr, stride_ptr, weight_ptr, layers, k_words, v_words,
                   written_ptr, delta_ptr, WORD: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    f1, f2 = _slot_folds(slot, addr_ptr, stride_ptr, weight_ptr, layers, k_words, v_words, WORD, BLOCK)
    stored1 = tl.load(table_ptr + slot * 2)
    stored2 = tl.load(table_ptr + slot * 2 + 1)
    tl.store(written_ptr + n, stored1 != 0)
    tl.store(delta_ptr + n * 2, f1 - stored1 + 4611686018427387904)  # FOLD_MARK
    tl.store(delta_ptr + n * 2 + 1, f2 - stored2)


class _LayerTable(NamedTuple):
    key: tuple  # what the table was made from: each layer's id and buffers
    hasher: RowHasher
    addresses: torch.Tensor  # int64 [2 x layers]: the word rows' addresses, K then V per layer
    strides: torch.Tensor  # int64 [2 x layers]: their row strides in words
    weights: torch.Tensor  # int64 [layers]: layer id + 1


_TABLES: "weakref.WeakKeyDictionary[PoolFolds, _LayerTable]" = weakref.WeakKeyDictionary()


def _layer_table(folds: PoolFolds) -> "_LayerTable | None":
    """The table of the pool's layer buffers the verify kernel reads (made again when a layer or its
    buffers change), or ``None`` when the layers have several layouts or rows no word view reads."""
    entries = sorted(folds.layers.values())
    key = tuple((e.layer_id, e.k_buffer.data_ptr(), e.v_buffer.data_ptr(), e.k_buffer.shape, e.v_buffer.shape)
                for e in entries)
    known = _TABLES.get(folds)
    if known is not None and known.key == key:
        return known
    if not entries or len({e.hasher.layout for e in entries}) != 1:
        return None
    hasher = entries[0].hasher
    words = [hasher.word_rows(buffer, k) for e in entries for k, buffer in ((True, e.k_buffer), (False, e.v_buffer))]
    if not all(w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
               for w, b in zip(words, (b for e in entries for b in (e.k_buffer, e.v_buffer)))):
        return None  # a copy would go stale: the torch path gathers from the buffers themselves
    device = folds.table.device
    table = _LayerTable(key, hasher, torch.tensor([w.data_ptr() for w in words], dtype=torch.int64, device=device),
                        torch.tensor([w.stride(0) for w in words], dtype=torch.int64, device=device),
                        torch.tensor([e.layer_id + 1 for e in entries], dtype=torch.int64, device=device))
    _TABLES[folds] = table
    return table


def verify_folds(folds: PoolFolds, slots: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """:meth:`PoolFolds.verify <otel_swa.device.kv_folds.PoolFolds.verify>` in one kernel: every
    layer's K and V rows at ``slots`` (``int64 [n]``, inside the table) read through a table of the
    layers' buffer addresses, hashed, folded and compared with the written folds. Returns the same
    ``(written bool [n], delta int64 [n, 2])``, or ``None`` where the kernel does not apply (no
    layer folded, layers of several layouts, buffers whose rows no word view reads): the caller then
    runs ``folds.verify``. Host work: the address table, made once per set of layer buffers."""
    table = _layer_table(folds)
    if table is None:
        return None
    n = int(slots.shape[0])
    written = torch.empty(n, dtype=torch.bool, device=folds.table.device)
    delta = torch.empty((n, 2), dtype=torch.int64, device=folds.table.device)
    if n:
        hasher = table.hasher
        k_words = hasher.k_take * hasher.dtype.itemsize // hasher.word
        v_words = hasher.v_take * hasher.dtype.itemsize // hasher.word
        block = min(1024, triton.next_power_of_2(max(k_words, v_words, 1)))
        _verify_kernel[(n,)](slots, folds.table, table.addresses, table.strides, table.weights,
                             int(table.weights.shape[0]), k_words, v_words, written, delta,
                             WORD=hasher.word, BLOCK=block)
    return written, delta




@triton.jit(do_not_specialize=["n", "up_stride", "rows_size", "r2t_stride", "r2t_col", "width", "map_size",
                               "stamps_size", "layers"])
def _slots_kernel(up_ptr, up_stride, n, rpi_ptr, rows_size, r2t_ptr, r2t_stride, r2t_col, width, map_ptr, map_size,
                  stamps_ptr, stamps_size, table_ptr, addr_ptr, stride_ptr, weight_ptr, layers, k_words, v_words,
                  scratch_ptr, SWA_POOL: tl.constexpr, SWA_NAMED: tl.constexpr, JUDGE_UNSTAMPED: tl.constexpr,
                  FOLDS: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    entry = tl.load(up_ptr + i)
    position = tl.load(up_ptr + up_stride + i)
    expected = tl.load(up_ptr + 2 * up_stride + i)
    row = tl.load(rpi_ptr + entry).to(tl.int64)
    row = tl.minimum(tl.maximum(row, 0), rows_size - 1)
    full = tl.load(r2t_ptr + row * r2t_stride + tl.minimum(tl.maximum(position, 0), width - 1) * r2t_col)
    full = full.to(tl.int64)
    swa_slot = tl.load(map_ptr + tl.minimum(tl.maximum(full, 0), map_size - 1)).to(tl.int64)
    if SWA_POOL:
        live = swa_slot != 0
        slot = tl.minimum(tl.maximum(swa_slot, 0), stamps_size - 1)
    else:
        live = full == full
        slot = tl.minimum(tl.maximum(full, 0), stamps_size - 1)
    found = tl.load(stamps_ptr + slot)
    judged = (expected != 0) & live
    if JUDGE_UNSTAMPED == 0:
        judged = judged & (found != 0)
    compare = tl.where((found >> 62) == -1, 4398046511103, -1)  # TOKEN_POSITION_MASK where the chain is unknown
    foreign = (((found ^ expected) & compare) != 0) & judged
    if SWA_NAMED:
        named = swa_slot
    else:
        named = swa_slot * 0 - 1
    base = scratch_ptr + i
    tl.store(base + 0 * n, live.to(tl.int64))
    tl.store(base + 1 * n, judged.to(tl.int64))
    tl.store(base + 2 * n, foreign.to(tl.int64))
    tl.store(base + 5 * n, row)
    tl.store(base + 6 * n, found)
    tl.store(base + 7 * n, full)
    tl.store(base + 8 * n, named)
    if FOLDS:
        f1, f2 = _slot_folds(slot, addr_ptr, stride_ptr, weight_ptr, layers, k_words, v_words, WORD, BLOCK)
        stored1 = tl.load(table_ptr + slot * 2)
        stored2 = tl.load(table_ptr + slot * 2 + 1)
        d1 = f1 - stored1 + 4611686018427387904  # FOLD_MARK
        d2 = f2 - stored2
        checked = (stored1 != 0) & live
        tl.store(base + 3 * n, checked.to(tl.int64))
        tl.store(base + 4 * n, (((d1 != 0) | (d2 != 0)) & checked).to(tl.int64))
        tl.store(base + 9 * n, d1)
        tl.store(base + 10 * n, d2)


@triton.jit
def _first(scratch_ptr, n, flag_row, BLOCK: tl.constexpr):
    """The count of the flags in scratch row ``flag_row`` and the first index holding one (0: none)."""
    count = tl.zeros([], dtype=tl.int64)
    first = tl.full([], 9223372036854775807, tl.int64)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK).to(tl.int64)
        flag = tl.load(scratch_ptr + flag_row * n + i, mask=i < n, other=0)
        count += tl.sum(flag, axis=0)
        first = tl.minimum(first, tl.min(tl.where(flag != 0, i, 9223372036854775807), axis=0))
    return count, tl.where(count > 0, first, 0)


@triton.jit(do_not_specialize=["n"])
def _reduce_kernel(scratch_ptr, n, out_ptr, SWA_POOL: tl.constexpr, FOLDS: tl.constexpr,
                   C_D1: tl.constexpr, BLOCK: tl.constexpr):
    live, _ = _first(scratch_ptr, n, 0, BLOCK)
    judged, _ = _first(scratch_ptr, n, 1, BLOCK)
    foreign, at = _first(scratch_ptr, n, 2, BLOCK)
    if SWA_POOL:
        tl.store(out_ptr + 0, live)
    else:
        tl.store(out_ptr + 0, live * 0)
    tl.store(out_ptr + 1, judged)
    tl.store(out_ptr + 2, foreign)
    tl.store(out_ptr + 3, at)
    for cell in tl.static_range(4):  # the first foreign's row, stamp, FULL and SWA slot: scratch rows 5-8
        tl.store(out_ptr + 4 + cell, tl.load(scratch_ptr + (5 + cell) * n + at))
    if FOLDS:
        checked, _ = _first(scratch_ptr, n, 3, BLOCK)
        corrupt, at_c = _first(scratch_ptr, n, 4, BLOCK)
        tl.store(out_ptr + 8, checked)
        tl.store(out_ptr + 9, corrupt)
        tl.store(out_ptr + 10, at_c)
        tl.store(out_ptr + 11, tl.load(scratch_ptr + 5 * n + at_c))
        for cell in tl.static_range(2):  # its FULL and SWA slot (scratch rows 7-8), d1 and d2 (rows 9-10)
            tl.store(out_ptr + 12 + cell, tl.load(scratch_ptr + (7 + cell) * n + at_c))
            tl.store(out_ptr + C_D1 + cell, tl.load(scratch_ptr + (9 + cell) * n + at_c))
    else:
        zero = live * 0
        for cell in tl.static_range(8, 14):
            tl.store(out_ptr + cell, zero)


def stage_pool(provenance: Any, out: torch.Tensor, up: torch.Tensor, pool: int, view: Any,
               mapping: torch.Tensor) -> bool:
    """``KvProvenance._verify`` of ``pool`` in two kernels (module docstring): the same cells of ``out`` (``int64
    [PROVENANCE_CELLS]``, zeroed before; ``up``: ``int64 [3, n]``, entry, position and expected stamp of
    each taken slot, ``n >= 1``). Returns ``False``, staging nothing, where the kernels do not apply
    (the pool's folded layers of several layouts, buffers whose rows no word view reads): the caller
    then runs the torch path."""
    folds = provenance.folds[pool]
    table = _layer_table(folds) if folds is not None and folds.layers else None
    if folds is not None and folds.layers and table is None:
        return False
    if up.stride(1) != 1 or out.stride(0) != 1:
        return False
    n = int(up.shape[1])
    stamps = provenance.stamps[pool]
    r2t = view.req_to_token
    rows = view.req_pool_indices
    scratch = torch.empty((11, n), dtype=torch.int64, device=out.device)
    hashed = table is not None
    hasher = table.hasher if hashed else None
    k_words = hasher.k_take * hasher.dtype.itemsize // hasher.word if hashed else 0
    v_words = hasher.v_take * hasher.dtype.itemsize // hasher.word if hashed else 0
    block = min(1024, triton.next_power_of_2(max(k_words, v_words, 1)))
    dummy = stamps
    _slots_kernel[(n,)](
        up, up.stride(0), n, rows, int(r2t.shape[0]), r2t, r2t.stride(0), r2t.stride(1), int(r2t.shape[1]),
        mapping, int(mapping.shape[0]), stamps, int(stamps.shape[0]),
        folds.table if hashed else dummy, table.addresses if hashed else dummy,
        table.strides if hashed else dummy, table.weights if hashed else dummy,
        int(table.weights.shape[0]) if hashed else 0, k_words, v_words, scratch,
        SWA_POOL=pool == 1, SWA_NAMED=provenance.stamps[1] is not None,
        JUDGE_UNSTAMPED=provenance.never_stamped == "foreign", FOLDS=hashed,
        WORD=hasher.word if hashed else 4, BLOCK=block)
    _reduce_kernel[(1,)](scratch, n, out, SWA_POOL=pool == 1, FOLDS=hashed, C_D1=_C["corrupt_d1"], BLOCK=1024)
    return True


# the constants spelled out in the kernels, checked against the torch code they copy at import
assert HASH_PRIME == 1099511627689 and FOLD_MARK == 4611686018427387904 == 1 << 62
assert (_s._A, _s._B, _s._C, _s.CHAIN_MASK, _s.POSITION_MASK, _s.TOKEN_MASK) == (
    0x9E37F, 0x7F4A7, 0x5BD1E995, 0xFFFFF, 0x3FFFFF, 0xFFFFF)
assert (_s._TOKEN_SHIFT, _s._CHAIN_SHIFT, _s._CODE_SHIFT, _s._ANCHOR) == (22, 42, 62, -2 * (1 << 62))
assert _s.TOKEN_POSITION_MASK == 4398046511103
assert PROVENANCE_CELLS[:14] == (
    "live", "stamp_checks", "foreign", "foreign_index", "foreign_row", "foreign_stamp", "foreign_full_slot",
    "foreign_swa_slot", "checksum_checks", "corrupt", "corrupt_index", "corrupt_row", "corrupt_full_slot",
    "corrupt_swa_slot")
