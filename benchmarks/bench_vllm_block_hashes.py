"""Per-sample cost of the block-hash provenance check (``otel_swa.views.vllm_block_hashes``) beside
the rest of a vLLM sampling step, on one real vLLM ``BlockPool`` with prefix caching on.

For each shape (requests x tokens per request): every request has a full-attention table of
``ceil(tokens / block_size)`` blocks and a sliding-window table (``window``) whose skipped head is
the null block, both cached by vLLM's own ``BlockPool.cache_full_blocks`` under the requests' real
block hashes (vLLM's ``hash_block_tokens`` with SHA-256, chained per block); the map then holds one
entry per cached block. Variants, interleaved round by round (torch on one thread):

* ``check, whole``: :func:`~otel_swa.views.vllm_block_hashes.block_hash_findings` (every map entry,
  every table entry: no budget);
* ``check, budget B``: one sample of a :class:`~otel_swa.views.vllm_block_hashes.BlockHashCheck`
  with budget ``B``, in steady state (the samples that copy the keys at a pass's start included, in
  their share);
* ``sampling step without it``: what the instrumentor does at a sampling step besides the check:
  the full read of the sliding-window tables, the KV block audit's inputs and the reporter's sample.

The table gives the median and the spread (min - max) over the rounds in milliseconds, the ratio to
the sampling step without the check (round by round), and the samples one pass takes (``ceil(M / B)`` for the map,
about ``ceil(E / B)`` for the tables: a stale entry or a foreign block that stays is counted within
two passes).

Needs vLLM (the suite's ``.venv-vllm``). Run:
``python benchmarks/bench_vllm_block_hashes.py [--rounds 15] [--window 1024] [--budgets 1024 4096]``
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, ratios, timed  # noqa: E402

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import vllm as vllm_view
from otel_swa.views.vllm_block_hashes import BlockHashCheck, block_hash_findings

SHAPES = ((64, 2048), (256, 8192))


def cached_pool(batch: int, tokens: int, window: int, block_size: int):
    """``(kv_cache_manager, swa_manager, requests)`` over one real ``BlockPool`` (prefix caching on)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256)
    per_request = tokens // block_size
    skipped = max(0, tokens - window + 1) // block_size
    held = batch * (2 * per_request - skipped)
    pool = BlockPool(held + held // 19 + 1, True, block_size)
    full, swa, requests = {}, {}, {}
    for i in range(batch):
        rid = f"req-{i}"
        ids = [(i * 131 + 17 * t) % 30000 for t in range(tokens)]
        hashes, parent = [], None
        for j in range(per_request):
            parent = hash_block_tokens(sha256, parent, ids[j * block_size:(j + 1) * block_size])
            hashes.append(parent)
        request = SimpleNamespace(request_id=rid, block_hashes=hashes)
        requests[rid] = request
        full[rid] = pool.get_new_blocks(per_request)
        swa[rid] = [pool.null_block] * skipped + pool.get_new_blocks(per_request - skipped)
        pool.cache_full_blocks(request, full[rid], 0, per_request, block_size, 0)
        pool.cache_full_blocks(request, swa[rid], 0, per_request, block_size, 1)
    managers = (type("FullAttentionManager", (SimpleNamespace,), {})(req_to_blocks=full, block_size=block_size,
                                                                     kv_cache_group_id=0),
                type("SlidingWindowManager", (SimpleNamespace,), {})(req_to_blocks=swa, block_size=block_size,
                                                                      sliding_window=window, kv_cache_group_id=1))
    kv = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=managers, block_pool=pool))
    return kv, managers[1], requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args()
    one_thread()
    print(machine_line())
    print(f"window={args.window} block_size={args.block_size} rounds={args.rounds} "
          "(vLLM KVCacheBlock / BlockPool, SHA-256 block hashes)\n")
    for batch, tokens in SHAPES:
        kv, swa, requests = cached_pool(batch, tokens, args.window, args.block_size)
        ids, lens = list(requests), [tokens] * batch
        whole = block_hash_findings(kv, requests)
        assert (whole.stale_entries, whole.foreign_blocks) == (0, 0), whole
        map_entries = len(kv.coordinator.block_pool.cached_block_hash_to_block)
        table_entries = sum(len(t) for m in kv.coordinator.single_type_managers for t in m.req_to_blocks.values())
        reporter = SwaDivergenceReporter(1)
        step = "sampling step without it"
        variants = {
            step: timed(lambda: reporter.step(lambda: vllm_view.read_window_table(swa, ids, lens).view(
                kv_block_audit=vllm_view.kv_block_audit_inputs(kv)))),
            "check, whole": timed(lambda: block_hash_findings(kv, requests)),
        }
        passes = {step: "", "check, whole": "1 / 1"}
        for budget in args.budgets:
            check = BlockHashCheck(budget)
            variants[f"check, budget {budget}"] = timed(lambda check=check: check.check(kv, requests))
            passes[f"check, budget {budget}"] = f"{math.ceil(map_entries / budget)} / {math.ceil(table_entries / budget)}"
        times = interleaved(variants, args.rounds)
        reporter.close()
        rows = [(name, fmt(values, 1e3), fmt(ratios(values, times[step])), passes[name]) for name, values in times.items()]
        print_table(f"{batch} x {tokens}: map entries {map_entries}, table entries {table_entries} "
                    f"(compared: {whole.entries_checked})",
                    ("variant", "ms median (min - max)", "x step", "samples a pass (map / tables)"), rows)


if __name__ == "__main__":
    main()
