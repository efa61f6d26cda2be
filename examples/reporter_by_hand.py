"""The reporter's calls, by hand, in an engine loop: observe() in the forward, step() after it.

The KV cache here is the reference engine's pools (otel_swa.reference.pools.HybridKVPools: a FULL
and an SWA pool, ``req_to_token``, ``full_to_swa_index_mapping``, window eviction); the forward is
left out. Four requests decode side by side with a 16-token window and a small SWA pool, so SWA
slots are freed and reused and divergence appears. Each record is printed as SGLang's line.

    python examples/reporter_by_hand.py
    python examples/reporter_by_hand.py | otel-swa check -
"""

from __future__ import annotations

import torch

from otel_swa.reference.pools import HybridKVPools
from otel_swa.reporter import KVPool, SwaDivergenceReporter
from otel_swa.views import SwaBatch

WINDOW = 16
PROMPTS = [40, 25, 33, 18]
DECODE_STEPS = 48


def main() -> int:
    pools = HybridKVPools(full_size=1024, swa_size=160, page_size=1, max_running=4, max_context_len=128)
    reporter = SwaDivergenceReporter(8, sinks=[lambda record, context: print(record.format())])
    requests = [pools.open_request() for _ in PROMPTS]
    extend = list(PROMPTS)  # the first forward prefills the prompts, the later ones decode one token each
    for _ in range(1 + DECODE_STEPS):
        pools.extend(list(zip(requests, extend)))
        seq_lens = [req.seq_len for req in requests]

        # --- inside the forward: what each attention layer read (graph-safe device adds) ---
        reporter.observe(KVPool.FULL, sum(seq_lens))
        reporter.observe(KVPool.SWA, sum(min(n, WINDOW + e - 1) for n, e in zip(seq_lens, extend)))

        # --- once per forward step, after it: the batch as the forward used it ---
        reporter.step(
            SwaBatch(
                req_to_token=pools.req_to_token,
                full_to_swa_index_mapping=pools.full_to_swa_index_mapping,
                req_pool_indices=torch.tensor([req.row for req in requests]),
                seq_lens=torch.tensor(seq_lens),
                seq_lens_cpu=seq_lens,
            )
        )

        # --- after the step: tokens that left the window give their SWA slots back ---
        pools.evict_out_of_window(requests, WINDOW)
        extend = [1] * len(requests)
    reporter.close()  # delivers the last sample
    stats = reporter.stats
    print(f"# forward steps {reporter.forward_ct}, samples delivered {stats.samples_delivered}/{stats.samples_taken}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
