"""Per-sample cost of the reporter with the vLLM view, before and after, beside the SGLang view.

For each shape (requests x tokens per request), one sampling ``reporter.step`` (interval 1, CPU)
over a batch of that shape, three ways:

* ``vllm before``: the view as otel-swa 0.1.0 built it: the block ids read into a Python list per
  request, one tensor per row, then a token-slot table ``[batch, max_blocks * block_size]`` and a
  slot mapping of ``num_blocks * block_size + 1`` entries (the code is kept below for this
  comparison);
* ``vllm after``: :func:`otel_swa.views.vllm.read_window_table` (each block table read once, the
  same read the instrumentor makes for ``observe`` at every step) and its
  :meth:`~otel_swa.views.vllm.WindowTable.view`;
* ``sglang (reference)``: :func:`otel_swa.views.sglang.batch_view` over an SGLang-shaped allocator
  (``req_to_token`` int32, ``full_to_swa_index_mapping`` int64) holding the same tokens.

Also ``vllm read, every step``: the host cost the instrumentor pays at every scheduled step (not
only at sampling steps) for the entries held: ``read_window_table(..., every_entry=False)``, the
leading null run of each table; and ``vllm read, sampled``: the full read of a sampling step
(every entry checked), without the reporter.

With vLLM installed, three more over one real ``BlockPool`` holding a full-attention table
(every block of each request) and the sliding-window table above for every request, 5 % of the
pool free: ``vllm after + block audit``, the sampling step the instrumentor takes (the view with
the KV block audit's inputs, :func:`otel_swa.views.vllm.kv_block_audit_inputs`); ``block audit
inputs``, that host read alone; and ``pool usage read``, :func:`otel_swa.views.vllm.kv_cache_pool_usage`
as a metric collection calls it (off the step).

The block tables are vLLM's: real ``KVCacheBlock`` objects from a real ``BlockPool`` when vLLM
imports, else plain objects with the same two attributes (``block_id``, ``is_null``; the
printout says which). Each request of ``n`` tokens has ``ceil(n / block_size)`` blocks, the first
``(n - window + 1) // block_size`` of them the null block, as vLLM leaves them.

Rounds are interleaved (every variant once per round, in turn), torch runs on one thread; the
table gives the median and the spread (min - max) over the rounds, in milliseconds.

Run: ``python benchmarks/bench_vllm_view.py [--rounds 15] [--window 1024] [--block-size 16]``
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from types import SimpleNamespace

import torch

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import SwaBatch
from otel_swa.views import sglang as sglang_view
from otel_swa.views import vllm as vllm_view

SHAPES = ((64, 2048), (256, 8192))


# ---------------------------------------------------------------------- the 0.1.0 view, for "before"
@functools.lru_cache(maxsize=8)
def _before_slot_mapping(num_blocks: int, block_size: int, null_block_id: int) -> torch.Tensor:
    mapping = torch.arange(num_blocks * block_size + 1, dtype=torch.int64)
    start = null_block_id * block_size + 1
    mapping[0] = 0
    mapping[start : start + block_size] = 0
    return mapping


def before_view(manager, request_ids, num_tokens, num_blocks: int) -> SwaBatch:
    rows = [[int(block.block_id) for block in manager.req_to_blocks[rid]] for rid in request_ids]
    table = torch.full((len(rows), max(max(len(r) for r in rows), 1)), 0, dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    bs = manager.block_size
    batch, max_blocks = table.shape
    slots = (table.long().unsqueeze(2) * bs + torch.arange(bs)).reshape(batch, max_blocks * bs)
    return SwaBatch(
        req_to_token=slots + 1,
        full_to_swa_index_mapping=_before_slot_mapping(num_blocks, bs, 0),
        req_pool_indices=torch.arange(batch, dtype=torch.int64),
        seq_lens=torch.tensor(num_tokens, dtype=torch.int64),
        seq_lens_cpu=num_tokens,
        divergence_applicable=False,
    )


# ---------------------------------------------------------------------- the batches
def block_source():
    """``(make_blocks(count) -> list, null_block, label)``: vLLM's own blocks when it imports."""
    try:
        from vllm.v1.core.block_pool import BlockPool
    except Exception:
        class Block:
            __slots__ = ("block_id", "is_null")

            def __init__(self, block_id: int, is_null: bool = False) -> None:
                self.block_id, self.is_null = block_id, is_null

        counter = iter(range(1, 1 << 62))
        return (lambda count: [Block(next(counter)) for _ in range(count)]), Block(0, True), "stand-in blocks"
    pools = []

    def make(count: int) -> list:
        pool = BlockPool(count + 1, False, 16)
        pools.append(pool)
        return pool.get_new_blocks(count)

    null = BlockPool(2, False, 16).null_block
    return make, null, "vLLM KVCacheBlock / BlockPool"


def vllm_batch(batch: int, tokens: int, window: int, block_size: int, make_blocks, null):
    per_request = -(-tokens // block_size)
    skipped = max(0, tokens - window + 1) // block_size
    req_to_blocks = {}
    for i in range(batch):
        blocks = make_blocks(per_request)
        blocks[:skipped] = [null] * skipped
        req_to_blocks[f"req-{i}"] = blocks
    manager = SimpleNamespace(req_to_blocks=req_to_blocks, block_size=block_size, sliding_window=window)
    num_blocks = 1 + max(block.block_id for blocks in req_to_blocks.values() for block in blocks)
    return manager, list(req_to_blocks), [tokens] * batch, num_blocks


def vllm_cache(batch: int, tokens: int, window: int, block_size: int):
    """A ``KVCacheManager``-shaped holder over one real ``BlockPool`` (vLLM only): per request a
    full-attention table of ``ceil(tokens / block_size)`` blocks and the sliding-window table of
    :func:`vllm_batch`, 5 % of the pool left free. Returns ``(kv_cache_manager, swa_manager, ids)``."""
    from vllm.v1.core.block_pool import BlockPool

    per_request = -(-tokens // block_size)
    skipped = max(0, tokens - window + 1) // block_size
    held = batch * (2 * per_request - skipped)
    pool = BlockPool(held + held // 19 + 1, False, 16)
    full, swa = {}, {}
    for i in range(batch):
        full[f"req-{i}"] = pool.get_new_blocks(per_request)
        swa[f"req-{i}"] = [pool.null_block] * skipped + pool.get_new_blocks(per_request - skipped)
    managers = (type("FullAttentionManager", (SimpleNamespace,), {})(req_to_blocks=full, block_size=block_size),
                type("SlidingWindowManager", (SimpleNamespace,), {})(req_to_blocks=swa, block_size=block_size,
                                                                      sliding_window=window))
    kv = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=managers, block_pool=pool))
    return kv, managers[1], list(full)


def sglang_batch(batch: int, tokens: int, held_from: int):
    gen = torch.Generator().manual_seed(0)
    full_slots = batch * tokens
    req_to_token = torch.zeros(batch + 1, tokens, dtype=torch.int32)
    req_to_token[1:] = (torch.randperm(full_slots, generator=gen) + 1).to(torch.int32).reshape(batch, tokens)
    mapping = torch.zeros(full_slots + 2, dtype=torch.int64)
    in_window = req_to_token[1:, held_from:].reshape(-1).long()  # the tokens vLLM's table still holds
    mapping[in_window] = in_window
    allocator = SimpleNamespace(full_to_swa_index_mapping=mapping)
    forward_batch = SimpleNamespace(
        req_pool_indices=torch.arange(1, batch + 1, dtype=torch.int64),
        seq_lens=torch.full((batch,), tokens, dtype=torch.int64),
        seq_lens_cpu=[tokens] * batch,
    )
    return allocator, SimpleNamespace(req_to_token=req_to_token), forward_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    make_blocks, null, label = block_source()
    print(f"torch={torch.__version__} threads={torch.get_num_threads()} window={args.window} "
          f"block_size={args.block_size} rounds={args.rounds} ({label})")

    header = f"{'requests x tokens':<18} {'variant':<25} {'median ms':>10} {'min - max ms':>17}"
    print(header)
    print("-" * len(header))
    for batch, tokens in SHAPES:
        manager, ids, lens, num_blocks = vllm_batch(batch, tokens, args.window, args.block_size, make_blocks, null)
        skipped = max(0, tokens - args.window + 1) // args.block_size
        allocator, pool, forward_batch = sglang_batch(batch, tokens, skipped * args.block_size)
        reporters = {}

        def sample(name, view_factory):
            reporter = reporters.setdefault(name, SwaDivergenceReporter(1))
            reporter.step(view_factory)

        variants = {
            "vllm before": lambda: sample("before", lambda: before_view(manager, ids, lens, num_blocks)),
            "vllm after": lambda: sample("after", vllm_view.read_window_table(manager, ids, lens).view),
            "vllm read, every step": lambda: vllm_view.read_window_table(manager, ids, lens, every_entry=False),
            "vllm read, sampled": lambda: vllm_view.read_window_table(manager, ids, lens),
            "sglang (reference)": lambda: sample("sglang", lambda: sglang_view.batch_view(allocator, pool, forward_batch)),
        }
        if label.startswith("vLLM"):
            kv, swa, cache_ids = vllm_cache(batch, tokens, args.window, args.block_size)
            variants["vllm after + block audit"] = lambda: sample("audit", lambda: vllm_view.read_window_table(
                swa, cache_ids, lens).view(kv_block_audit=vllm_view.kv_block_audit_inputs(kv)))
            variants["block audit inputs"] = lambda: vllm_view.kv_block_audit_inputs(kv)
            variants["pool usage read"] = lambda: vllm_view.kv_cache_pool_usage(kv)
        counts = vllm_view.read_window_table(manager, ids, lens).counts
        assert counts.swa_out_of_window_tokens == batch * skipped * args.block_size, counts
        assert vllm_view.read_window_table(manager, ids, lens, every_entry=False).counts == counts
        times = {name: [] for name in variants}
        for fn in variants.values():
            fn()  # warm-up (and the cached mappings)
        for _ in range(args.rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        for name, values in times.items():
            print(f"{f'{batch} x {tokens}':<18} {name:<25} {statistics.median(values):>10.2f} "
                  f"{min(values):>8.2f} - {max(values):>6.2f}")
        records = {}
        for name, reporter in reporters.items():
            reporter.close()
        if label.startswith("vLLM"):  # the audited sample: nothing leaked, nothing freed in use
            rep = SwaDivergenceReporter(1, sinks=[lambda r, c: records.__setitem__("audit", r)])
            rep.step(vllm_view.read_window_table(swa, cache_ids, lens).view(kv_block_audit=vllm_view.kv_block_audit_inputs(kv)))
            rep.close()
            audited = records.pop("audit")
            assert (audited.kv_leaked_blocks, audited.kv_freed_blocks_in_use) == (0, 0), audited
            print(f"{'':<18} block audit: {len(kv.coordinator.block_pool.blocks)} blocks, "
                  f"{kv.coordinator.block_pool.get_num_free_blocks()} free, leaked 0, freed in use 0")
        # the three sampled views agree on what they measured
        for name in ("before", "after", "sglang"):
            rep = SwaDivergenceReporter(1, sinks=[lambda r, c, name=name: records.__setitem__(name, r)])
            factory = {
                "before": lambda: before_view(manager, ids, lens, num_blocks),
                "after": vllm_view.read_window_table(manager, ids, lens).view,
                "sglang": lambda: sglang_view.batch_view(allocator, pool, forward_batch),
            }[name]
            rep.step(factory)
            rep.close()
        oow = {name: r.swa_out_of_window_tokens for name, r in records.items()}
        print(f"{'':<18} out-of-window tokens counted: {oow}")


if __name__ == "__main__":
    main()
