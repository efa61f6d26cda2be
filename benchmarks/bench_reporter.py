"""Cost of the reporter on the engine's side, per call, on this machine's device.

Prints microseconds per call (median of repeats) for:

* ``observe`` (in-place device add), and a non-sampling ``step``;
* one sampling ``step`` with the live-token gather (``seq_lens_cpu`` given) and with the dense
  masked gather, for a batch whose requests are short compared with ``max_context_len``;
* the same sample done the way SGLang's reporter does it: dense gather over
  ``[batch, max_context_len]``, a fresh host tensor per sample, and a blocking wait at delivery.

Run: ``python benchmarks/bench_reporter.py [--device cuda] [--batch 64] [--width 32768] [--live 512]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from otel_swa.device import KVPool
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import SwaBatch


def median_us(fn, repeats: int, number: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        times.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(times)


def build_view(batch: int, width: int, live: int, device: torch.device, host_lens: bool) -> SwaBatch:
    gen = torch.Generator().manual_seed(0)
    full_size = batch * width + 1
    req_to_token = torch.zeros(batch + 1, width, dtype=torch.int32)
    for row in range(1, batch + 1):
        req_to_token[row] = torch.randint(1, full_size, (width,), generator=gen, dtype=torch.int32)
    mapping = torch.randint(0, full_size, (full_size,), generator=gen, dtype=torch.int64)
    mapping[0] = 0
    seq_lens = torch.randint(live // 2, live + 1, (batch,), generator=gen, dtype=torch.int32)
    return SwaBatch(
        req_to_token.to(device),
        mapping.to(device),
        torch.arange(1, batch + 1, dtype=torch.int64, device=device),
        seq_lens.to(device),
        seq_lens.tolist() if host_lens else None,
    )


def sglang_style_sample(view: SwaBatch, totals: torch.Tensor) -> list[int]:
    """Dense gather, fresh host allocation, blocking read: the anchor's per-sample work."""
    width = view.req_to_token.shape[1]
    rows = view.req_to_token[view.req_pool_indices.long()].long()
    mask = torch.arange(width, device=rows.device)[None, :] < view.seq_lens.long()[:, None]
    swa = view.full_to_swa_index_mapping[rows]
    divergence = ((swa != 0) & (swa != rows) & mask).sum()
    out_of_window = ((swa == 0) & mask).sum()
    staged = torch.stack([totals[0], totals[1], divergence, out_of_window])
    pin = staged.device.type == "cuda"
    host = torch.empty(4, dtype=torch.int64, pin_memory=pin)
    host.copy_(staged, non_blocking=pin)
    if pin:
        torch.cuda.synchronize()
    return host.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=8192, help="max_context_len of req_to_token")
    parser.add_argument("--live", type=int, default=512, help="upper bound of each request's seq_len")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads on CPU (default 1: on a small shared machine, OpenMP workers "
        "waiting for a busy core dominate the figures otherwise)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} batch={args.batch} max_context_len={args.width} live<={args.live}")

    reporter = SwaDivergenceReporter(10**9, device=device)
    one = torch.tensor(1, device=device)
    view_live = build_view(args.batch, args.width, args.live, device, host_lens=True)
    view_dense = build_view(args.batch, args.width, args.live, device, host_lens=False)
    rows = [
        ("observe(pool, python int)", lambda: reporter.observe(KVPool.FULL, 3), 2000),
        ("observe(pool, 0-dim device tensor)", lambda: reporter.observe(KVPool.SWA, one), 2000),
        ("step, non-sampling", lambda: reporter.step(view_live), 2000),
    ]
    sampler_live = SwaDivergenceReporter(1, device=device, ring_size=8)
    sampler_dense = SwaDivergenceReporter(1, device=device, ring_size=8)

    def sample_and_drain(rep, view):
        rep.step(view)
        if rep.stats.pending >= 4:
            rep.flush()

    rows += [
        ("sampling step, live-token gather (ours)", lambda: sample_and_drain(sampler_live, view_live), 50),
        ("sampling step, dense masked gather (ours)", lambda: sample_and_drain(sampler_dense, view_dense), 50),
        ("sample as SGLang does (dense, fresh alloc, blocking)", lambda: sglang_style_sample(view_dense, reporter.totals), 50),
    ]
    width = max(len(name) for name, _, _ in rows)
    print(f"{'operation':<{width}}  us/call (median of {args.repeats})")
    for name, fn, number in rows:
        fn()  # warm-up
        print(f"{name:<{width}}  {median_us(fn, args.repeats, number, sync):10.2f}")


if __name__ == "__main__":
    main()
