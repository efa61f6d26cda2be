"""Host work of one sampling step, as a whole process's CPU time: a small batch (8 requests of about
100 tokens) sampled at every forward step (interval 1) with the checks that need no model (the
window check and the SWA slot audit, fused into the core pass) and a sink that drops the records,
3,000 steps after 50 of warm-up. The device work is small here, so the figure is mostly the host's:
the sample's staging, the delivery and the record built from every check's part.

Compare two revisions with ``farm-bench`` (whole processes, run in turn, the ratio taken pair by pair)::

    farm-bench -n 9 --vs "sh -c 'PYTHONPATH=<other checkout>:<other checkout>/instrumentation exec python benchmarks/bench_sample_host.py'" -- python benchmarks/bench_sample_host.py

Prints the CPU microseconds per sampling step of this process.
"""

from __future__ import annotations

import time

import torch

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import SwaBatch
from otel_swa.views.base import SwaAuditInputs

BATCH, WIDTH, STEPS, WARMUP = 8, 128, 3000, 50


def main() -> None:
    torch.set_num_threads(1)
    req_to_token = torch.zeros(BATCH + 1, WIDTH, dtype=torch.int32)
    for i in range(BATCH):
        req_to_token[i + 1] = torch.arange(1 + i * WIDTH, 1 + (i + 1) * WIDTH, dtype=torch.int32)
    size = (BATCH + 1) * WIDTH + 2
    mapping = torch.arange(size, dtype=torch.int64)
    mapping[:40] = 0  # the oldest tokens of the first request left the window
    lens = [100 - i for i in range(BATCH)]
    rows = list(range(1, BATCH + 1))
    audit = SwaAuditInputs(torch.arange(size - 1, size), size - 1, 1, torch.zeros(0, dtype=torch.int64),
                           holders_include_batch=True)
    view = SwaBatch(req_to_token, mapping, torch.tensor(rows), torch.tensor(lens), seq_lens_cpu=lens,
                    req_pool_indices_cpu=rows, sliding_window=16, request_ids=[str(r) for r in rows], swa_audit=audit)
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: None])
    for _ in range(WARMUP):
        reporter.step(view)
    start = time.process_time()
    for _ in range(STEPS):
        reporter.step(view)
    reporter.close()
    print(f"{(time.process_time() - start) / STEPS * 1e6:.1f} us CPU per sampling step")


if __name__ == "__main__":
    main()
