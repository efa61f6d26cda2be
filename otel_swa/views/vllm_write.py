"""What the write check reads from vLLM 0.33's model runner: its attention layers, their KV cache
groups, each ``do_kv_cache_update`` call's store, and the batch the checked step ran.

The device side is :mod:`otel_swa.device.paged_write` (the layout, with its sources in vLLM's
code); where these are hooked is ``opentelemetry.instrumentation.swa_vllm.write_check``. Nothing
here imports vLLM: the structures are reached through the attributes named below, read in vLLM
0.33.0's installed source.

* the KV cache groups: ``GPUModelRunner.kv_cache_config.kv_cache_groups`` (both runners set it in
  ``initialize_kv_cache``: ``vllm/v1/worker/gpu_model_runner.py`` line 7007, ``vllm/v1/worker/gpu/
  model_runner.py`` line 632), each with ``layer_names`` and ``kv_cache_spec``
  (``SlidingWindowSpec`` / ``ChunkedLocalAttentionSpec`` / ``FullAttentionSpec``,
  ``vllm/v1/kv_cache_interface.py`` lines 901, 861, 619; ``UniformTypeKVCacheSpecs.first_spec``
  for a group of several);
* the layers: ``vllm_config.compilation_config.static_forward_context[layer_name]``, the
  ``Attention`` modules (``layer.layer_name``, ``layer.impl``);
* the backends whose store is understood (:data:`SUPPORTED_IMPLS`): ``FlashAttentionImpl``,
  ``TritonAttentionImpl``, ``FlashInferImpl``, and on CPU ``CPUAttentionBackendImpl`` (CPU_ATTN, vLLM
  0.32.0's CPU build, whose layout depends on the instruction set vLLM picked, ``layer.isa``:
  :data:`CPU_ATTN_LAYOUTS`, the others counted unchecked); quantized caches (``impl.kv_cache_dtype`` other than
  a float type, Triton's ``_is_per_token_head_quant``, FlashInfer's ``is_kvcache_nvfp4`` /
  ``nvfp4_fa2``) are counted unchecked;
* per call: ``vllm.forward_context.get_forward_context().attn_metadata[layer_name]
  .query_start_loc`` (FlashAttention's, Triton's and CPU_ATTN's metadata: ``int32 [B + 1]``; FlashInfer's has
  none, its offender's entry is then the token index) and the runner's positions buffer
  (V1: ``GPUModelRunner.positions``, line 778; V2: ``input_buffers.positions``,
  ``vllm/v1/worker/gpu/input_batch.py`` line 30);
* the batch after ``execute_model`` returned: V1 ``input_batch.req_ids`` (``vllm/v1/worker/
  gpu_input_batch.py`` line 315), V2 ``execute_model_state.input_batch.req_ids`` (kept until
  ``sample_tokens``), in the order the attention metadata's rows follow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from otel_swa.device.paged_write import paged_layer_store, unchecked_store
from otel_swa.device.write_check import LayerStore

__all__ = ["SUPPORTED_IMPLS", "CPU_ATTN_LAYOUTS", "WriteLayer", "write_layers", "layer_store", "runner_request_ids", "runner_positions",
           "impl_quantized"]

#: ``(module, class)`` of the attention implementations whose ``do_kv_cache_update`` stores with
#: the layout of :mod:`otel_swa.device.paged_write` (vLLM 0.33.0).
SUPPORTED_IMPLS = (
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl"),
    ("vllm.v1.attention.backends.flashinfer", "FlashInferImpl"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
)
#: CPU_ATTN's instruction sets (the ``Attention`` module's ``isa``, set by its metadata builder) whose
#: store layout is known (:data:`otel_swa.device.paged_write.LAYOUTS`); the others are unchecked.
CPU_ATTN_LAYOUTS = {"vec": "cpu_attn_vec", "vec16": "cpu_attn_vec"}
_CPU_ATTN = "CPUAttentionBackendImpl"
#: The implementations whose attention metadata has no ``query_start_loc`` (the offender's batch row
#: and request are then not named).
_NO_ROWS = ("FlashInferImpl",)
#: KV cache spec classes whose groups are of the sliding-window kind (the others named here: full).
_WINDOW_SPECS = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec")
_FULL_SPECS = ("FullAttentionSpec",)
_FLOAT_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "half", "float")


@dataclass(frozen=True)
class WriteLayer:
    """One attention layer the write check may check.

    Attributes:
        name: vLLM's layer name (``model.layers.3.self_attn.attn``).
        layer: the ``Attention`` module.
        layer_id: the integer in the name (vLLM's ``extract_layer_index``), or the layer's index in
            the list when the name has none or shares it.
        group: the index of its KV cache group in ``kv_cache_config.kv_cache_groups``.
        swa: the group is of the sliding-window kind.
        rows: the backend's attention metadata carries ``query_start_loc`` (FlashAttention,
            Triton), so a token's batch row, hence its request, is known; FlashInfer's does not.
    """

    name: str
    layer: Any
    layer_id: int
    group: int
    swa: bool
    rows: bool = True


def _spec_kind(spec: Any) -> "bool | None":
    """True: sliding-window kind, False: full attention, None: another kind (not checked)."""
    first = getattr(spec, "first_spec", None)
    if first is not None:
        spec = first
    names = {c.__name__ for c in type(spec).__mro__}
    if names & set(_WINDOW_SPECS):
        return True
    if names & set(_FULL_SPECS):
        return False
    return None


def write_layers(kv_cache_config: Any, forward_context: "dict[str, Any]") -> "tuple[list[WriteLayer], list[str]]":
    """The layers of the sliding-window and full KV cache groups whose implementation is one of
    :data:`SUPPORTED_IMPLS`, in group order, and the names of the layers left out (another
    implementation, not found in ``forward_context``), for a log line.

    Args:
        kv_cache_config: the runner's ``KVCacheConfig``.
        forward_context: ``compilation_config.static_forward_context`` (layer name -> module).
    """
    supported = {cls for _, cls in SUPPORTED_IMPLS}
    layers, left_out, used = [], [], set()
    for group_index, group in enumerate(kv_cache_config.kv_cache_groups):
        swa = _spec_kind(group.kv_cache_spec)
        if swa is None:
            continue
        for name in group.layer_names:
            module = forward_context.get(name)
            impl = getattr(module, "impl", None)
            if impl is None or type(impl).__name__ not in supported:
                left_out.append(name)
                continue
            numbers = [int(n) for n in re.findall(r"\d+", name)]
            layer_id = numbers[0] if len(numbers) == 1 and numbers[0] not in used else None
            if layer_id is None:
                layer_id = max(used, default=-1) + 1
            used.add(layer_id)
            layers.append(WriteLayer(name, module, layer_id, group_index, swa, type(impl).__name__ not in _NO_ROWS))
    return layers, left_out


def impl_quantized(impl: Any) -> bool:
    """Whether the implementation's cache stores scaled (quantized) values (module docstring)."""
    dtype = getattr(impl, "kv_cache_dtype", "auto")
    return (not (isinstance(dtype, str) and dtype in _FLOAT_CACHE_DTYPES)
            or bool(getattr(impl, "_is_per_token_head_quant", False))
            or bool(getattr(impl, "is_kvcache_nvfp4", False)) or bool(getattr(impl, "nvfp4_fa2", False)))


def _query_start_loc(layer_name: str) -> Any:
    """The attention metadata's ``query_start_loc`` of ``layer_name`` in the forward now running,
    or ``None``."""
    try:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
    except Exception:
        return None
    if isinstance(metadata, list):  # speculative decoding: [0] is the target's
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    return getattr(metadata, "query_start_loc", None)


def layer_store(write_layer: WriteLayer, impl: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any,
                positions: Any = None, query_start_loc: Any = None) -> LayerStore:
    """The :class:`~otel_swa.device.write_check.LayerStore` of one ``do_kv_cache_update`` call
    (:func:`otel_swa.device.paged_write.paged_layer_store`, in the layout of the implementation:
    CPU_ATTN's by its instruction set, :data:`CPU_ATTN_LAYOUTS`); a cache of another shape or
    strides than the layout known, or a CPU_ATTN instruction set not measured, is counted unchecked (:func:`otel_swa.device.paged_write.unchecked_store`).

    Args:
        query_start_loc: ``int32 [B + 1]`` or ``None`` to read it from vLLM's forward context.
    """
    head_size = int(getattr(impl, "head_size", 0) or 0)
    layout = "flash"
    if type(impl).__name__ == _CPU_ATTN:
        layout = CPU_ATTN_LAYOUTS.get(getattr(write_layer.layer, "isa", None))
    if layout is None or head_size < 1 or kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        return unchecked_store(write_layer.layer_id, write_layer.swa, slot_mapping)
    if query_start_loc is None and write_layer.rows:
        query_start_loc = _query_start_loc(write_layer.name)
    try:
        return paged_layer_store(write_layer.layer_id, write_layer.swa, key, value, kv_cache, slot_mapping,
                                 head_size=head_size, positions=positions, query_start_loc=query_start_loc,
                                 quantized=impl_quantized(impl), layout=layout)
    except ValueError:  # strides the layout cannot view (CPU_ATTN needs its rows contiguous)
        return unchecked_store(write_layer.layer_id, write_layer.swa, slot_mapping)


def runner_positions(runner: Any) -> Any:
    """The runner's persistent positions buffer (``int64 [max_num_tokens]`` on its device), or
    ``None`` (V1: ``runner.positions``; V2: ``runner.input_buffers.positions``)."""
    buffers = getattr(runner, "input_buffers", None)
    positions = getattr(buffers, "positions", None) if buffers is not None else None
    if positions is None:
        positions = getattr(runner, "positions", None)
    if positions is not None and hasattr(positions, "gpu"):  # a CpuGpuBuffer
        positions = positions.gpu
    return positions if hasattr(positions, "shape") and getattr(positions, "dim", lambda: 0)() == 1 else None


def runner_request_ids(runner: Any) -> "Sequence[str] | None":
    """The request ids of the step the runner just ran, in its batch order (module docstring), or
    ``None``."""
    state = getattr(runner, "execute_model_state", None)
    batch = getattr(state, "input_batch", None) if state is not None else None
    if batch is None:
        batch = getattr(runner, "input_batch", None)
    ids = getattr(batch, "req_ids", None) if batch is not None else None
    return [str(r) for r in ids] if ids is not None else None
