"""The vLLM adapter's arithmetic on block tables built by hand, without vLLM.

vLLM's real ``KVCacheManager`` and ``Scheduler`` drive the adapter in ``test_vllm_real.py``
(marker ``vllm``). This file covers what those runs cannot show: tables vLLM 0.33 never builds
(null entries outside the leading run, a second object flagged ``is_null``), malformed input, and
the tensor path from a block-id table, on every machine.

The blocks are plain objects with vLLM's two attributes (``block_id``, ``is_null``; the null block
is one shared object with id 0), in a ``SlidingWindowManager``-shaped holder (``req_to_blocks``,
a ``defaultdict`` as in vLLM, and ``block_size``). Expected values are recounts by plain loops
over the token positions.
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from otel_swa.record import Offender
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import vllm


class Block:
    __slots__ = ("block_id", "is_null")

    def __init__(self, block_id: int, is_null: bool = False) -> None:
        self.block_id, self.is_null = block_id, is_null


NULL = Block(0, True)


def manager(block_size: int, tables: dict) -> SimpleNamespace:
    return SimpleNamespace(block_size=block_size, req_to_blocks=defaultdict(list, tables))


def recount(req_to_blocks, request_ids, num_tokens, block_size) -> tuple[int, int, int]:
    """(live tokens, tokens in real blocks, tokens in null blocks), position by position."""
    live = held = out = 0
    for rid, n in zip(request_ids, num_tokens):
        for position in range(n):
            live += 1
            if req_to_blocks[rid][position // block_size].is_null:
                out += 1
            else:
                held += 1
    return live, held, out


def sample(view) -> "object":
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: records.append(r)])
    reporter.step(view)
    reporter.close()
    return records[0]


def test_num_skipped_tokens_is_vllm_0_33s_rule():
    # max(0, n - window + 1 - extra_retained_tokens), window 4
    assert [vllm.num_skipped_tokens(n, 4) for n in (0, 3, 4, 7, 10)] == [0, 0, 1, 4, 7]
    assert [vllm.num_skipped_tokens(n, 4, extra_retained_tokens=2) for n in (0, 3, 4, 7, 10)] == [0, 0, 0, 2, 5]
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        vllm.num_skipped_tokens(5, 0)
    with pytest.raises(ValueError, match="num_computed_tokens must be >= 0, got -1"):
        vllm.num_skipped_tokens(-1, 4)
    with pytest.raises(ValueError, match="extra_retained_tokens must be >= 0, got -2"):
        vllm.num_skipped_tokens(5, 4, extra_retained_tokens=-2)


def test_read_window_table_on_hand_built_tables():
    # block_size 4. a: 14 tokens in [null, null, 3, 4] -> 8 out, 6 held.
    # b: 9 tokens in [5, null, 6] (a null outside the leading run) -> 4 out, 5 held.
    # c: 3 tokens in [null] (the null block holds only 3 live tokens) -> 3 out.
    # d: 6 tokens in [null, 8, other-null, 9]: another object flagged is_null, beyond the tokens.
    other_null = Block(0, True)
    tables = {"a": [NULL, NULL, Block(3), Block(4)], "b": [Block(5), NULL, Block(6)], "c": [NULL],
              "d": [NULL, Block(8), other_null, Block(9)]}
    holder = manager(4, tables)
    ids, lens = ["a", "b", "c", "d"], [14, 9, 3, 6]
    table = vllm.read_window_table(holder, ids, lens)
    live, held, out = recount(tables, ids, lens, 4)
    assert (live, held, out) == (32, 13, 19)
    assert table.counts == vllm.WindowCounts(live_tokens=live, swa_entries=held, swa_out_of_window_tokens=out)
    assert table.counts.swa_full_idx_divergence is None
    assert table.null_heads == (2, 0, 1, 1) and table.other_nulls == ((1, 1),)
    record = sample(table.view())
    assert (record.swa_out_of_window_tokens, record.swa_full_idx_divergence) == (out, 0)
    assert record.divergence_applicable is False
    assert set(holder.req_to_blocks) == set(ids)  # read without inserting into the defaultdict


def test_the_every_step_read_counts_the_leading_null_run_only():
    # vLLM's tables (leading run only): the bisection alone gives the recount
    tables = {"a": [NULL, NULL, NULL, Block(3), Block(4)], "b": [Block(5), Block(6)], "c": [NULL]}
    ids, lens = ["a", "b", "c"], [19, 8, 2]
    fast = vllm.read_window_table(manager(4, tables), ids, lens, every_entry=False)
    live, held, out = recount(tables, ids, lens, 4)
    assert fast.counts == vllm.WindowCounts(live_tokens=live, swa_entries=held, swa_out_of_window_tokens=out)
    # a null entry after the run is not read by it; the full read at sampling steps counts it
    tables["b"] = [Block(5), NULL]
    assert vllm.read_window_table(manager(4, tables), ["b"], [8], every_entry=False).counts.swa_out_of_window_tokens == 0
    assert vllm.read_window_table(manager(4, tables), ["b"], [8]).counts.swa_out_of_window_tokens == 4


def test_a_head_of_distinct_null_objects_is_read_entry_by_entry():
    first, second = Block(0, True), Block(0, True)
    tables = {"r": [first, second, first, Block(7)]}
    table = vllm.read_window_table(manager(2, tables), ["r"], [8])
    assert table.counts.swa_out_of_window_tokens == recount(tables, ["r"], [8], 2)[2] == 6
    assert sample(table.view()).swa_out_of_window_tokens == 6


def test_read_window_table_rejects_what_it_cannot_read():
    holder = manager(4, {"a": [NULL, Block(2)]})
    with pytest.raises(KeyError, match="'zz' holds no blocks"):
        vllm.read_window_table(holder, ["zz"], [1])
    assert "zz" not in holder.req_to_blocks
    with pytest.raises(ValueError, match="request 'a' has 9 tokens but its SWA block table holds 2 blocks of 4"):
        vllm.read_window_table(holder, ["a"], [9])
    with pytest.raises(ValueError, match="1 request ids but 2 token counts"):
        vllm.read_window_table(holder, ["a"], [1, 2])
    with pytest.raises(ValueError, match="negative token count -1"):
        vllm.read_window_table(holder, ["a"], [-1])
    with pytest.raises(TypeError, match="has no req_to_blocks"):
        vllm.read_window_table(object(), ["a"], [1])
    with pytest.raises(TypeError, match=r"block_size must be an int >= 1, got 0"):
        vllm.read_window_table(SimpleNamespace(req_to_blocks={}, block_size=0), [], [])


def test_the_view_gathers_live_tokens_only_for_a_skewed_batch():
    tables = {"long": [NULL] * 30 + [Block(40), Block(41)], "short": [Block(50)], "other": [NULL]}
    holder = manager(4, tables)
    ids = ["long", "short", "other"]
    uniform = vllm.read_window_table(holder, ["long"], [126]).view()
    skewed = vllm.read_window_table(holder, ids, [126, 2, 3]).view()
    assert uniform.seq_lens_cpu is None  # a table as wide as its one request: the dense gather
    assert skewed.seq_lens_cpu == (126, 2, 3)  # 3 x 128 cells for 131 live tokens: the live gather
    assert sample(uniform).swa_out_of_window_tokens == 120
    assert sample(skewed).swa_out_of_window_tokens == recount(tables, ids, [126, 2, 3], 4)[2] == 123
    empty = vllm.read_window_table(holder, [], [])
    assert empty.counts == vllm.WindowCounts(0, 0, 0) and sample(empty.view()).swa_out_of_window_tokens == 0


def test_window_counts_on_a_hand_built_block_id_table():
    # block_size 4: request 0 has 10 tokens in [null, null, 7]: 8 out of window, 2 in;
    # request 1 has 5 tokens in [3, 9]: none out; request 2 has 3 tokens in [null] : 3 (clipped).
    table = torch.tensor([[0, 0, 7], [3, 9, 0], [0, 0, 0]], dtype=torch.int32)
    counts = vllm.window_counts(table, torch.tensor([10, 5, 3]), 4)
    assert counts == vllm.WindowCounts(live_tokens=18, swa_entries=7, swa_out_of_window_tokens=11)
    assert counts.swa_full_idx_divergence is None


def test_window_counts_rejects_bad_shapes():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        vllm.window_counts(torch.zeros((1, 2), dtype=torch.int32), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match=r"num_tokens must be \[batch\] with batch=2, got shape \(1,\)"):
        vllm.window_counts(torch.zeros((2, 2), dtype=torch.int32), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="has 9 tokens but the block table covers 2 blocks x 4 tokens"):
        vllm.window_counts(torch.zeros((1, 2), dtype=torch.int32), torch.tensor([9]), 4)


def test_block_table_from_manager_pads_with_the_null_block():
    holder = manager(4, {"a": [NULL, Block(2), Block(3)], "b": [Block(4)]})
    table = vllm.block_table_from_manager(holder, ["a", "b"])
    assert table.dtype == torch.int32 and table.tolist() == [[0, 2, 3], [4, 0, 0]]
    assert vllm.block_table_from_manager(holder, []).shape == (0, 1)
    with pytest.raises(KeyError, match="zz"):
        vllm.block_table_from_manager(holder, ["zz"])
    assert "zz" not in holder.req_to_blocks
    with pytest.raises(TypeError, match="req_to_blocks"):
        vllm.block_table_from_manager(object(), ["a"])


def test_block_mapping_is_built_once_per_pool_with_the_null_block_zeroed():
    table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
    tokens = torch.tensor([3, 4])
    first = vllm.batch_view(table, tokens, 2, num_blocks=4)
    second = vllm.batch_view(table[:1], tokens[:1], 2, num_blocks=4)
    assert second.full_to_swa_index_mapping is first.full_to_swa_index_mapping
    # view slot b + 1 for block b; the null block 0 (slot 1) and the reserved slot 0 map to 0
    assert first.full_to_swa_index_mapping.tolist() == [0, 0, 2, 3, 4]
    assert first.req_to_token.tolist() == [[2, 2, 1, 1], [3, 3, 4, 4]]
    other = vllm.batch_view(table, tokens, 2, num_blocks=4, null_block_id=2)
    assert other.full_to_swa_index_mapping.tolist() == [0, 1, 2, 0, 4]
    assert first.full_to_swa_index_mapping.tolist() == [0, 0, 2, 3, 4]  # untouched
    with pytest.raises(ValueError, match="null_block_id 4 is outside"):
        vllm.batch_view(table, tokens, 2, num_blocks=4, null_block_id=4)
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        vllm.block_mapping(0, 0, "cpu")


@pytest.mark.parametrize("block_size", [1, 4])
def test_both_paths_through_the_reporter_match_a_recount(block_size):
    """Random tables with null runs of every length, some with stray nulls after the run."""
    rng = random.Random(block_size)
    next_id = iter(range(1, 10**6))
    reporter_records = {"table": [], "tensor": []}
    reporters = {name: SwaDivergenceReporter(interval=3, sinks=[lambda r, c, name=name: reporter_records[name].append(r)])
                 for name in reporter_records}
    expected, totals = {}, [0, 0]
    for step in range(1, 121):
        tables, lens = {}, {}
        for i in range(rng.randint(0, 6)):
            n = rng.randint(0, 40)
            blocks = -(-n // block_size) + rng.randint(0, 2)
            head = rng.randint(0, blocks)
            row = [NULL] * head + [Block(next(next_id)) for _ in range(blocks - head)]
            if blocks > head and rng.random() < 0.2:
                row[rng.randrange(head, blocks)] = NULL
            tables[f"r{i}"], lens[f"r{i}"] = row, n
        ids = list(tables)
        num_tokens = [lens[r] for r in ids]
        live, held, out = recount(tables, ids, num_tokens, block_size)
        table = vllm.read_window_table(manager(block_size, tables), ids, num_tokens)
        assert table.counts == vllm.WindowCounts(live, held, out)
        ids_table = vllm.block_table_from_manager(manager(block_size, tables), ids)
        assert vllm.window_counts(ids_table, torch.tensor(num_tokens, dtype=torch.int64), block_size) == table.counts
        totals[0] += live
        totals[1] += held
        if step % 3 == 0:
            expected[step] = (totals[0], totals[1], 0, out)
        for name, reporter in reporters.items():
            vllm.observe_counts(reporter, table.counts)
        reporters["table"].step(table.view)
        num_blocks = max((b.block_id for row in tables.values() for b in row), default=0) + 1
        reporters["tensor"].step(lambda: vllm.batch_view(
            ids_table, torch.tensor(num_tokens, dtype=torch.int64), block_size, num_blocks=num_blocks,
            num_tokens_cpu=num_tokens))
    for reporter in reporters.values():
        reporter.close()
    for name, records in reporter_records.items():
        got = {r.forward_ct: (r.verify_full, r.verify_swa, r.swa_full_idx_divergence, r.swa_out_of_window_tokens)
               for r in records}
        assert got == expected, name
        assert all(r.divergence_applicable is False for r in records)
    assert max(out for *_, out in expected.values()) >= 1


# ------------------------------------------------------------------ the sliding-window check
def test_window_allowance_follows_vllms_trimming():
    # block 16, window 64; (n computed, s scheduled, f in flight) after schedule(): the table was
    # trimmed on n - f tokens, in whole blocks below n - f - 64 + 1 - extra; the step reads from
    # n - s - 64 + 1
    allowance = functools.partial(vllm.window_allowance, block_size=16, sliding_window=64)
    # synchronous decode: trimmed on 199 -> blocks below 136 freed (8 blocks: 128); reads from 136
    assert allowance([200], [1], [1]) == [136 - 128]
    # async: a step in flight: trimmed on 198 (freed below 128 still); 9 tokens in flight: on 190,
    # freed below 127 -> 112
    assert allowance([200, 200], [1, 1], [2, 10]) == [8, 136 - 112]
    # extra_retained_tokens 24: freed below 136 - 24 = 112
    assert allowance([200], [1], [1], extra_retained_tokens=24) == [24]
    # a prefill chunk of 128 after 128 tokens: trimmed on 128 (freed below 65 -> 64), reads from 65
    assert allowance([256], [128], [128]) == [1]
    # the first chunk: nothing read before position 0
    assert allowance([30], [30], [30]) == [0]
    assert vllm.window_allowance([40], [1], [1], block_size=1, sliding_window=8) == [0]
    with pytest.raises(ValueError, match="num_in_flight_tokens >= num_scheduled_tokens; got n=40, s=2, f=1"):
        allowance([40], [2], [1])
    with pytest.raises(ValueError, match="1 computed, 2 scheduled and 1 in-flight token counts"):
        allowance([40], [1, 1], [1])
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        vllm.window_allowance([1], [1], [1], block_size=0, sliding_window=8)
    with pytest.raises(ValueError, match="extra_retained_tokens must be an int >= 0, got -1"):
        allowance([1], [1], [1], extra_retained_tokens=-1)


def test_the_view_counts_null_blocks_in_the_window_and_real_blocks_past_it():
    # block 4: request "a" has 40 tokens in blocks [null, real, null(!), real, real, real, real, real, real, real]
    # (the null at block 2, positions 8..11, is inside the window of 32: positions 8..39)
    blocks = [NULL, Block(1), NULL, Block(3), Block(4), Block(5), Block(6), Block(7), Block(8), Block(9)]
    # request "b": 30 tokens, nothing freed: positions 0..29 real, window 32 covers all
    table = vllm.read_window_table(manager(4, {"a": blocks, "b": [Block(10 + i) for i in range(8)]}), ["a", "b"], [40, 30])
    record = sample(table.view(sliding_window=32, swa_eviction_allowance=[2, 0]))
    # premature: positions 8..11 of "a"; late-held: "a" below 40 - 32 - 2 = 6 with a real block:
    # positions 4, 5 (block 1); "b": none (30 < 32)
    assert (record.swa_premature_evictions, record.swa_late_held_slots) == (4, 2)
    # the first offender: "a" (entry 0) at position 8; no FULL slot named (vLLM's table holds block ids)
    (first,) = [o for o in record.offenders if o.fault == "swa_premature_evictions"]
    assert (first.row, first.position, first.full_slot, first.swa_slot) == (0, 8, None, None)
    assert sample(table.view()).swa_premature_evictions is None


def test_the_view_counts_the_window_of_a_chunk():
    # block 4, window 8: request "a" has 24 tokens, the last 12 (positions 12..23) scheduled in this
    # step (a prefill chunk); its first query, at 12, reads 5..12, so positions 5..23 are read.
    # Block 1 (positions 4..7) is null: positions 5, 6, 7 are premature; as one query (decode,
    # positions 16..23 read) none. Block 0 (positions 0..3) is real: with the allowance 3
    # (block_size - 1) the positions below 5 - 3 = 2, i.e. 0 and 1, are late-held.
    blocks = [Block(1), NULL, Block(3), Block(4), Block(5), Block(6)]
    table = vllm.read_window_table(manager(4, {"a": blocks}), ["a"], [24])
    record = sample(table.view(sliding_window=8, swa_eviction_allowance=[3], extend_lens_cpu=(12,)))
    assert (record.swa_premature_evictions, record.swa_late_held_slots) == (3, 2)
    decode = sample(table.view(sliding_window=8, swa_eviction_allowance=[3]))
    # below 16 - 3 = 13 with a real block: positions 0..3 and 8..12
    assert (decode.swa_premature_evictions, decode.swa_late_held_slots) == (0, 4 + 5)


# ------------------------------------------------------------------ the block pool: audit, usage
class PoolBlock:
    """vLLM's ``KVCacheBlock`` attributes the pool readers use."""

    def __init__(self, block_id: int, is_null: bool = False, block_hash: "bytes | None" = None) -> None:
        self.block_id, self.is_null, self.block_hash = block_id, is_null, block_hash
        self.next_free_block = None


class FullAttentionManager:
    def __init__(self, block_size, tables):
        self.block_size, self.req_to_blocks = block_size, defaultdict(list, tables)


class SlidingWindowManager(FullAttentionManager):
    pass


def group_hash(group: int, block_id: int = 7) -> bytes:
    """A ``BlockHashWithGroupId``: the hash bytes (one per block), then the group id in 4 bytes big-endian."""
    return bytes([block_id]) * 32 + group.to_bytes(4, "big")


def hand_built_cache(tables_full, tables_swa, free_ids, hashed=None, counted=None):
    """A ``KVCacheManager``-shaped holder: 10 blocks (0 the null block), the free queue a linked
    list between two sentinels in ``free_ids`` order (``num_free_blocks``: ``counted`` or its
    length), ``hashed``: block id -> group of its hash (those blocks are in the prefix cache, each
    under its own hash)."""
    hashed = hashed or {}
    blocks = [PoolBlock(i, is_null=i == 0, block_hash=group_hash(hashed[i], i) if i in hashed else None)
              for i in range(10)]
    head, tail = PoolBlock(-1), PoolBlock(-1)
    chain = [head] + [blocks[i] for i in free_ids] + [tail]
    for a, b in zip(chain, chain[1:]):
        a.next_free_block = b
    queue = SimpleNamespace(num_free_blocks=len(free_ids) if counted is None else counted,
                            fake_free_list_head=head, fake_free_list_tail=tail)
    pool = SimpleNamespace(blocks=blocks, num_gpu_blocks=10, free_block_queue=queue, cached_block_hashes_by_block={},
                           cached_block_hash_to_block=SimpleNamespace(_cache={
                               blocks[i].block_hash: blocks[i] for i in hashed}))
    as_blocks = lambda tables: {rid: [blocks[i] for i in ids] for rid, ids in tables.items()}  # noqa: E731
    managers = (FullAttentionManager(4, as_blocks(tables_full)), SlidingWindowManager(4, as_blocks(tables_swa)))
    return SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=managers, block_pool=pool)), blocks


def test_the_free_queue_is_walked_and_a_moving_one_refused():
    kv, blocks = hand_built_cache({}, {}, [6, 7, 8])
    pool = kv.coordinator.block_pool
    assert [b.block_id for b in vllm.free_queue(pool)] == [6, 7, 8]
    pool.free_block_queue.num_free_blocks = 2
    with pytest.raises(vllm.FreeQueueMoved, match="walked 3 free blocks, the queue counts 2"):
        vllm.free_queue(pool)
    blocks[8].next_free_block = blocks[6]  # a cycle
    with pytest.raises(vllm.FreeQueueMoved, match="did not end at its tail within 10 blocks"):
        vllm.free_queue(pool)
    with pytest.raises(TypeError, match="is not vLLM's BlockPool"):
        vllm.free_queue(object())


def test_pool_usage_counts_the_free_queue_and_puts_leaked_blocks_in_use():
    # block 4 tokens. full: a holds 1 2 3; swa: a holds [null, 4, 5] and b holds [8] (8 is also on
    # the free queue: freed while in use, free as vLLM counts it). Free queue 6 (cached, full
    # group), 7, 8. Block 9: in use and in no table (leaked): used, in full.
    kv, _ = hand_built_cache({"a": [1, 2, 3]}, {"a": [0, 4, 5], "b": [8]}, [6, 7, 8], hashed={6: 0})
    usages = {u.pool: (u.used, u.available, u.evictable, u.total) for u in vllm.kv_cache_pool_usage(kv)}
    assert usages == {"full": (4 * 4, 2 * 4, 1 * 4, 9 * 4), "swa": (2 * 4, 2 * 4, 0, 9 * 4)}
    # vLLM's get_usage(): 1 - free / (num_gpu_blocks - 1) = 1 - 3 / 9
    assert (usages["full"][0] + usages["swa"][0]) / (9 * 4) == pytest.approx(1 - 3 / 9)
    # a cached leaked block counts in the pool of its hash's group
    kv, _ = hand_built_cache({"a": [1, 2, 3]}, {"a": [0, 4, 5]}, [6, 7, 8], hashed={9: 1})
    assert {u.pool: u.used for u in vllm.kv_cache_pool_usage(kv)} == {"full": 3 * 4, "swa": 3 * 4}


def test_pool_usage_is_none_while_the_free_queue_keeps_moving():
    kv, _ = hand_built_cache({"a": [1]}, {}, [6, 7, 8], counted=4)
    assert vllm.kv_cache_pool_usage(kv) is None


def test_block_audit_inputs_from_a_hand_built_cache():
    kv, _ = hand_built_cache({"a": [1, 2, 3], "b": [9]}, {"a": [0, 0, 4, 5], "c": []}, [6, 7, 8], hashed={6: 0, 2: 0})
    inputs = vllm.kv_block_audit_inputs(kv)
    assert (inputs.num_blocks, inputs.null_block_id) == (10, 0)
    assert inputs.free_block_ids.tolist() == [6, 7, 8]
    assert sorted(inputs.cached_block_ids.tolist()) == [2, 6]
    # group 0 (block size 4): a's entries at positions 0, 4, 8, b's at 0; group 1: a's real entries 2, 3
    assert inputs.held_block_ids.tolist() == [1, 2, 3, 9, 4, 5]
    assert inputs.held_groups.tolist() == [0, 0, 0, 0, 1, 1]
    assert [inputs.held_request_ids[r] for r in inputs.held_rows.tolist()] == ["a", "a", "a", "b", "a", "a"]
    assert inputs.held_positions.tolist() == [0, 4, 8, 0, 8, 12]
    assert tuple(inputs.held_request_ids) == ("a", "b")  # c holds no block
    # through the reporter: nothing leaked, nothing free that a table holds
    record = sample(vllm.read_window_table(kv.coordinator.single_type_managers[1], ["a"], [16]).view(kv_block_audit=inputs))
    assert (record.kv_leaked_blocks, record.kv_freed_blocks_in_use, record.offenders) == (0, 0, ())
    # block 9 in no table: leaked; block 8 free while c's sliding-window table holds it
    kv, _ = hand_built_cache({"a": [1, 2, 3]}, {"a": [0, 0, 4, 5], "c": [0, 8]}, [6, 7, 8], hashed={6: 0, 2: 0})
    inputs = vllm.kv_block_audit_inputs(kv)
    record = sample(vllm.read_window_table(kv.coordinator.single_type_managers[1], ["a"], [16]).view(kv_block_audit=inputs))
    assert (record.kv_leaked_blocks, record.kv_freed_blocks_in_use) == (1, 1)
    assert record.offenders == (Offender("kv_leaked_blocks", block=9),
                                Offender("kv_freed_blocks_in_use", request="c", position=4, block=8, kv_cache_group=1))


def test_a_stale_prefix_cache_entry_does_not_make_its_block_cached():
    """Block 2 has no hash (evicted) and the tables of a and b both hold it; the map still names it
    under its old key (a stale entry). It is not cached for the audit, so the two tables sharing it
    are a fault, as without the entry; a good entry (the block's own hash) would excuse it."""
    kv, blocks = hand_built_cache({"a": [1, 2], "b": [2]}, {}, [6, 7, 8])
    cache = kv.coordinator.block_pool.cached_block_hash_to_block._cache
    cache[group_hash(0, 2)] = blocks[2]  # stale: the block's own hash is None
    inputs = vllm.kv_block_audit_inputs(kv)
    assert inputs.cached_block_ids.tolist() == []
    record = sample(vllm.read_window_table(kv.coordinator.single_type_managers[1], [], []).view(kv_block_audit=inputs))
    assert record.kv_shared_blocks == 1
    assert record.offender("kv_shared_blocks").block == 2
    blocks[2].block_hash = group_hash(0, 2)  # now a good entry: a prefix-cache hit shares it
    inputs = vllm.kv_block_audit_inputs(kv)
    assert inputs.cached_block_ids.tolist() == [2]
    record = sample(vllm.read_window_table(kv.coordinator.single_type_managers[1], [], []).view(kv_block_audit=inputs))
    assert record.kv_shared_blocks == 0
