"""The read check against an attention computed query by query in plain torch (a stand-in for an
engine's kernel), with reads that follow the mapping and reads that do not."""

from __future__ import annotations

import math

import pytest
import torch

from otel_swa.device.read_check import READ_CELLS, ReadCheck, read_counts, read_offender_fields, rounding


class Pool:
    """A paged KV pool as an engine keeps it: req_to_token rows of FULL slots, a FULL-to-SWA mapping
    that remaps (SWA slot = a permutation of the FULL slot), SWA K/V buffers written at the SWA slots."""

    def __init__(self, *, batch=5, width=40, kv_heads=2, q_heads=4, head_dim=8, v_dim=8, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.kv_heads, self.q_heads, self.head_dim, self.v_dim = kv_heads, q_heads, head_dim, v_dim
        slots = batch * width + 1
        self.req_to_token = torch.zeros((batch + 1, width), dtype=torch.int32)
        self.seq_lens = torch.tensor([width - 3 * i for i in range(batch)], dtype=torch.int64)
        self.rows = torch.arange(1, batch + 1, dtype=torch.int64)
        for i in range(batch):
            self.req_to_token[i + 1, : int(self.seq_lens[i])] = 1 + i * width + torch.arange(int(self.seq_lens[i]))
        perm = torch.randperm(slots - 1, generator=gen) + 1
        self.mapping = torch.zeros(slots + 1, dtype=torch.int64)
        self.mapping[1:slots] = perm
        self.k = torch.randn((slots, kv_heads, head_dim), generator=gen).to(dtype)
        self.v = torch.randn((slots, kv_heads, v_dim), generator=gen).to(dtype)
        self.q = torch.randn((batch, q_heads, head_dim), generator=gen).to(dtype)
        self.scaling = 1.0 / math.sqrt(head_dim)

    def engine_output(self, window, *, read=None, logit_cap=0.0, sinks=None, window_off=0):
        """The attention an engine computes, query by query and head by head; ``read(full)`` gives
        the slot the engine reads for a FULL slot (default: the mapping's, the right one)."""
        read = read or (lambda full: int(self.mapping[full]))
        out = torch.empty((self.q.shape[0], self.q_heads, self.v_dim), dtype=self.q.dtype)
        group = self.q_heads // self.kv_heads
        for i in range(self.q.shape[0]):
            p = int(self.seq_lens[i]) - 1
            w = window + window_off
            positions = range(max(0, p - w + 1), p + 1)
            slots = [read(int(self.req_to_token[int(self.rows[i]), pos])) for pos in positions]
            for h in range(self.q_heads):
                keys = torch.stack([self.k[s, h // group].double() for s in slots])
                values = torch.stack([self.v[s, h // group].double() for s in slots])
                scores = keys @ self.q[i, h].double() * self.scaling
                if logit_cap:
                    scores = logit_cap * torch.tanh(scores / logit_cap)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h].double().reshape(1)])
                probs = torch.softmax(scores, 0)[: len(slots)]
                out[i, h] = (probs @ values).to(self.q.dtype)
        return out

    def check(self, out, window, check=None, **kwargs):
        check = check or ReadCheck("cpu", max_queries=8)
        check.check_layer(
            layer_id=3, q=self.q, out=out, k_buffer=self.k, v_buffer=self.v, req_to_token=self.req_to_token,
            full_to_swa_index_mapping=self.mapping, req_pool_indices=self.rows, seq_lens=self.seq_lens,
            query_rows=None, window=window, scaling=self.scaling, num_q_heads=self.q_heads, **kwargs,
        )
        return check.take().tolist()


@pytest.mark.parametrize("window", [1, 4, 16, 64])
def test_reads_that_follow_the_mapping_agree(window):
    pool = Pool()
    cells = pool.check(pool.engine_output(window), window)
    assert read_counts(cells) == (5, 0, 0)
    assert read_offender_fields(cells) is None


def test_reads_at_raw_full_slots_disagree_and_the_first_query_is_named():
    # sglang 0.5.23's torch-native backend: written at the SWA slot, read at the raw FULL slot
    pool = Pool()
    cells = pool.check(pool.engine_output(8, read=lambda full: full), 8)
    assert read_counts(cells) == (5, 5, 0)
    first = read_offender_fields(cells)
    assert first == {"entry": 0, "row": 1, "position": 39, "full_slot": int(pool.req_to_token[1, 39]),
                     "swa_slot": int(pool.mapping[int(pool.req_to_token[1, 39])]), "layer": 3}


@pytest.mark.parametrize("off", [-1, 1])
def test_a_window_one_position_off_disagrees(off):
    # sgl-project/sglang#34354: prefill and decode kernels disagreed on whether the window includes
    # the current token
    pool = Pool()
    cells = pool.check(pool.engine_output(8, window_off=off), 8)
    assert read_counts(cells)[1] == 5


def test_one_freed_and_reused_slot_in_one_window_is_named():
    pool = Pool()
    victim_full = int(pool.req_to_token[3, int(pool.seq_lens[2]) - 2])  # request 2, second-to-last key
    reused = int(pool.mapping[int(pool.req_to_token[1, 0])])  # now another request's slot

    def read(full):
        return reused if full == victim_full else int(pool.mapping[full])

    cells = pool.check(pool.engine_output(4, read=read), 4)
    assert read_counts(cells) == (5, 1, 0)
    assert read_offender_fields(cells)["entry"] == 2 and read_offender_fields(cells)["row"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_heads_logit_cap_and_sinks_agree_in_each_dtype(dtype):
    pool = Pool(kv_heads=2, q_heads=6, head_dim=16, v_dim=8, dtype=dtype)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
    out = pool.engine_output(12, logit_cap=5.0, sinks=sinks)
    assert read_counts(pool.check(out, 12, logit_cap=5.0, sinks=sinks)) == (5, 0, 0)
    # without the sinks the same output disagrees: the check does read them
    assert read_counts(pool.check(out, 12, logit_cap=5.0))[1] >= 1


def test_a_non_finite_output_disagrees():
    pool = Pool()
    out = pool.engine_output(8)
    out[4, 1, 0] = float("nan")
    cells = pool.check(out, 8)
    assert read_counts(cells) == (5, 1, 0) and read_offender_fields(cells)["entry"] == 4


def test_queries_rotate_over_the_batch_and_layers_rotate_over_sampled_steps():
    pool = Pool(batch=5)
    out = pool.engine_output(8, read=lambda full: full)
    check = ReadCheck("cpu", max_queries=2)
    entries, wanted = [], []
    for _ in range(3):
        wanted.append([layer for layer in (1, 2, 3) if check.wants(layer)])
        check.check_layer(layer_id=1, q=pool.q, out=out, k_buffer=pool.k, v_buffer=pool.v, req_to_token=pool.req_to_token,
                          full_to_swa_index_mapping=pool.mapping, req_pool_indices=pool.rows, seq_lens=pool.seq_lens,
                          query_rows=None, window=8, scaling=pool.scaling, num_q_heads=pool.q_heads)
        entries.append(read_offender_fields(check.take().tolist())["entry"])
    assert wanted == [[1], [2], [3]]  # one layer per sampled step, in the order first called
    assert entries == [0, 2, 4]  # 2 queries a step, the next two requests each time
    every = ReadCheck("cpu", layers="all")
    assert [every.wants(layer) for layer in (1, 2, 3)] == [True, True, True]


def test_extend_batches_check_each_request_last_token_through_query_rows():
    pool = Pool(batch=3)
    decode = pool.engine_output(8)
    # an extend batch: request i has 2 + i new tokens; its last one sits at the end of its run
    runs = [2, 3, 4]
    q = torch.randn((sum(runs), pool.q_heads, pool.head_dim))
    out = torch.randn((sum(runs), pool.q_heads, pool.v_dim))
    ends = torch.tensor(runs).cumsum(0) - 1
    q[ends], out[ends] = pool.q, decode
    check = ReadCheck("cpu")
    check.check_layer(layer_id=0, q=q, out=out, k_buffer=pool.k, v_buffer=pool.v, req_to_token=pool.req_to_token,
                      full_to_swa_index_mapping=pool.mapping, req_pool_indices=pool.rows, seq_lens=pool.seq_lens,
                      query_rows=ends, window=8, scaling=pool.scaling, num_q_heads=pool.q_heads)
    assert read_counts(check.take().tolist()) == (3, 0, 0)


def test_unsupported_variants_are_counted_unchecked_never_faults():
    pool = Pool()
    out = pool.engine_output(8)
    check = ReadCheck("cpu")
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        assert check.check_layer(layer_id=0, q=pool.q, out=out, k_buffer=pool.k.to(fp8), v_buffer=pool.v.to(fp8),
                                 req_to_token=pool.req_to_token, full_to_swa_index_mapping=pool.mapping,
                                 req_pool_indices=pool.rows, seq_lens=pool.seq_lens, query_rows=None, window=8,
                                 scaling=pool.scaling, num_q_heads=pool.q_heads) == 0
    check.check_layer(layer_id=0, q=pool.q, out=out, k_buffer=pool.k, v_buffer=pool.v, req_to_token=pool.req_to_token,
                      full_to_swa_index_mapping=pool.mapping, req_pool_indices=pool.rows, seq_lens=pool.seq_lens,
                      query_rows=None, window=8, scaling=pool.scaling, num_q_heads=3)  # heads do not divide
    checked, mismatched, unchecked = read_counts(check.take().tolist())
    assert (checked, mismatched) == (0, 0) and unchecked == (10 if fp8 is not None else 5)


@pytest.mark.parametrize("bad", [{"num_q_heads": 0}, {"window": 8.0}, {"seq_lens": "short"}, {"query_rows": "short"}])
def test_arguments_of_the_wrong_kind_or_length_are_unchecked_not_raised(bad):
    pool = Pool()
    out = pool.engine_output(8)
    args = dict(layer_id=0, q=pool.q, out=out, k_buffer=pool.k, v_buffer=pool.v, req_to_token=pool.req_to_token,
                full_to_swa_index_mapping=pool.mapping, req_pool_indices=pool.rows, seq_lens=pool.seq_lens,
                query_rows=None, window=8, scaling=pool.scaling, num_q_heads=pool.q_heads)
    for name, value in bad.items():  # "short": one entry fewer than the batch's requests
        args[name] = pool.seq_lens[:-1] if value == "short" else value
    check = ReadCheck("cpu")
    assert check.check_layer(**args) == 0
    assert read_counts(check.take().tolist()) == (0, 0, 5)  # the batch's 5 requests, none checked


@pytest.mark.parametrize("budget_windows", [1, 3, 8])  # chunks of 1 key, of 3, the whole window
def test_a_small_kv_budget_checks_every_query_in_chunks_with_the_same_verdict(budget_windows):
    pool = Pool(batch=5, kv_heads=2, head_dim=8, v_dim=8)
    budget = 5 * budget_windows * 2 * 16 * 4  # 5 queries x keys x heads x (head_dim + v_dim) x float32
    for read, expected in ((None, 0), (lambda full: full, 5)):
        out = pool.engine_output(8, read=read)
        cells = pool.check(out, 8, check=ReadCheck("cpu", max_queries=8, kv_budget_bytes=budget))
        assert read_counts(cells) == (5, expected, 0), (budget_windows, read)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = pool.engine_output(8, logit_cap=3.0, sinks=sinks)
    cells = pool.check(out, 8, check=ReadCheck("cpu", kv_budget_bytes=budget), logit_cap=3.0, sinks=sinks)
    assert read_counts(cells) == (5, 0, 0)


def test_a_column_slice_of_a_wider_table_is_read_as_it_is():
    pool = Pool()
    wide = torch.zeros((pool.req_to_token.shape[0], pool.req_to_token.shape[1] + 24), dtype=torch.int32)
    wide[:, : pool.req_to_token.shape[1]] = pool.req_to_token
    pool.req_to_token = wide[:, : pool.req_to_token.shape[1]]  # not contiguous
    assert read_counts(pool.check(pool.engine_output(8), 8)) == (5, 0, 0)
    assert read_counts(pool.check(pool.engine_output(8, read=lambda full: full), 8)) == (5, 5, 0)


def test_short_q_and_sinks_of_another_length_are_unchecked():
    pool = Pool()
    out = pool.engine_output(8)
    check = ReadCheck("cpu")
    for q, o, sinks in ((pool.q[:3], out[:3], None), (pool.q, out, torch.zeros(3))):
        check.check_layer(layer_id=0, q=q, out=o, k_buffer=pool.k, v_buffer=pool.v, req_to_token=pool.req_to_token,
                          full_to_swa_index_mapping=pool.mapping, req_pool_indices=pool.rows, seq_lens=pool.seq_lens,
                          query_rows=None, window=8, scaling=pool.scaling, num_q_heads=pool.q_heads, sinks=sinks)
    assert read_counts(check.take().tolist()) == (0, 0, 10)


def test_rounding_follows_the_least_precise_dtype_and_tf32():
    assert rounding(torch.float32) == 2.0**-11  # TF32 products on GPUs
    assert rounding(torch.float32, torch.bfloat16) == torch.finfo(torch.bfloat16).eps
    assert rounding(torch.float16) == torch.finfo(torch.float16).eps
    with pytest.raises(ValueError, match="int64 is not a floating-point dtype"):
        rounding(torch.int64)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_queries must be an int >= 1, got 0"):
        ReadCheck("cpu", max_queries=0)
    with pytest.raises(ValueError, match="layers must be one of rotate, all, got 'some'"):
        ReadCheck("cpu", layers="some")
