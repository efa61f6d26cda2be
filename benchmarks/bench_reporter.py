"""Cost of the reporter on the engine's side, per call, on this machine's device.

Prints microseconds per call (median over interleaved rounds, spread min - max; torch on one thread):

* ``observe`` with a Python int (added on the host) and with a 0-dim device tensor (an in-place
  device add), and a non-sampling ``step``;
* one sampling ``step`` (with its flush) over a batch whose requests are short compared with
  ``max_context_len``: with ``seq_lens_cpu`` and ``req_pool_indices_cpu`` (the live gather), and
  without host lengths (the whole-row gather, masked);
* the same sample done the way SGLang's reporter does it: the dense rows and their mapping gathered
  once per count, a fresh host tensor per sample, and a blocking read.

Run: ``python benchmarks/bench_reporter.py [--device cuda] [--batch 64] [--width 8192] [--live 512] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, timed  # noqa: E402
from bench_sample import sglang_two_pass  # noqa: E402

from otel_swa.device import KVPool  # noqa: E402
from otel_swa.reporter import SwaDivergenceReporter  # noqa: E402
from otel_swa.views import SwaBatch  # noqa: E402


def build_view(batch: int, width: int, live: int, device: torch.device, host: bool) -> SwaBatch:
    gen = torch.Generator().manual_seed(0)
    full_size = batch * width + 1
    req_to_token = torch.zeros(batch + 1, width, dtype=torch.int32)
    for row in range(1, batch + 1):
        req_to_token[row] = torch.randint(1, full_size, (width,), generator=gen, dtype=torch.int32)
    mapping = torch.randint(0, full_size, (full_size,), generator=gen, dtype=torch.int64)
    mapping[0] = 0
    seq_lens = torch.randint(live // 2, live + 1, (batch,), generator=gen, dtype=torch.int32)
    rows = list(range(1, batch + 1))
    return SwaBatch(
        req_to_token.to(device), mapping.to(device), torch.tensor(rows, device=device), seq_lens.to(device),
        seq_lens.tolist() if host else None, req_pool_indices_cpu=rows if host else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=8192, help="max_context_len of req_to_token")
    parser.add_argument("--live", type=int, default=512, help="upper bound of each request's seq_len")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    one_thread()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(machine_line())
    print(f"device {device}, batch {args.batch}, max_context_len {args.width}, live <= {args.live}; "
          f"{args.rounds} rounds interleaved, median (min - max)\n")

    reporter = SwaDivergenceReporter(10**9, device=device)
    one = torch.tensor(1, device=device)
    view_live = build_view(args.batch, args.width, args.live, device, host=True)
    view_dense = build_view(args.batch, args.width, args.live, device, host=False)
    sampler_live = SwaDivergenceReporter(1, device=device, ring_size=8)
    sampler_dense = SwaDivergenceReporter(1, device=device, ring_size=8)

    def sample(rep, view):
        rep.step(view)
        rep.flush()

    totals = torch.zeros(2, dtype=torch.int64, device=device)
    rows = view_dense.req_pool_indices
    variants = {
        "observe(pool, python int)": timed(lambda: reporter.observe(KVPool.FULL, 3), 2000, sync),
        "observe(pool, 0-dim device tensor)": timed(lambda: reporter.observe(KVPool.SWA, one), 2000, sync),
        "step, non-sampling": timed(lambda: reporter.step(view_live), 2000, sync),
        "sampling step, live gather (host lengths and rows)": timed(lambda: sample(sampler_live, view_live), 20, sync),
        "sampling step, whole rows masked (no host lengths)": timed(lambda: sample(sampler_dense, view_dense), 5, sync),
        "sample as SGLang does (dense twice, fresh alloc, blocking)": timed(
            lambda: sglang_two_pass(view_dense.req_to_token, view_dense.full_to_swa_index_mapping, rows, view_dense.seq_lens, totals), 5, sync),
    }
    got = interleaved(variants, args.rounds)
    print_table("reporter calls (us per call)", ("operation", "us / call"), [(name, fmt(v, 1e6, 2)) for name, v in got.items()])


if __name__ == "__main__":
    main()
