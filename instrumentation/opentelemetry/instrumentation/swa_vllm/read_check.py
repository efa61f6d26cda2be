"""The read check of vLLM's sliding-window attention layers (:mod:`otel_swa.device.read_check`), wired
with the write check (:mod:`opentelemetry.instrumentation.swa_vllm.write_check`: same runner, same
gate, attached to the scheduler's reporter the same way).

Where it is wired (a runner with the write check, ``OTEL_SWA_READ_CHECK`` not ``off``), the
implementation classes' ``forward`` of the layers that carry a write layer is wrapped as
``do_kv_cache_update`` is (vLLM 0.32.0 ``CPUAttentionBackendImpl.forward(self, layer, query, key,
value, kv_cache, attn_metadata, output, ...)``, ``vllm/v1/attention/backends/cpu_attn.py``; vLLM
calls the store first, ``forward_includes_kv_cache_update = False``). After the original returns,
at a sampled step, for a layer of a sliding-window group whose turn it is (``layers="rotate"``): a
few queries (each request's last token of the step) recomputed from the layer's KV cache through
the attention metadata's block table (``CPUAttentionMetadata.block_table``, ``seq_lens``,
``query_start_loc``: the group's own, rows in the batch's order) and compared with the layer's
output. The window is the implementation's ``sliding_window`` (keys a query reads, its own
included), the scale ``impl.scale``, the soft cap ``impl.logits_soft_cap``, the sinks
``impl.sinks``. An exception there is logged once per runner and never reaches the forward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["runner_read_check", "check_read", "wrap_forward"]


def runner_read_check(device: Any, gate: Any) -> Any:
    """The runner's :class:`~otel_swa.device.read_check.ReadCheck` (``OTEL_SWA_READ_CHECK``'s layers
    and queries, the write check's gate), or ``None`` where the setting is ``off`` or unusable."""
    from otel_swa import config
    from otel_swa.device.read_check import ReadCheck

    try:
        mode = config.read_check()
    except Exception:
        return None
    if mode is None:
        return None
    layers, queries = mode
    return ReadCheck(device, max_queries=queries, layers=layers, gate=gate)


def check_read(read: Any, write_layer: Any, impl: Any, query: Any, kv_cache: Any, metadata: Any, output: Any) -> None:
    """The read check of one sliding-window layer's ``forward`` (module docstring)."""
    import torch

    from otel_swa.device.paged_provenance import BlockSlots, PagedRows
    from otel_swa.device.paged_write import cpu_attn_kv_views, paged_kv_views
    from otel_swa.views.vllm_write import CPU_ATTN_LAYOUTS, impl_quantized

    if not read.wants(write_layer.layer_id):
        return
    seq_lens = metadata.seq_lens
    batch = int(seq_lens.shape[0])
    layout = "flash"
    if type(impl).__name__ == "CPUAttentionBackendImpl":
        layout = CPU_ATTN_LAYOUTS.get(getattr(write_layer.layer, "isa", None))
    window = int(getattr(impl, "sliding_window", -1) or -1)
    if (layout is None or window < 1 or impl_quantized(impl) or getattr(metadata, "block_table", None) is None
            or not getattr(metadata, "causal", True)):
        read.unchecked(min(read.max_queries, batch))
        return
    views = cpu_attn_kv_views if layout == "cpu_attn_vec" else paged_kv_views
    key_cache, value_cache = views(kv_cache, int(impl.head_size))
    tokens = int(metadata.num_actual_tokens)
    read.check_layer(
        layer_id=write_layer.layer_id, q=query[:tokens], out=output[:tokens], k_buffer=PagedRows(key_cache),
        v_buffer=PagedRows(value_cache), req_to_token=BlockSlots(metadata.block_table[:batch], int(key_cache.shape[1])),
        full_to_swa_index_mapping=None, req_pool_indices=torch.arange(batch, device=seq_lens.device),
        seq_lens=seq_lens, query_rows=metadata.query_start_loc[1:batch + 1].long() - 1, window=window,
        scaling=float(impl.scale), num_q_heads=int(impl.num_heads), logit_cap=float(impl.logits_soft_cap or 0.0),
        sinks=getattr(impl, "sinks", None))


def wrap_forward(original: Callable, attribute: str) -> Callable:
    """The wrapper of an implementation's ``forward`` (module docstring); ``attribute``: the
    ``Attention`` module's attribute holding ``(RunnerWriteCheck, WriteLayer)``."""

    @functools.wraps(original)
    def forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        carried = getattr(layer, "__dict__", {}).get(attribute)
        if carried is not None and attn_metadata is not None:
            wired, write_layer = carried
            read = wired.read
            if read is not None and write_layer.swa and wired.gate.wanted():
                try:
                    check_read(read, write_layer, impl, query, kv_cache, attn_metadata, result)
                except Exception:  # otel-swa's part never breaks the forward
                    wired.failed(f"the read check failed at layer {write_layer.name}")
        return result

    forward._otel_swa_forward = True
    return forward
