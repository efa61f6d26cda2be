"""Run a real ``sglang.Engine`` on CPU with traffic from the Azure LLM inference trace 2023, then shut
it down the normal way (``Engine.shutdown()``, no ``close()`` of anything otel-swa made).

Usage: ``python drive_engine.py CONFIG.json`` where the JSON object holds:

``model`` (path of ``build_model.py``'s output), ``out`` (results JSON to write), ``engine``
(extra ``sglang.Engine`` keyword arguments: ``page_size``, ``disable_overlap_schedule``,
``kv_canary``, ``enable_trace``, ``otlp_traces_endpoint``...), ``requests`` (how many requests of
the packaged conversation trace), ``repeat`` (how many of them are sent a second time, for prefix
cache hits).

Traffic: each trace request becomes a prompt of ``clamp(ContextTokens / 32, 4, 24)`` token ids that
starts with the same 16-token "system prompt" (so the radix cache matches across requests) and
``clamp(GeneratedTokens / 3, 16, 48)`` greedy output tokens (``ignore_eos``): with an 8-token window
every request leaves the window, and with a 160-token pool, 4 running requests and an admission
that counts at most 8 future tokens per request (``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=8``, set
by the harness) decoding outgrows the pool and the scheduler retracts. All requests are submitted at once, then the repeats.

The results JSON: per request ``completion_tokens``, ``cached_tokens``, ``rid`` (SGLang's request id)
and ``output_ids`` (the generated token ids, to compare runs), the engine's start-up
and generation times, the pids of the engine's child processes and, where the suite's probe is
installed (``OTEL_SWA_TEST_SGLANG_PROBE``), what otel-swa did in this main process before the
shutdown (``main_process``: ``sglang_step_probe.otel_swa_process()``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

T0 = time.monotonic()


def traffic(count: int) -> tuple[list[list[int]], list[int]]:
    from otel_swa.reference.trace import load_trace

    rng = random.Random(0)
    system = [rng.randrange(4, 512) for _ in range(16)]
    prompts, outputs = [], []
    for request in load_trace("conv", limit=count):
        length = min(max(request.context_tokens // 32, 4), 24)
        prompts.append(system + [rng.randrange(4, 512) for _ in range(length)])
        outputs.append(min(max(request.generated_tokens // 3, 16), 48))
    return prompts, outputs


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    import psutil
    import sglang as sgl

    kwargs = dict(
        model_path=config["model"], device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
        disable_cuda_graph=True, dtype="float32", max_total_tokens=160, mem_fraction_static=0.05,
        max_running_requests=4, chunked_prefill_size=-1, page_size=1, random_seed=0, log_level="info",
    )
    kwargs.update(config.get("engine", {}))
    engine = sgl.Engine(**kwargs)
    started = time.monotonic()
    children = [p.pid for p in psutil.Process().children(recursive=True)]
    prompts, outputs = traffic(config.get("requests", 12))
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in outputs]
    first = engine.generate(input_ids=prompts, sampling_params=params)
    repeat = config.get("repeat", 4)
    second = engine.generate(input_ids=prompts[:repeat], sampling_params=params[:repeat]) if repeat else []
    generated = time.monotonic()
    if config.get("sigkill_children"):  # a crash: no flush can run in the engine's processes
        import signal

        for child in psutil.Process().children(recursive=True):
            child.send_signal(signal.SIGKILL)
    results = {
        "requests": [
            {"prompt_tokens": len(p), "completion_tokens": o["meta_info"]["completion_tokens"],
             "cached_tokens": o["meta_info"].get("cached_tokens", 0), "wave": wave, "rid": o["meta_info"].get("id"),
             "output_ids": list(o.get("output_ids") or ())}
            for wave, (batch, sent) in enumerate(((first, prompts), (second, prompts[:repeat])))
            for p, o in zip(sent, batch)
        ],
        "startup_s": round(started - T0, 2),
        "generate_s": round(generated - started, 2),
        "children": children,
    }
    if os.environ.get("OTEL_SWA_TEST_SGLANG_PROBE"):
        import sglang_step_probe  # the suite's shims (tests/engines/shims/install.py)

        results["main_process"] = sglang_step_probe.otel_swa_process()
    engine.shutdown()
    results["shutdown_s"] = round(time.monotonic() - generated, 2)
    with open(config["out"], "w") as f:
        json.dump(results, f)
    print("drive_engine done", json.dumps({k: v for k, v in results.items() if k != "requests"}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
