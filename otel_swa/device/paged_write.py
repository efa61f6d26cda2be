"""The write check over a paged KV cache (vLLM's): slot -> (block, offset) -> the cache's rows.

vLLM keeps one KV cache tensor per attention layer whose logical shape (the FlashAttention
backend's ``get_kv_cache_shape``, vLLM's ``vllm/v1/attention/backends/flash_attn.py``, as read in
the stored source of vllm-project/vllm; not yet confirmed for 0.33) is
``[2, num_blocks, block_size, num_kv_heads, head_size]``, K at index 0 and V at index 1; a step's
token ``i`` is stored at ``slot_mapping[i] = block_id * block_size + offset`` (``-1``: padding, not
stored). This module turns such a cache into the slot-indexed buffers of
:class:`~otel_swa.device.write_check.LayerStore`, so :class:`~otel_swa.device.write_check.WriteCheck`
compares the write unchanged. torch only, fixed shapes, no host read.
"""

from __future__ import annotations

import torch

from otel_swa.device.write_check import LayerStore

__all__ = ["paged_layer_store"]


def paged_layer_store(layer_id: int, swa: bool, k: "torch.Tensor | None", v: "torch.Tensor | None",
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      positions: "torch.Tensor | None" = None) -> LayerStore:
    """A :class:`~otel_swa.device.write_check.LayerStore` for one vLLM attention layer.

    Args:
        layer_id: the layer's index, recorded with a mismatch.
        swa: the layer belongs to a sliding-window KV cache group. vLLM's slot mapping is already
            the group's own, so no further mapping applies; the store is passed as the FULL kind
            (``WriteCheck`` needs an SWA mapping for the SWA kind), so the offender's ``pool``
            reads ``"full"`` for either group (not yet separated).
        k, v: ``[T, num_kv_heads, head_size]`` (or ``[T, num_kv_heads * head_size]``) given to the
            layer's store, on the cache's device; ``None``: counted unchecked.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (any strides).
        slot_mapping: ``int32``/``int64 [T]``, ``block_id * block_size + offset``; ``-1`` padding.
        positions: ``int [T]`` or ``None``.

    Returns:
        The store, with ``k_buffer``/``v_buffer`` ``[num_blocks * block_size, num_kv_heads,
        head_size]`` (views when the block and offset dimensions are contiguous with each other,
        else copies) and ``out_cache_loc`` the slot mapping with padding as 0. Slot 0 lies in
        block 0, which vLLM's block pool keeps as its null block, so it never holds a real token.

    Raises:
        ValueError: ``kv_cache`` not of 5 dimensions with 2 in the first.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, heads, head_size], got {tuple(kv_cache.shape)}")
    k_buffer = kv_cache[0].flatten(0, 1)
    v_buffer = kv_cache[1].flatten(0, 1)
    loc = slot_mapping.clamp(min=0)
    return LayerStore(layer_id, False, k, v, k_buffer, v_buffer, loc, None, positions, None)
