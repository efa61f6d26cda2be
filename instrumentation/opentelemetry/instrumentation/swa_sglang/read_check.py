"""The read check of SGLang's sliding-window attention layers (:mod:`otel_swa.device.read_check`):
switching it on for a model runner's reporter, and checking one ``RadixAttention`` call at a
sampled step (the package docstring says what is checked and what is counted unchecked)."""

from __future__ import annotations

from typing import Any

from opentelemetry.instrumentation.swa_sglang.process import configured


def _enable_read_check(reporter: Any) -> Any:
    """Switch ``reporter``'s read check on as ``OTEL_SWA_READ_CHECK`` says; the check, or ``None``."""
    from otel_swa import config

    mode = configured(config.read_check)  # unusable: logged when the attention layers were (not) wrapped
    if mode is None:
        return None
    return reporter.enable_read_check(max_queries=mode[1], layers=mode[0])


def _check_read(wiring: Any, layer: Any, q: Any, output: Any, forward_batch: Any, kwargs: dict) -> None:
    """The read check of one ``RadixAttention`` call at a sampled step (module docstring)."""
    window = getattr(layer, "sliding_window_size", -1)
    if window is None or window < 0:
        return  # a full-attention layer: not a sliding-window read
    check = wiring.read_check
    layer_id = int(layer.layer_id)
    if not check.wants(layer_id):
        return
    batch = int(forward_batch.req_pool_indices.shape[0])
    mode = forward_batch.forward_mode
    decode = mode.is_decode()
    attn_type = getattr(getattr(layer, "attn_type", None), "value", "decoder")
    variant_ok = (
        (decode or mode.is_extend()) and not getattr(mode, "is_target_verify", lambda: False)()
        and not getattr(mode, "is_draft_extend", lambda: False)() and not getattr(layer, "is_cross_attention", False)
        and attn_type == "decoder" and (not layer.logit_cap or getattr(layer, "logit_capping_method", "tanh") == "tanh")
    )
    if not variant_ok:
        check.unchecked(min(check.max_queries, batch))
        return
    out = output[0] if isinstance(output, tuple) else output
    pool = wiring.kv_pool  # the model runner's token_to_kv_pool (SWAKVPool for a hybrid model)
    mapping_of = getattr(pool, "layers_mapping", None)
    is_swa = bool(mapping_of[layer_id][1]) if mapping_of is not None and layer_id in mapping_of else False
    query_rows = None
    if not decode:
        query_rows = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
    check.check_layer(
        layer_id=layer_id, q=q, out=out, k_buffer=pool.get_key_buffer(layer_id), v_buffer=pool.get_value_buffer(layer_id),
        req_to_token=wiring.req_to_token_pool.req_to_token,
        full_to_swa_index_mapping=wiring.allocator.full_to_swa_index_mapping if is_swa else None,
        req_pool_indices=forward_batch.req_pool_indices, seq_lens=forward_batch.seq_lens, query_rows=query_rows,
        window=int(window) + 1, scaling=float(layer.scaling), num_q_heads=int(layer.tp_q_head_num),
        logit_cap=float(layer.logit_cap or 0.0), sinks=kwargs.get("sinks"),
    )
