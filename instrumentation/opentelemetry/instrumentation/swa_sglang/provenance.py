"""The KV's provenance in an SGLang model runner (:mod:`otel_swa.device.provenance`): switching it
on for the runner's KV pool, giving its attention layers the wiring, stamping the slots a forward
step writes and, after each layer, the checksum write and write check; and the CUDA graphs captured
before the runner was wired (their replays hold none of the checks)."""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.instrumentation.swa_sglang.attributes import PROVENANCE_ATTRIBUTE
from opentelemetry.instrumentation.swa_sglang.hicache import follow_host_tier, hicache_storage
from opentelemetry.instrumentation.swa_sglang.process import configured

_log = logging.getLogger(__package__)  # the instrumentor's logger (opentelemetry.instrumentation.swa_sglang)


def _enable_provenance(reporter: Any, runner: Any, *, late: bool = False) -> "tuple[Any, dict] | None":
    """Switch ``reporter``'s provenance on for ``runner``'s KV pool as ``OTEL_SWA_PROVENANCE`` (the
    checksum's coverage) and ``OTEL_SWA_PROVENANCE_BUDGET`` say:
    ``(provenance, layout)`` (:func:`otel_swa.views.sglang.provenance_layout`), or ``None``, logged
    with the reason: off, a pool it cannot read, speculative decoding (a target-verify step writes
    the K/V of draft tokens that are later rejected, which the stamps do not follow), KV filled
    without a forward step (:func:`otel_swa.views.sglang.kv_filled_outside_forward`: LMCache,
    disaggregation move bytes, not stamps), or a ``late`` runner whose graphs were captured without
    the stamps (their replays would write KV under stale stamps). A ``late`` runner without graphs
    gets provenance whose never-stamped slots are counted unchecked (its cache may hold KV written
    before it was wired). With HiCache on (``enable_hierarchical_cache``) the stamps and checksums
    follow the KV to the host pools and back (:mod:`~opentelemetry.instrumentation.swa_sglang.hicache`);
    with an L3 storage backend beside it, slots loaded from storage are counted unchecked."""
    from otel_swa import config
    from otel_swa.views.sglang import kv_filled_outside_forward, provenance_layout

    settings = configured(config.provenance)  # unusable: logged when the attention layers were (not) wrapped
    if settings is None:
        return None
    speculative = getattr(runner, "spec_algorithm", None)
    if speculative is not None and not speculative.is_none():
        _log.info("KV provenance is off for a model runner with speculative decoding")
        return None
    moved = kv_filled_outside_forward(runner)
    if moved is not None:
        _log.info("KV provenance is off: %s without a forward step, and the stamps do not follow it", moved)
        return None
    if late and _captured_graphs(runner):
        _log.info("KV provenance is off: this model runner's graphs were captured before otel-swa was wired, "
                  "and their replays write KV without stamps")
        return None
    layout = provenance_layout(getattr(runner, "token_to_kv_pool", None))
    if layout is None:
        _log.info("KV provenance is off: the model runner's KV pool is not an SWAKVPool of K/V buffers")
        return None
    hicache = bool(getattr(getattr(runner, "server_args", None), "enable_hierarchical_cache", False))
    storage = hicache_storage(runner) if hicache else None
    if storage is not None:
        _log.info("KV provenance: HiCache's L3 storage (%s) fills host slots that no table follows; "
                  "slots loaded from it are counted unchecked", storage)
    try:
        provenance = reporter.enable_provenance(full_slots=layout["full_slots"], swa_slots=layout["swa_slots"],
                                                checksum=settings[0], budget=settings[1],
                                                checksum_layers=layout["checksum_layers"],
                                                checksum_order=layout["checksum_order"],
                                                never_stamped="unchecked" if late or storage else "foreign")
        if hicache:
            layout = {**layout, "host_tier": follow_host_tier(provenance, runner.token_to_kv_pool)}
    except Exception:
        _log.exception("KV provenance is off for this model runner")
        return None
    return provenance, layout


def _captured_graphs(runner: Any) -> list:
    """``runner``'s graph runners that replay captured forwards (sglang 0.5.23
    ``ModelRunner.decode_cuda_graph_runner``, and ``prefill_cuda_graph_runner`` unless it is the
    ``EagerRunner``); empty before ``init_cuda_graphs`` or without graphs."""
    found = []
    for name in ("decode_cuda_graph_runner", "prefill_cuda_graph_runner"):
        graphs = getattr(runner, name, None)
        if graphs is not None and type(graphs).__name__ != "EagerRunner" and callable(getattr(graphs, "can_run_graph", None)):
            found.append(graphs)
    return found


def _graphs_without_checks(runner: Any, reporter: Any) -> bool:
    """For a runner wired after its graphs were captured (their forwards hold none of otel-swa's
    checks): make each graph runner's ``can_run_graph`` answer False at sampling steps (the host
    decision :meth:`~otel_swa.reporter.SwaDivergenceReporter.before_forward` set, ``reporter.gate.due``),
    so that a sampled step runs eagerly, checked as any eager step, and every other step replays as
    before. SGLang's ``ModelRunner._forward_raw`` asks ``can_run_graph`` of both graph runners
    before each forward and runs the eager forward when they answer False (as for a batch larger than
    any captured one). Returns whether any graph runner was found."""
    graphs = _captured_graphs(runner)
    gate = reporter.gate
    for runner_of_graphs in graphs:
        original = runner_of_graphs.can_run_graph

        def can_run_graph(forward_batch, *args, _original=original, **kwargs):
            if gate.due:
                return False
            return _original(forward_batch, *args, **kwargs)

        runner_of_graphs.can_run_graph = can_run_graph  # this instance only; SGLang's class is untouched
    return bool(graphs)


def _attach_provenance(runner: Any, wired: Any) -> None:
    """Give each attention layer (``RadixAttention``) of ``runner``'s model the provenance wiring."""
    import sys

    module = sys.modules.get("sglang.srt.layers.radix_attention")
    attention = getattr(module, "RadixAttention", None)
    model = getattr(runner, "model", None)
    if attention is None or model is None:
        return
    for layer in model.modules():
        if isinstance(layer, attention):
            layer.__dict__[PROVENANCE_ATTRIBUTE] = wired


def _writes_kv(forward_batch: Any) -> bool:
    """Whether the step writes the K/V of its tokens as the stamps follow them: decode, extend and
    mixed batches (not idle, speculative verify or draft steps)."""
    mode = forward_batch.forward_mode
    if mode.is_idle() or getattr(mode, "is_target_verify", lambda: False)():
        return False
    return bool(mode.is_decode() or mode.is_extend())


def _stamp(wired: Any, forward_batch: Any) -> None:
    """Stamp the slots this forward step writes (once per step, before its first attention layer);
    ``wired.writing`` keeps the step's ``out_cache_loc`` when it writes KV, so that its layers do
    not ask the forward mode again."""
    loc = forward_batch.out_cache_loc
    wired.writing = loc if loc is not None and _writes_kv(forward_batch) else None
    if wired.writing is None:
        return
    extend = None if forward_batch.forward_mode.is_decode() else forward_batch.extend_start_loc
    wired.provenance.stamp(
        input_ids=forward_batch.input_ids, positions=forward_batch.positions, out_cache_loc=forward_batch.out_cache_loc,
        req_pool_indices=forward_batch.req_pool_indices, req_to_token=wired.req_to_token_pool.req_to_token,
        full_to_swa_index_mapping=wired.allocator.full_to_swa_index_mapping, extend_start_loc=extend,
    )


def _after_layer(wired: Any, layer: Any, k: Any, v: Any, forward_batch: Any, args: tuple, kwargs: dict) -> None:
    """One attention layer's checksum write and write check, after it stored this step's K/V."""
    save_kv_cache = args[0] if args else kwargs.get("save_kv_cache", True)
    loc = forward_batch.out_cache_loc
    if (k is None or v is None or not save_kv_cache or loc is None or getattr(layer, "is_cross_attention", False)
            or (loc is not getattr(wired, "writing", None) and not _writes_kv(forward_batch))):
        return  # (the step's stamp call said it writes these slots, or the forward mode says so now)
    layer_id = int(layer.layer_id)
    swa = layer_id in wired.layout["swa_layers"]
    if not wired.provenance.wants_layer(layer_id, swa):
        return  # not its pool's checksum layer, and no write check on it this step
    pool = wired.kv_pool
    wired.provenance.after_layer(
        layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=pool.get_key_buffer(layer_id),
        v_buffer=pool.get_value_buffer(layer_id), out_cache_loc=loc,
        full_to_swa_index_mapping=wired.allocator.full_to_swa_index_mapping if swa else None,
        positions=forward_batch.positions,
        extend_start_loc=None if forward_batch.forward_mode.is_decode() else forward_batch.extend_start_loc,
    )
