"""The read check over a paged KV cache (vLLM's: a block table per request, K and V in CPU_ATTN's
layout, :func:`otel_swa.device.paged_write.cpu_attn_kv_views`) against an attention computed query
by query in plain torch from the block table, with reads that follow it and reads that do not."""

from __future__ import annotations

import pytest
import torch

from otel_swa.device.read_check import ReadCheck, read_counts, read_offender_fields
from paged_pool import PagedPool


@pytest.mark.parametrize("block_size, window", [(32, 32), (32, 1), (32, 100), (4, 7), (16, 40)])
def test_reads_through_the_block_table_agree(block_size, window):
    pool = PagedPool(block_size=block_size, blocks=80)
    cells = pool.check(pool.engine_output(window), window)
    assert read_counts(cells) == (5, 0, 0) and read_offender_fields(cells) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches_agree(dtype):
    pool = PagedPool(dtype=dtype)
    assert read_counts(pool.check(pool.engine_output(32), 32)) == (5, 0, 0)


def test_a_stale_block_in_the_window_is_named():
    """The kernel reads request 3's second block from another block (a stale block-table entry:
    a block freed and handed to another request while this one still points at it)."""
    pool = PagedPool()
    stale = pool.block_table.clone()
    stale[3, 1] = pool.block_table[0, 0]
    cells = pool.check(pool.engine_output(32, table=stale), 32)
    assert read_counts(cells) == (5, 1, 0)
    position = int(pool.seq_lens[3]) - 1
    slot = pool.slot(3, position)
    assert read_offender_fields(cells) == {"entry": 3, "row": 3, "position": position, "full_slot": slot,
                                           "swa_slot": slot, "layer": 2}


def test_a_window_one_position_short_disagrees():
    pool = PagedPool()  # every request but the one of 5 tokens holds more than 31 before its query
    assert read_counts(pool.check(pool.engine_output(31), 32)) == (5, 4, 0)


def test_the_same_data_flat_and_paged_give_the_same_cells():
    """Contiguous K and V rows of a flat pool (SGLang's) seen as pages give the same verdict and
    offender as the flat ``req_to_token`` of the same slots."""
    pool = PagedPool(block_size=8, blocks=40)
    k = torch.randn(40 * 8, 2, 16)
    v = torch.randn(40 * 8, 2, 16)
    pool.k, pool.v = k.view(40, 8, 2, 16), v.view(40, 8, 2, 16)
    stale = pool.block_table.clone()
    stale[1, 3] = pool.block_table[4, 2]  # request 1 (33 tokens): its window 13 .. 32 spans blocks 1 - 4
    out = pool.engine_output(20, table=stale)
    paged = pool.check(out, 20)
    width = pool.block_table.shape[1] * 8
    flat_table = torch.tensor([[pool.slot(i, p) for p in range(width)] for i in range(5)], dtype=torch.int32)
    check = ReadCheck("cpu", max_queries=8)
    check.check_layer(layer_id=2, q=pool.q, out=out, k_buffer=k, v_buffer=v, req_to_token=flat_table,
                      full_to_swa_index_mapping=None, req_pool_indices=torch.arange(5), seq_lens=pool.seq_lens,
                      query_rows=None, window=20, scaling=pool.scaling, num_q_heads=4)
    assert paged == check.take().tolist() and read_counts(paged)[1] == 1


def test_pages_of_another_block_size_are_unchecked_not_faults():
    pool = PagedPool()
    out = pool.engine_output(32)
    assert read_counts(pool.check(out, 32, block_size=16)) == (0, 0, 5)
    assert read_counts(pool.check(out, 32, k=pool.k.flatten(0, 1))) == (0, 0, 5)  # 3-D buffers, paged table
