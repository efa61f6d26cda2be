"""Run a real ``vllm.LLM`` on CPU with the tiny hybrid Gemma-3 model of ``build_model.py``, as a user's
script does: ``LLM(...)``, two waves of ``generate``, then the process exits (no ``close()`` of
anything otel-swa made).

Usage: ``python drive_llm.py CONFIG.json`` where the JSON object holds ``model`` (the model folder),
``out`` (the results JSON to write), ``llm`` (further ``vllm.LLM`` keyword arguments:
``enable_prefix_caching``, ``enable_chunked_prefill``, ``max_num_batched_tokens``,
``kv_cache_memory_bytes``...), ``requests`` and ``repeat`` (how many of them are sent again in a
second wave, for prefix-cache hits), and optionally ``fault`` and ``fault_at`` (a fault of
``faults.py`` made from that forward step on).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the harness), so
the scheduler and the CPU model runner (``vllm/v1/worker/cpu_model_runner.py``) share it, as vLLM's
uni-process executor runs them.

Traffic: request ``i`` is a 48-token "system prompt" shared by all (prefix-cache hits across
requests) then ``8 + 13 * i % 72`` token ids of its own, and ``24 + 7 * i % 40`` greedy output tokens
(``ignore_eos``): with a 32-token window every request leaves the window. The results JSON: per
request ``prompt_tokens``, ``output_ids`` (to compare runs), ``cached_tokens``, ``wave``; the
scheduler's preemptions (counted by a wrapper of ``Scheduler._preempt_request``, vLLM 0.32.0
``vllm/v1/core/sched/scheduler.py``); the engine's start-up and generation seconds; the number of KV
blocks of the pool.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

T0 = time.monotonic()


def traffic(count: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(4, 512) for _ in range(48)]
    prompts = [system + [rng.randrange(4, 512) for _ in range(8 + 13 * i % 72)] for i in range(count)]
    return prompts, [24 + 7 * i % 40 for i in range(count)]


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted, evicted = [], []
    preempt, evict = Scheduler._preempt_request, BlockPool._maybe_evict_cached_block

    def _preempt_request(self, request, *args, **kwargs):  # counts; vLLM's own method runs unchanged
        preempted.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    def _maybe_evict_cached_block(self, block):  # counts; vLLM's own method runs unchanged
        done = evict(self, block)
        if done:
            evicted.append(block.block_id)
        return done

    Scheduler._preempt_request = _preempt_request
    BlockPool._maybe_evict_cached_block = _maybe_evict_cached_block
    fault = None
    if config.get("fault"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import faults

        fault = faults.install(config["fault"], int(config.get("fault_at", 10)))
    kwargs = dict(model=config["model"], tokenizer=config["model"], dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=512, max_num_seqs=16, block_size=32, kv_cache_memory_bytes=2 << 20)
    kwargs.update(config.get("llm", {}))
    llm = LLM(**kwargs)
    started = time.monotonic()
    prompts, outputs = traffic(config.get("requests", 20))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    waves = [list(range(len(prompts))), list(range(config.get("repeat", 6)))]
    results = []
    for wave, indices in enumerate(waves):
        if not indices:
            continue
        done = llm.generate([{"prompt_token_ids": prompts[i]} for i in indices], [params[i] for i in indices],
                            use_tqdm=False)
        for i, output in zip(indices, done):
            results.append({"index": i, "wave": wave, "prompt_tokens": len(prompts[i]),
                            "output_ids": list(output.outputs[0].token_ids),
                            "cached_tokens": output.num_cached_tokens or 0})
    generated = time.monotonic()
    core = llm.llm_engine.engine_core.engine_core
    summary = {"requests": results, "preemptions": len(preempted), "evictions": len(evicted), "startup_s": started - T0,
               "generate_s": generated - started,
               "num_blocks": core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks, "fault": fault}
    with open(config["out"], "w") as f:
        json.dump(summary, f)
    print(f"drive_llm: {len(results)} requests, {summary['preemptions']} preemptions, {len(evicted)} evictions, "
          f"{sum(r['cached_tokens'] for r in results)} cached tokens, generate {summary['generate_s']:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
