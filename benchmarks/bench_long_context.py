"""A long-context run: the trace's prompts stretched to contexts of up to 128K tokens.

Hybrid-SWA models are long-context models; the Azure 2023 trace's prompts stop at 14K tokens (the
first 200 of the conversation service at 4,107). This benchmark stretches the first ``--requests``
of the trace with :func:`otel_swa.reference.trace.scale_contexts` (one factor for all, so the
longest request holds ``--max-context-len`` KV positions; arrivals and outputs unchanged), and:

1. writes the slice to a CSV in the trace's format, with one request longer than the limit added
   at the end, and runs ``otel-swa replay`` on it with ``--max-context-len`` and a FULL pool large
   enough (``--no-model``: the KV cache bookkeeping and the reporter, not the attention math),
   printing its summary: the long request is reported and skipped, the others run;
2. measures, in this process with torch on one thread, the wall time per forward step of the
   stretched slice and of the same requests at their own lengths, each with the reporter off and
   on (sampling every ``--interval`` steps), in interleaved rounds (the four runs one after the
   other, ``--rounds`` times), and prints the median and the spread (min-max) of each and the
   ratio reporter on / off at both lengths.

Run: ``python benchmarks/bench_long_context.py [--requests 60] [--rounds 3] [--interval 20]``
(about a minute on 2 CPU cores with the defaults).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from otel_swa.reference.config import EngineConfig
from otel_swa.reference.replay import replay
from otel_swa.reference.trace import TraceRequest, load_trace, scale_contexts, write_trace
from otel_swa.reporter import SwaDivergenceReporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="conv")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-context-len", type=int, default=131072)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    native = load_trace(args.trace, limit=args.requests)
    long = scale_contexts(native, args.max_context_len)
    longest = max(r.context_tokens + max(0, r.generated_tokens - 1) for r in long)
    print(f"{args.trace}, first {len(native)} requests: prompts up to {max(r.context_tokens for r in native)} tokens, "
          f"stretched to {max(r.context_tokens for r in long)} (mean {statistics.mean(r.context_tokens for r in long):,.0f}; "
          f"longest KV length {longest})")
    # FULL slots for several of the longest requests at once; the SWA pool is sized by the window
    full_pool = 8 * args.max_context_len
    config = EngineConfig(max_context_len=args.max_context_len, full_pool_size=full_pool, swa_pool_size=16384,
                          run_model=False)

    # 1. the command line, on a CSV of the slice plus one request that cannot fit
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "long-context.csv")
        too_long = TraceRequest(long[-1].arrival_s, args.max_context_len + 1000, 10)
        write_trace(long + [too_long], path)
        command = [sys.executable, "-m", "otel_swa.cli", "replay", "--trace", path, "--requests", "0",
                   "--max-context-len", str(args.max_context_len), "--full-pool", str(full_pool),
                   "--swa-pool", str(config.swa_pool_size), "--no-model", "--no-progress",
                   "--interval", str(args.interval)]
        print("$ otel-swa " + " ".join(command[3:]).replace(path, "long-context.csv"))
        run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        lines = run.stdout.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("otel-swa replay summary")), len(lines))
        print("\n".join(lines[start:]).replace(path, "long-context.csv"))
        if run.stderr.strip():
            print("stderr: " + "\n        ".join(run.stderr.strip().splitlines()[:8]))
        if run.returncode != 0:
            sys.exit(f"otel-swa replay exited {run.returncode}")

    # 2. per-step cost, reporter off and on, long and native lengths, interleaved rounds
    cases = [("stretched", long), ("as traced", native)]
    times: dict[tuple[str, bool], list[float]] = {(name, on): [] for name, _ in cases for on in (False, True)}
    steps: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, requests in cases:
            for on in (False, True):
                reporter = SwaDivergenceReporter(args.interval, device="cpu") if on else None
                start_s = time.perf_counter()
                summary = replay(requests, config, reporter, num_threads=1)
                elapsed = time.perf_counter() - start_s
                if reporter is not None:
                    reporter.close()
                steps[name] = summary.forward_steps
                times[(name, on)].append(elapsed / summary.forward_steps * 1e3)
    print(f"\nms per forward step, median (min-max) of {args.rounds} interleaved rounds, torch 1 thread, no model")
    print(f"{'contexts':12s} {'steps':>6s}  {'reporter off':>22s}  {'reporter on':>22s}  on / off")
    for name, _ in cases:
        off, on = times[(name, False)], times[(name, True)]
        print(f"{name:12s} {steps[name]:6d}  {_cell(off):>22s}  {_cell(on):>22s}  "
              f"{statistics.median(on) / statistics.median(off):.2f}x")


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


if __name__ == "__main__":
    main()
