"""vLLM 0.33's real classes for the ``vllm`` tests, and what the tests build around them.

Nothing here stands in for vLLM: the KV cache manager, the scheduler, the requests and the configs
are vLLM's own (installed by ``.ci/vllm-tests.sh``: ``vllm==0.33.0 --no-deps`` and the import
requirements in ``.ci/vllm-requirements.txt``; ``vllm._C`` and the GPU are never needed for them).
What the tests need beside them:

* :func:`load_vllm` (behind the ``vllm_classes`` fixture): vLLM's classes, or a skip when vLLM
  does not import, turned into a failure when ``OTEL_SWA_REQUIRE_VLLM=1`` (the CI script sets it);
* :func:`vllm_source_dir`: the installed source, found without importing vLLM;
* :func:`write_tiny_llama`: a two-layer Llama ``config.json`` in a directory of the test's own
  (``ModelConfig`` reads a local folder; ``HF_HUB_OFFLINE=1`` keeps it off the network; no weights
  are read: nothing here runs a model);
* :func:`hybrid_kv_cache_config`: one ``FullAttentionSpec`` group and one ``SlidingWindowSpec``
  group sharing one block pool, as vLLM builds for a hybrid model;
* :func:`recount`: a batch's counts by plain loops over the real block tables;
* :func:`make_scheduler`, :func:`trace_requests` and :class:`SchedulerDriver`: vLLM's real
  ``Scheduler`` or ``AsyncScheduler`` (the class vLLM's ``SchedulerConfig.get_scheduler_cls``
  picks), requests from the Azure trace, and the engine core's loop around them (``EngineCore.step``
  when synchronous, ``step_with_batch_queue`` with two batches in flight under async scheduling),
  the model runner's output written by the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import traceback
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from otel_swa import config
from otel_swa import environment_variables as ev

#: Set to 1 (as ``.ci/vllm-tests.sh`` does) to make a failed vLLM import fail the ``vllm`` tests
#: instead of skipping them.
REQUIRE_VLLM = ev.OTEL_SWA_REQUIRE_VLLM

#: The attention layers of :func:`write_tiny_llama`'s model, one per KV cache group.
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
#: Tokens per KV block in every test here.
BLOCK = 16
#: The scheduler runs' sliding window (tokens a query reads, its own included) and pool size.
WINDOW = 64
NUM_BLOCKS = 72
#: A pool small enough that the synchronous ``Scheduler`` preempts on the trace's requests.
PREEMPTING_BLOCKS = 66


def unavailable(reason: str) -> None:
    """Skip the test, or fail it under ``OTEL_SWA_REQUIRE_VLLM=1``."""
    if config.require_vllm():
        pytest.fail(f"{REQUIRE_VLLM}=1 but {reason}")
    pytest.skip(f"{reason}; run .ci/vllm-tests.sh")


def load_vllm() -> SimpleNamespace:
    """vLLM's classes used by the tests, imported now (about 5-15 s the first time)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # set before huggingface_hub is imported
    try:
        from importlib.metadata import version

        import torch
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            SlidingWindowSpec,
        )
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager
    except Exception as exc:  # vLLM's import chain raises more than ImportError when it breaks
        unavailable(f"vLLM does not import here ({exc!r})")
    init_none_hash(sha256)
    return SimpleNamespace(**{name: value for name, value in locals().items() if name not in ("exc",)},
                           vllm_version=version("vllm"))


@pytest.fixture(scope="session")
def vllm_classes() -> SimpleNamespace:
    """vLLM's real classes (a namespace); see :func:`load_vllm`."""
    return load_vllm()


def vllm_source_dir() -> Path:
    """The installed ``vllm`` package directory, found without importing vLLM (skip or fail as
    :func:`unavailable` when it is not installed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        unavailable("vLLM is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def write_tiny_llama(directory: Path, max_model_len: int) -> Path:
    """A two-layer Llama ``config.json`` (no weights) in ``directory``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": len(LAYERS), "vocab_size": 1024, "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def hybrid_kv_cache_config(v: SimpleNamespace, *, num_blocks: int, block_size: int, window: int,
                           extra_retained_tokens: int = 0):
    """A ``KVCacheConfig``: group 0 full attention (layer 0), group 1 sliding window (layer 1)."""
    import torch

    full = v.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float16)
    swa = v.SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float16,
                              sliding_window=window, extra_retained_tokens=extra_retained_tokens)
    page = full.page_size_bytes
    return v.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[v.KVCacheTensor(size=2 * page * num_blocks, layers=list(LAYERS), layer_stride=page,
                                          block_stride=2 * page)],
        kv_cache_groups=[v.KVCacheGroupSpec([LAYERS[0]], full), v.KVCacheGroupSpec([LAYERS[1]], swa)],
    )


def swa_manager(v: SimpleNamespace, kv_cache_manager) -> object:
    """The sliding-window group's ``SlidingWindowManager`` of a ``KVCacheManager``."""
    managers = kv_cache_manager.coordinator.single_type_managers
    found = [m for m in managers if isinstance(m, v.SlidingWindowManager)]
    assert len(found) == 1, [type(m).__name__ for m in managers]
    return found[0]


def recount(manager, request_ids, num_tokens) -> tuple[int, int, int]:
    """``(FULL tokens, tokens in real SWA blocks, tokens in null SWA blocks)`` of a batch, position
    by position over ``manager.req_to_blocks`` (``KVCacheBlock.is_null``, with ``block_id == 0``
    checked to agree)."""
    full = held = out = 0
    bs = manager.block_size
    for rid, n in zip(request_ids, num_tokens):
        blocks = manager.req_to_blocks[rid] if rid in manager.req_to_blocks else []
        for position in range(n):
            block = blocks[position // bs]
            assert block.is_null == (block.block_id == 0), block
            full += 1
            if block.is_null:
                out += 1
            else:
                held += 1
    return full, held, out


def sampled(request) -> int:
    """The test's stand-in for the model's sampled token: derived from the request's length."""
    return (request.num_tokens * 7 + 11) % 1000 + 3


def make_scheduler(v: SimpleNamespace, model_dir: Path, *, async_scheduling: bool = False,
                   num_blocks: int = NUM_BLOCKS, window: int = WINDOW, extra_retained_tokens: int = 0,
                   prefix_caching: bool = True, max_num_seqs: int = 8, max_num_batched_tokens: int = 128):
    """vLLM's scheduler over :func:`hybrid_kv_cache_config` (block :data:`BLOCK`): the class
    ``SchedulerConfig.get_scheduler_cls()`` gives, ``AsyncScheduler`` with ``async_scheduling``
    (vLLM's default where the executor supports it), ``Scheduler`` otherwise."""
    max_len = 2048
    model = v.ModelConfig(model=str(write_tiny_llama(model_dir, max_len)), dtype="float16", seed=0,
                          skip_tokenizer_init=True, max_model_len=max_len)
    scheduling = v.SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_len, enable_chunked_prefill=True, is_encoder_decoder=False,
                                   async_scheduling=async_scheduling)
    cache = v.CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
    cache.num_gpu_blocks = num_blocks
    config = v.VllmConfig(model_config=model, scheduler_config=scheduling, cache_config=cache,
                          device_config=v.DeviceConfig(device="cpu"))
    cls = config.scheduler_config.get_scheduler_cls()
    assert cls is (v.AsyncScheduler if async_scheduling else v.Scheduler), cls
    kv_config = hybrid_kv_cache_config(v, num_blocks=num_blocks, block_size=BLOCK, window=window,
                                       extra_retained_tokens=extra_retained_tokens)
    return cls(vllm_config=config, kv_cache_config=kv_config,
               structured_output_manager=v.StructuredOutputManager(config), block_size=BLOCK)


def trace_requests(v: SimpleNamespace, limit: int = 24) -> list:
    """The first ``limit`` requests of the Azure LLM inference trace 2023 (conversation), scaled
    down so that prompts exceed the window: a shared 96-token system prompt, then context / 6
    tokens of their own; generated / 4 + 1 output tokens."""
    from otel_swa.reference.trace import load_trace

    hasher = v.get_request_block_hasher(BLOCK, v.sha256)
    system = [(7 * i) % 1000 + 3 for i in range(96)]
    made = []
    for i, row in enumerate(load_trace("conv", limit=limit)):
        body = [(i * 131 + 17 * j) % 1000 + 3 for j in range(row.context_tokens // 6)]
        params = v.SamplingParams(max_tokens=row.generated_tokens // 4 + 1, ignore_eos=True)
        made.append(v.Request(f"conv-{i}", system + body, params, None, block_hasher=hasher))
    return made


class SchedulerDriver:
    """Runs a real vLLM scheduler the way vLLM 0.33's ``EngineCore`` does (``v1/engine/core.py``).

    Synchronous (``Scheduler``): ``schedule()`` then ``update_from_output()`` each step
    (``EngineCore.step``). Async scheduling (``AsyncScheduler``): ``step_with_batch_queue`` with a
    queue of ``max_concurrent_batches`` (2) batches: a step is scheduled while the previous one is
    still in flight, and a batch's output is taken only when the queue is full or nothing more can
    be scheduled, so each ``schedule()`` runs with one step's tokens in flight
    (``Request.num_in_flight_tokens``).

    The model runner's output is the only stand-in: one sampled token (:func:`sampled`) for each
    request that was not a prefill chunk when scheduled, none for a chunk.

    ``on_schedule(output)`` is called after every ``schedule()`` that scheduled tokens, with
    :attr:`forward_ct` already counting it; ``before_update(output)`` before each
    ``update_from_output``.
    """

    def __init__(self, scheduler, *, on_schedule: "Callable | None" = None,
                 before_update: "Callable | None" = None) -> None:
        self.scheduler = scheduler
        self.on_schedule = on_schedule
        self.before_update = before_update
        self.queue_size = scheduler.vllm_config.max_concurrent_batches if _is_async(scheduler) else 1
        self.forward_ct = 0
        self.preempted: set = set()
        self.prefix_hits = 0
        self.chunked = 0
        self.max_in_flight = 0

    def run(self, requests, max_steps: int = 4000) -> "SchedulerDriver":
        """Add ``requests`` and run until every request finished (fails after ``max_steps``)."""
        for r in requests:
            self.scheduler.add_request(r)
        queue: deque = deque()
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not queue:
                return self
            if self.scheduler.has_requests():
                output, runner_output = self._schedule()
                queue.appendleft((output, runner_output))
                if len(queue) < self.queue_size and (output.total_num_scheduled_tokens > 0 or
                                                     self.scheduler.has_requests()):
                    continue
            output, runner_output = queue.pop()
            if self.before_update is not None:
                self.before_update(output)
            self.scheduler.update_from_output(output, runner_output)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def _schedule(self):
        v_output = self.scheduler.schedule()
        ids = list(v_output.num_scheduled_tokens)
        requests = self.scheduler.requests
        self.preempted |= set(v_output.preempted_req_ids or ())
        self.prefix_hits += sum(1 for new in v_output.scheduled_new_reqs if new.num_computed_tokens > 0)
        # sampled now or not: decided at schedule time, as the model runner decides on this batch
        tokens = [[sampled(requests[rid])] if not requests[rid].is_prefill_chunk else [] for rid in ids]
        self.chunked += sum(1 for rid in ids if requests[rid].is_prefill_chunk)
        if ids:
            self.forward_ct += 1
            self.max_in_flight = max(self.max_in_flight, max(
                requests[rid].num_in_flight_tokens - v_output.num_scheduled_tokens[rid] for rid in ids))
            if self.on_schedule is not None:
                self.on_schedule(v_output)
        from vllm.v1.outputs import ModelRunnerOutput

        runner_output = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                          sampled_token_ids=tokens)
        return v_output, runner_output


def _is_async(scheduler) -> bool:
    return any(cls.__name__ == "AsyncScheduler" for cls in type(scheduler).__mro__)


# ------------------------------------------------------------------------------------- recounts
def block_audit_recount(kv_cache_manager) -> SimpleNamespace:
    """The KV block audit's definitions (``otel_swa.device.block_audit``), by plain loops over vLLM's
    real objects: the free queue walked by vLLM's own ``FreeKVCacheBlockQueue.get_all_free_blocks``,
    the cached blocks as those with a ``block_hash``, every group's tables.

    Returns ``leaked`` (ids, ascending: blocks neither free, held, cached nor the null block),
    ``freed`` (``(block, group, request, position)`` of each held entry whose block is on the free
    queue, cached or not, groups in order, then each group's requests, then each table's blocks),
    ``freed_cached`` (those of them that are cached), ``shared`` (blocks without a hash that the
    tables of two requests reference) and ``entries`` (every held entry, in that order)."""
    pool = kv_cache_manager.coordinator.block_pool
    managers = kv_cache_manager.coordinator.single_type_managers
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
    entries = [(block.block_id, group, rid, j * manager.block_size)
               for group, manager in enumerate(managers)
               for rid, blocks in manager.req_to_blocks.items()
               for j, block in enumerate(blocks) if block.block_id != 0]
    held: dict[int, set] = {}
    for block, _, rid, _ in entries:
        held.setdefault(block, set()).add(rid)
    return SimpleNamespace(
        leaked=[b for b in range(1, pool.num_gpu_blocks) if b not in free and b not in held and b not in cached],
        freed=[e for e in entries if e[0] in free],
        freed_cached=[e for e in entries if e[0] in free and e[0] in cached],
        shared=sorted(b for b, rids in held.items() if b not in cached and len(rids) > 1),
        entries=entries,
    )


def block_hash_recount(kv_cache_manager, requests) -> SimpleNamespace:
    """The block-hash provenance check's definitions (``otel_swa.views.vllm_block_hashes``), by plain
    loops over vLLM's real objects, for this suite's groups (block size = hash block size, full
    blocks only, no partial prefix entries).

    Returns ``checked`` (map entries plus hashed table entries), ``stale`` (``(block, key's group)``
    of each map entry whose key is not the block's hash nor one of its
    ``cached_block_hashes_by_block`` keys, in map order; ``stale_keys``: their ``(key, block)``),
    ``foreign`` (``(request, position, block,
    group)`` of each table entry whose block's hash is not ``make_block_hash_with_group_id(
    request.block_hashes[j], group)`` for its index ``j``, or covers another number of tokens than
    ``(j + 1) * block_size``: requests in the order first met over the groups' tables, then group,
    then index) and ``holders`` (block id -> the requests whose tables hold it)."""
    from vllm.v1.core.kv_cache_utils import get_group_id, make_block_hash_with_group_id

    pool = kv_cache_manager.coordinator.block_pool
    managers = kv_cache_manager.coordinator.single_type_managers
    checked, stale, stale_keys, foreign, holders = 0, [], set(), [], {}
    for key, entry in pool.cached_block_hash_to_block._cache.items():
        for block in (entry.values() if isinstance(entry, dict) else [entry]):
            checked += 1
            own = {block.block_hash, *pool.cached_block_hashes_by_block.get(block.block_id, ())}
            if block.is_null or key not in own:
                stale.append((block.block_id, get_group_id(key)))
                stale_keys.add((key, block.block_id))
    order = list(dict.fromkeys(rid for m in managers for rid in m.req_to_blocks))
    for rid in order:
        for m in managers:
            if type(m).__name__ not in ("FullAttentionManager", "SlidingWindowManager"):
                continue
            for j, block in enumerate(m.req_to_blocks.get(rid, ())):
                if block.is_null:
                    continue
                holders.setdefault(block.block_id, []).append(rid)
                if block.block_hash is None or rid not in requests:
                    continue
                checked += 1
                hashes = requests[rid].block_hashes
                good = (j < len(hashes) and block.block_hash_num_tokens == (j + 1) * m.block_size
                        and block.block_hash == make_block_hash_with_group_id(hashes[j], m.kv_cache_group_id))
                if not good:
                    foreign.append((rid, j * m.block_size, block.block_id, m.kv_cache_group_id))
    return SimpleNamespace(checked=checked, stale=stale, stale_keys=stale_keys, foreign=foreign, holders=holders)


def window_recount(scheduler, output, manager) -> tuple[int, int, int]:
    """``(premature, late_held, past_rounding)`` of one scheduled batch, position by position over
    the SWA table: a null block at a position the step's queries read (``n - s - sliding_window +
    1`` on, ``s`` scheduled tokens, ``n`` computed); a real block below where vLLM's own trimming
    frees to (whole blocks below ``manager.get_num_skipped_tokens(n - f)``, ``f`` the request's
    tokens in flight, this step's included: the rule ``KVCacheManager.allocate_slots`` applies);
    and a real block more than ``block_size - 1`` positions before the oldest one read (what an
    allowance of the block rounding alone would count as late-held)."""
    premature = late = past_rounding = 0
    bs, window = manager.block_size, manager.sliding_window
    for rid, s in output.num_scheduled_tokens.items():
        request = scheduler.requests[rid]
        n, f = request.num_computed_tokens, request.num_in_flight_tokens
        first_held = manager.get_num_skipped_tokens(max(0, n - f)) // bs * bs
        oldest_read = n - s - window + 1
        blocks = manager.req_to_blocks[rid]
        for position in range(n):
            null = blocks[position // bs].is_null
            premature += position >= oldest_read and null
            late += position < min(first_held, oldest_read) and not null
            past_rounding += position < oldest_read - (bs - 1) and not null
    return premature, late, past_rounding


def pool_recount(kv_cache_manager) -> dict:
    """``{pool: (used, available, evictable, total)}`` in tokens, by plain loops: free is vLLM's own
    free queue walk; a block in use (not free) is of ``swa`` when a ``SlidingWindowManager`` table
    holds it and no ``FullAttentionManager`` table does, else of ``full`` (a full table's, or none's:
    leaked); evictable by the group of its hash (vLLM's ``kv_cache_utils.get_group_id``)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    managers = kv_cache_manager.coordinator.single_type_managers
    kinds = ["swa" if type(m).__name__ == "SlidingWindowManager" else "full" for m in managers]
    pool = kv_cache_manager.coordinator.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = {b.block_id for b in free}
    uncached = sum(1 for b in free if b.block_hash is None)
    held = {kind: {b.block_id for m, k in zip(managers, kinds) if k == kind
                   for blocks in m.req_to_blocks.values() for b in blocks if b.block_id != 0} for kind in ("full", "swa")}
    swa_held = held["swa"] - held["full"]
    in_use = {b.block_id for b in pool.blocks if b.block_id != 0 and b.block_id not in free_ids}
    used = {"swa": len(swa_held & in_use), "full": len(in_use - swa_held)}
    out = {}
    for kind in ("full", "swa"):
        cached = sum(1 for b in free if b.block_hash is not None and kinds[get_group_id(b.block_hash)] == kind)
        out[kind] = (used[kind] * BLOCK, uncached * BLOCK, cached * BLOCK, (pool.num_gpu_blocks - 1) * BLOCK)
    return out


def instrumented_run(v: SimpleNamespace, directory: Path, *, fault: "str | None" = None, max_steps: int = 600,
                     **scheduler_args) -> SimpleNamespace:
    """One run of vLLM's real scheduler (:func:`make_scheduler` with ``scheduler_args``) under the
    ``swa_vllm`` instrumentor, which the caller has switched on (``instrument()`` with
    ``OTEL_SWA_DIVERGENCE_INTERVAL`` set), until every request of :func:`trace_requests` finished, vLLM
    itself raised, or ``max_steps`` passed (a stall: a leak can leave a request that never fits).

    ``fault``: a ``tests/engines/shims/vllm_faults.py`` spec (``<fault>@<step>``). The reporter's
    records are kept and written, as otel-swa's line sink writes them, to ``directory/run.log``;
    after every ``schedule()`` the recounts of that moment are kept by forward step: the window
    (:func:`window_recount`), the block audit (:func:`block_audit_recount`), the block hashes
    (:func:`block_hash_recount`), the pools
    (:func:`pool_recount`) beside otel-swa's figures (``kv_cache_pool_usage``) and vLLM's own usage
    (``KVCacheManager.usage``).

    Returns a namespace: ``records`` (by ``forward_ct``), ``window``, ``audit``, ``hashes``, ``pools``,
    ``injection``, ``outcome`` (``"finished"``, ``"stalled"``, or vLLM's exception, where it was
    raised and at which forward step: ``"AssertionError in block_pool.get_new_blocks at step 37"``), ``steps``,
    ``log``, ``driver``, ``scheduler``.
    """
    import logging

    from opentelemetry.instrumentation.swa_vllm import SCHEDULER_ATTRIBUTE
    from otel_swa.logline import LogLineSink
    from otel_swa.views import vllm as vllm_view
    from shims import vllm_faults
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    scheduler = make_scheduler(v, directory / "tiny-llama", **scheduler_args)
    # An idle schedule() first: the instrumentor wires its reporter there, so the sinks below see
    # the first forward step's record too.
    scheduler.update_from_output(scheduler.schedule(), EMPTY_MODEL_RUNNER_OUTPUT)
    wiring = scheduler.__dict__[SCHEDULER_ATTRIBUTE]
    records: dict = {}
    wiring.reporter.add_sink(lambda record, context: records.__setitem__(record.forward_ct, record))
    log = directory / "run.log"
    logger = logging.getLogger(f"otel_swa.tests.vllm.{id(scheduler)}")
    logger.propagate = False
    handler = logging.FileHandler(log, mode="w")
    logger.addHandler(handler)
    wiring.reporter.add_sink(LogLineSink(logger))
    injection = vllm_faults.install(scheduler, fault) if fault else None
    kv = scheduler.kv_cache_manager
    swa = swa_manager(v, kv)
    run = SimpleNamespace(records=records, window={}, audit={}, pools={}, hashes={}, injection=injection, log=log,
                          scheduler=scheduler, outcome="finished")

    def on_schedule(output):
        step = driver.forward_ct
        run.window[step] = window_recount(scheduler, output, swa)
        run.audit[step] = block_audit_recount(kv)
        run.hashes[step] = block_hash_recount(kv, scheduler.requests)
        run.pools[step] = (pool_recount(kv), vllm_view.kv_cache_pool_usage(kv), kv.usage)

    driver = SchedulerDriver(scheduler, on_schedule=on_schedule)
    try:
        driver.run(trace_requests(v), max_steps=max_steps)
    except Exception as exc:  # a stall (the driver's AssertionError), or vLLM's own reaction to the fault
        if isinstance(exc, AssertionError) and "still unfinished" in str(exc):
            run.outcome = "stalled"
        else:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            run.outcome = f"{type(exc).__name__} in {Path(where.filename).stem}.{where.name} at step {driver.forward_ct}"
    finally:
        wiring.reporter.flush()
        handler.close()
        logger.removeHandler(handler)
    run.driver, run.steps = driver, driver.forward_ct
    return run
