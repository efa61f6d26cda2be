"""The vLLM adapter against a stand-in of vLLM's v1 sliding-window structures.

The stand-in follows vLLM's documented behaviour (``vllm/v1/core/block_pool.py``,
``single_type_kv_cache_manager.py``): a ``BlockPool`` whose first block is the null block (id 0),
a ``SlidingWindowManager`` with ``req_to_blocks`` that, after each step, replaces the blocks of the
first ``max(0, n - window + 1) // block_size`` whole blocks by the null block and frees them.
Expected values are plain recounts over those block lists.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import pytest
import torch

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import vllm


@dataclass(eq=False)
class Block:
    block_id: int
    is_null: bool = False


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = deque(Block(i) for i in range(num_blocks))
        self.null_block = self.free.popleft()
        self.null_block.is_null = True

    def get_new_blocks(self, n: int) -> list[Block]:
        return [self.free.popleft() for _ in range(n)]

    def free_blocks(self, blocks) -> None:
        self.free.extend(blocks)


class SlidingWindowManager:
    def __init__(self, pool: BlockPool, block_size: int, window: int) -> None:
        self.pool, self.block_size, self.window = pool, block_size, window
        self.req_to_blocks: dict[str, list[Block]] = {}

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self.pool.free):
            return False
        blocks.extend(self.pool.get_new_blocks(max(0, need)))
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        skipped = vllm.num_skipped_tokens(num_computed_tokens, self.window) // self.block_size
        blocks = self.req_to_blocks[request_id]
        for i in range(min(skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is self.pool.null_block:
                break
            self.pool.free_blocks([blocks[i]])
            blocks[i] = self.pool.null_block

    def free(self, request_id: str) -> None:
        self.pool.free_blocks(b for b in reversed(self.req_to_blocks.pop(request_id)) if not b.is_null)


def test_num_skipped_tokens_is_vllms_rule():
    assert [vllm.num_skipped_tokens(n, 4) for n in (0, 3, 4, 7, 10)] == [0, 0, 1, 4, 7]
    with pytest.raises(ValueError, match="sliding_window"):
        vllm.num_skipped_tokens(5, 0)


def test_window_counts_on_a_hand_built_table():
    # block_size 4: request 0 has 10 tokens in [null, null, 7]: 8 out of window, 2 in;
    # request 1 has 5 tokens in [3, 9]: none out; request 2 has 3 tokens in [null] : 3 (clipped).
    table = torch.tensor([[0, 0, 7], [3, 9, 0], [0, 0, 0]], dtype=torch.int32)
    counts = vllm.window_counts(table, torch.tensor([10, 5, 3]), 4)
    assert counts == vllm.WindowCounts(live_tokens=18, swa_entries=7, swa_out_of_window_tokens=11)
    assert counts.swa_full_idx_divergence is None


def test_window_counts_rejects_bad_shapes():
    with pytest.raises(ValueError, match="block_size"):
        vllm.window_counts(torch.zeros((1, 2), dtype=torch.int32), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="num_tokens"):
        vllm.window_counts(torch.zeros((2, 2), dtype=torch.int32), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="covers"):
        vllm.window_counts(torch.zeros((1, 2), dtype=torch.int32), torch.tensor([9]), 4)


def test_block_table_from_manager_pads_with_the_null_block():
    manager = SlidingWindowManager(BlockPool(16), block_size=4, window=6)
    manager.allocate("a", 10)
    manager.allocate("b", 3)
    manager.remove_skipped_blocks("a", 10)  # skips 5 tokens -> 1 whole block
    table = vllm.block_table_from_manager(manager, ["a", "b"])
    assert table.tolist() == [[0, 2, 3], [4, 0, 0]]
    with pytest.raises(KeyError, match="zz"):
        vllm.block_table_from_manager(manager, ["zz"])
    with pytest.raises(TypeError, match="req_to_blocks"):
        vllm.block_table_from_manager(object(), ["a"])


@pytest.mark.parametrize("block_size", [1, 4])
def test_reporter_through_the_view_matches_a_recount(block_size):
    rng = random.Random(block_size)
    pool = BlockPool(400)
    manager = SlidingWindowManager(pool, block_size, window=12)
    lengths: dict[str, int] = {}
    records, expected = [], {}
    reporter = SwaDivergenceReporter(interval=3, device="cpu", sinks=[lambda r, c: records.append(r)])
    for step in range(240):
        if len(lengths) < 6 and rng.random() < 0.3:
            rid = f"r{step}"
            n = rng.randint(1, 30)
            if manager.allocate(rid, n):
                lengths[rid] = n
        for rid in list(lengths):
            if rng.random() < 0.05 or not manager.allocate(rid, lengths[rid] + 1):
                manager.free(rid)
                del lengths[rid]
                continue
            lengths[rid] += 1
            manager.remove_skipped_blocks(rid, lengths[rid])
        ids = list(lengths)
        table = vllm.block_table_from_manager(manager, ids)
        num_tokens = torch.tensor([lengths[r] for r in ids], dtype=torch.int64)
        # Plain recount: null blocks among the blocks covering n tokens, x block_size, clipped.
        oow = 0
        for r in ids:
            n = lengths[r]
            nulls = sum(1 for b in manager.req_to_blocks[r][: -(-n // block_size)] if b.is_null)
            oow += min(nulls * block_size, n)
        live = sum(lengths.values())
        counts = vllm.window_counts(table, num_tokens, block_size)
        assert (counts.live_tokens, counts.swa_out_of_window_tokens, counts.swa_entries) == (live, oow, live - oow)
        vllm.observe_counts(reporter, counts)
        expected[step + 1] = oow
        reporter.step(vllm.batch_view(table, num_tokens, block_size, num_blocks=pool.num_blocks,
                                      num_tokens_cpu=[lengths[r] for r in ids]))
    reporter.close()
    assert len(records) == 80
    assert {r.forward_ct: r.swa_out_of_window_tokens for r in records} == {k: expected[k] for k in range(3, 241, 3)}
    assert all(r.swa_full_idx_divergence == 0 for r in records)
    assert all(r.divergence_applicable is False for r in records)  # telemetry drops the 0
    assert max(expected.values()) >= 1
    last = records[-1]
    assert last.verify_swa < last.verify_full


def test_batch_view_mapping_is_built_once_per_pool_shape_with_the_null_block_zeroed():
    table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
    tokens = torch.tensor([3, 4])
    first = vllm.batch_view(table, tokens, 2, num_blocks=4)
    second = vllm.batch_view(table[:1], tokens[:1], 2, num_blocks=4)
    assert second.full_to_swa_index_mapping is first.full_to_swa_index_mapping
    # 4 blocks x 2 slots + the reserved slot 0; the null block 0 holds view slots 1 and 2
    assert first.full_to_swa_index_mapping.tolist() == [0, 0, 0, 3, 4, 5, 6, 7, 8]
    other = vllm.batch_view(table, tokens, 2, num_blocks=4, null_block_id=2)
    assert other.full_to_swa_index_mapping.tolist() == [0, 1, 2, 3, 4, 0, 0, 7, 8]
    assert first.full_to_swa_index_mapping.tolist() == [0, 0, 0, 3, 4, 5, 6, 7, 8]  # untouched
    bigger = vllm.batch_view(table, tokens, 2, num_blocks=5)
    assert bigger.full_to_swa_index_mapping.tolist() == [0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="null_block_id 4 is outside"):
        vllm.batch_view(table, tokens, 2, num_blocks=4, null_block_id=4)
