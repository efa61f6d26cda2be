"""Stand-ins for the parts of vLLM 0.33's GPU worker that store a step's K/V: the attention
implementation's ``do_kv_cache_update``, its ``reshape_and_cache_flash`` kernel, the ``Attention``
layer, the call path ``unified_kv_cache_update``, the forward context, and a ``GPUModelRunner``
that allocates the KV cache and runs forward steps; with a scheduler stand-in whose sliding-window
manager the scheduler side of the instrumentor reads.

The real parts need a GPU (the worker, the CUDA kernels); these run on the CPU with torch and keep
the real signatures and semantics (checked against vLLM 0.33.0's source by
``tests/engines/test_vllm_write_check.py::test_shim_signatures_match_vllm_source``, marker
``vllm``). The fault injections (:attr:`FlashAttentionImpl.fault`) are stores that go wrong the
ways the write check is meant to see: one slot off, a token skipped.
"""

from __future__ import annotations

import random
from collections import defaultdict
from types import SimpleNamespace

import torch

BLOCK = 4  # tokens per block (the kernel block size)
NUM_BLOCKS = 256  # per layer; block 0 is the null block
HEADS, HEAD_SIZE = 2, 8
GRAPH_TOKENS = 8  # the step's slot mapping is padded to this with -1 (a CUDA graph's size)
KEY_PAD = 3  # key/value are longer still than the slot mapping ("key and value are padded")


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Stands in for ``vllm._custom_ops.reshape_and_cache_flash`` (csrc ``cache_kernels.cu``):
    token ``i < len(slot_mapping)`` is written at block ``slot // block_size``, offset ``slot %
    block_size`` (``block_size = key_cache.shape[1]``), cast to the cache dtype; ``-1`` is padding,
    not written; rows of ``key`` past ``len(slot_mapping)`` are ignored. Signature as in vLLM
    0.33.0's ``vllm/_custom_ops.py``."""
    tokens = slot_mapping.shape[0]
    slots = slot_mapping.long()
    keep = slots.ge(0)
    slots = slots[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[:tokens][keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:tokens][keep].to(value_cache.dtype)


class FlashAttentionImpl:
    """Stands in for ``vllm.v1.attention.backends.flash_attn.FlashAttentionImpl`` (its store only):
    ``do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)`` splits ``kv_cache``
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` with ``kv_cache.transpose(1, 2)
    .split(self.head_size, dim=-1)`` and stores with :func:`reshape_and_cache_flash`, as 0.33.0's
    does (``flash_attn.py`` line 1432; signature checked against that source).

    ``fault`` (a class attribute, set by a test): ``None``; ``"slot+1"``: token ``i`` written at
    ``slot_mapping[i] + 1``; ``("skip", request, position)``: that request's token at that position
    not written.
    """

    fault = None

    def __init__(self, head_size: int, kv_cache_dtype: str = "auto") -> None:
        self.head_size = head_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = "decoder"

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        fault = type(self).fault
        if fault == "slot+1":
            slot_mapping = torch.where(slot_mapping.ge(0), slot_mapping + 1, slot_mapping)
        elif isinstance(fault, tuple) and fault[0] == "skip":
            lost = [i for i, (r, p) in enumerate(layer.current_tokens) if (r, p) == fault[1:]]
            slot_mapping = slot_mapping.clone()
            slot_mapping[lost] = -1
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype,
                                layer._k_scale, layer._v_scale)


class Attention:
    """Stands in for ``vllm.model_executor.layers.attention.attention.Attention``: ``layer_name``,
    ``impl``, ``kv_cache`` (bound by the runner), ``_k_scale`` / ``_v_scale``. ``current_tokens``
    (``(request id, position)`` per token of the step) is the shim's own (the skip fault reads it)."""

    def __init__(self, layer_name: str, impl: FlashAttentionImpl) -> None:
        self.layer_name = layer_name
        self.impl = impl
        self.kv_cache = None
        self._k_scale = self._v_scale = torch.ones(())
        self.current_tokens = ()


def unified_kv_cache_update(key, value, layer_name, forward_context):
    """Stands in for ``vllm.model_executor.layers.attention.attention.unified_kv_cache_update``
    (line 729): the layer and its slot mapping from the forward context, the implementation looked
    up at call time, ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``."""
    layer = forward_context.no_compile_layers[layer_name]
    slot_mapping = forward_context.slot_mapping.get(layer_name)
    if slot_mapping is not None:
        layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slot_mapping)
    return key.new_empty(0)


_FORWARD_CONTEXT = []


def get_forward_context():
    """Stands in for ``vllm.forward_context.get_forward_context`` (the context of the forward now
    running: ``attn_metadata`` per layer name, ``slot_mapping`` per layer name)."""
    return _FORWARD_CONTEXT[-1]


class FullAttentionSpec:
    """Stands in for ``vllm.v1.kv_cache_interface.FullAttentionSpec`` (its class name is what is read)."""


class SlidingWindowSpec:
    """Stands in for ``vllm.v1.kv_cache_interface.SlidingWindowSpec``."""


#: (layer name, KV cache group): groups 0 full, 1 sliding-window, alternating layers as in Gemma 3.
LAYERS = (("model.layers.0.self_attn.attn", 1), ("model.layers.1.self_attn.attn", 0),
          ("model.layers.2.self_attn.attn", 1), ("model.layers.3.self_attn.attn", 0))


class GPUModelRunner:
    """Stands in for ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (V1): ``initialize_kv_cache``
    and ``execute_model`` with 0.33.0's signatures; ``device``, ``vllm_config`` (``parallel_config
    .distributed_executor_backend`` / ``world_size``, ``compilation_config.static_forward_context``),
    ``kv_cache_config``, ``positions`` (``int64 [max_num_tokens]``), ``input_batch.req_ids``.

    A forward step: the scheduled requests in the runner's own batch order (sorted by request id,
    reversed: not the scheduler's), each token's slot from its group's block table
    (``scheduler_output.block_tables[group][request]``), the slot mapping padded with -1 to
    :data:`GRAPH_TOKENS`, key/value longer by :data:`KEY_PAD`; every layer's K/V stored through
    :func:`unified_kv_cache_update`. ``steps`` keeps what each step stored (for the tests'
    independent recount).
    """

    def __init__(self, device="cpu", executor="uni", world_size=1, kv_cache_dtype="auto", cache_dtype=torch.bfloat16):
        self.device = torch.device(device)
        self.layers = {name: Attention(name, FlashAttentionImpl(HEAD_SIZE, kv_cache_dtype)) for name, _ in LAYERS}
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(distributed_executor_backend=executor, world_size=world_size),
            compilation_config=SimpleNamespace(static_forward_context=self.layers))
        self.cache_dtype = cache_dtype
        self.positions = torch.zeros(64, dtype=torch.int64, device=self.device)
        self.input_batch = SimpleNamespace(req_ids=[])
        self.steps = []
        self.seed = 0

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None):
        self.kv_cache_config = kv_cache_config
        for name, layer in self.layers.items():  # LBNHC: physical [blocks, tokens, heads, K|V]
            raw = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD_SIZE, dtype=self.cache_dtype, device=self.device)
            layer.kv_cache = raw.permute(0, 2, 1, 3)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        scheduled = scheduler_output.num_scheduled_tokens
        order = sorted(scheduled, reverse=True)
        self.input_batch.req_ids = list(order)
        positions, rows, starts = [], [], [0]
        for row, rid in enumerate(order):
            n = scheduled[rid]
            done = scheduler_output.num_computed_tokens[rid]  # after this step
            positions += list(range(done - n, done))
            rows += [row] * n
            starts.append(starts[-1] + n)
        tokens = len(positions)
        assert tokens <= GRAPH_TOKENS
        pad = GRAPH_TOKENS - tokens
        self.positions[:GRAPH_TOKENS] = torch.tensor(positions + [0] * pad)
        slot_mappings = {}
        for name, group in LAYERS:
            table = scheduler_output.block_tables[group]
            slots = [table[order[r]][p // BLOCK] * BLOCK + p % BLOCK for r, p in zip(rows, positions)]
            slot_mappings[name] = torch.tensor(slots + [-1] * pad, dtype=torch.int64, device=self.device)
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=self.device)
        metadata = {name: SimpleNamespace(query_start_loc=query_start_loc) for name, _ in LAYERS}
        context = SimpleNamespace(attn_metadata=metadata, slot_mapping=slot_mappings, no_compile_layers=self.layers)
        g = torch.Generator().manual_seed(1000 + self.seed)
        self.seed += 1
        stored = {}
        _FORWARD_CONTEXT.append(context)
        try:
            for name, _ in LAYERS:
                key = torch.randn(GRAPH_TOKENS + KEY_PAD, HEADS, HEAD_SIZE, generator=g).to(self.device)
                value = torch.randn(GRAPH_TOKENS + KEY_PAD, HEADS, HEAD_SIZE, generator=g).to(self.device)
                self.layers[name].current_tokens = [(order[r], p) for r, p in zip(rows, positions)]
                unified_kv_cache_update(key, value, name, context)
                stored[name] = (key, value)
        finally:
            _FORWARD_CONTEXT.pop()
        self.steps.append(SimpleNamespace(order=order, positions=positions, rows=rows, slot_mappings=slot_mappings,
                                          stored=stored))
        return None


class KVCacheBlock:
    """Stands in for ``vllm.v1.core.kv_cache_utils.KVCacheBlock`` (``block_id``, ``is_null``)."""

    def __init__(self, block_id, is_null=False):
        self.block_id, self.is_null = block_id, is_null


class FullAttentionManager:
    """Stands in for ``vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager``."""

    def __init__(self):
        self.block_size = BLOCK
        self.req_to_blocks = defaultdict(list)


class SlidingWindowManager(FullAttentionManager):
    """Stands in for ``vllm.v1.core.single_type_kv_cache_manager.SlidingWindowManager`` (the
    scheduler side reads ``req_to_blocks`` and ``block_size``; no block is freed here)."""


class Scheduler:
    """Stands in for ``vllm.v1.core.sched.scheduler.Scheduler``: ``schedule(self, throttle_prefills=False)``
    returns the scheduled tokens per request (a 3-token prefill, then one token per step, two requests
    at a time, each to 9 tokens) and, as the worker's inputs, each group's block table and each
    request's ``num_computed_tokens``; ``requests``, ``kv_cache_manager.coordinator.single_type_managers``."""

    def __init__(self, seed=0):
        self.rng = random.Random(seed)
        self.managers = (FullAttentionManager(), SlidingWindowManager())
        self.kv_cache_manager = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=self.managers))
        self.requests = {}
        self.next_id = 0
        self.next_block = [1, 1]

    def schedule(self, throttle_prefills=False):
        for rid in [r for r, q in self.requests.items() if q.num_computed_tokens >= 9]:
            del self.requests[rid]
        while len(self.requests) < 2:
            rid = f"req-{self.next_id}"
            self.next_id += 1
            self.requests[rid] = SimpleNamespace(request_id=rid, num_computed_tokens=0)
        scheduled = {}
        for rid, req in self.requests.items():
            new = 3 if req.num_computed_tokens == 0 else 1
            req.num_computed_tokens += new
            for group, manager in enumerate(self.managers):
                blocks = manager.req_to_blocks[rid]
                while len(blocks) * BLOCK < req.num_computed_tokens:
                    blocks.append(KVCacheBlock(self.next_block[group]))
                    self.next_block[group] += 1
            scheduled[rid] = new
        return SimpleNamespace(
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            num_computed_tokens={rid: self.requests[rid].num_computed_tokens for rid in scheduled},
            block_tables=[{rid: [b.block_id for b in m.req_to_blocks[rid]] for rid in scheduled}
                          for m in self.managers])
