"""Provenance over a paged KV cache of two groups sharing one tensor per layer pair
(:mod:`otel_swa.device.paged_provenance`), in CPU_ATTN's layout, against values computed here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.paged_provenance import BlockSlots, PagedProvenance
from otel_swa.device.paged_write import cpu_attn_kv_views, paged_layer_store
from otel_swa.device.provenance import PROVENANCE_WIDTH
from otel_swa.device.stamps import expected_stamps

BS, H, D, BLOCKS = 4, 2, 8, 16
# layers 0 and 2 are the sliding-window group's, 1 and 3 the full group's; 0/1 and 2/3 share a tensor
KV = [torch.zeros(BLOCKS, H, BS, 2 * D) for _ in range(2)]
LAYERS = {0: (True, 0), 1: (False, 0), 2: (True, 1), 3: (False, 1)}


class Paged:
    """Two requests' tables per group, a forward step that stores and stamps as vLLM's runner does."""

    def __init__(self) -> None:
        for kv in KV:
            kv.zero_()
        self.prov = PagedProvenance("cpu", SamplingGate("cpu"), full_slots=BLOCKS * BS, swa_slots=BLOCKS * BS,
                                    write_check=False, checksum_order={"full": (1, 3), "swa": (0, 2)})
        # group tables: full blocks 1-4 (request 0), 5-8 (request 1); swa blocks 9-12, 13-15 (and null)
        self.tables = {False: torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),
                       True: torch.tensor([[9, 10, 11, 12], [13, 14, 15, 0]])}
        self.tokens = [[], []]
        self.gen = torch.Generator().manual_seed(0)

    def step(self, new: "list[list[int]]") -> None:
        ids = [t for part in new for t in part]
        positions = [len(self.tokens[r]) + i for r, part in enumerate(new) for i in range(len(part))]
        rows = [r for r, part in enumerate(new) for _ in part]
        starts = np.cumsum([0] + [len(p) for p in new]).tolist()
        qsl = torch.tensor(starts)
        ids_t, pos_t = torch.tensor(ids), torch.tensor(positions)
        for layer_id in sorted(LAYERS):
            swa, pair = LAYERS[layer_id]
            table = self.tables[swa]
            slot_mapping = BlockSlots(table, BS)[torch.tensor(rows), pos_t]
            if layer_id in (0, 1):
                self.prov.stamp_group(swa=swa, input_ids=ids_t, positions=pos_t, slot_mapping=slot_mapping,
                                      block_table=table, block_size=BS, query_start_loc=qsl)
            k = torch.randn(len(ids), H, D, generator=self.gen)
            v = torch.randn(len(ids), H, D, generator=self.gen)
            kc, vc = cpu_attn_kv_views(KV[pair], D)
            kc[slot_mapping // BS, slot_mapping % BS] = k
            vc[slot_mapping // BS, slot_mapping % BS] = v
            store = paged_layer_store(layer_id, swa, k, v, KV[pair], slot_mapping, head_size=D, layout="cpu_attn_vec")
            self.prov.after_layer(**store._asdict())
        for r, part in enumerate(new):
            self.tokens[r].extend(part)

    def view(self, window: int = 64) -> SimpleNamespace:
        return SimpleNamespace(kv_provenance=SimpleNamespace(
            seq_lens_cpu=[len(t) for t in self.tokens], req_to_token=BlockSlots(self.tables[False], BS),
            swa_req_to_token=BlockSlots(self.tables[True], BS), req_pool_indices=torch.arange(2),
            token_ids=[list(t) for t in self.tokens], request_ids=["a", "b"], sliding_window=window,
            full_to_swa_index_mapping=None, kv_cache_groups=(1, 0)))

    def read(self):
        out = torch.zeros(PROVENANCE_WIDTH, dtype=torch.int64)
        meta = self.prov.stage(out, self.view())
        return meta.read(out.tolist())


def filled() -> Paged:
    paged = Paged()
    paged.step([[5, 6, 7, 8, 9], [11, 12, 13]])  # prefill
    paged.step([[21], [22]])  # decode
    return paged


def test_a_clean_paged_cache_verifies_every_live_slot_of_both_groups():
    reading = filled().read()
    assert (reading.foreign_tokens, reading.corrupt_tokens) == (0, 0)
    assert reading.stamp_checks == 2 * (6 + 4)  # both groups, every position written
    assert reading.checksum_checks == 2 * (6 + 4)


def test_the_stamps_are_the_requests_own():
    paged = filled()
    slot = int(BlockSlots(paged.tables[False], BS)[torch.tensor([0]), torch.tensor([5])])
    assert int(paged.prov.stamps[0][slot]) == int(expected_stamps(np.array([5, 6, 7, 8, 9, 21]), 0)[0][5])
    swa_slot = int(BlockSlots(paged.tables[True], BS)[torch.tensor([1]), torch.tensor([3])])
    assert int(paged.prov.stamps[1][swa_slot]) == int(expected_stamps(np.array([11, 12, 13, 22]), 0)[0][3])


def test_blocks_swapped_between_requests_are_foreign_and_named():
    paged = filled()
    paged.tables[False][[0, 1], 1] = paged.tables[False][[1, 0], 1]  # block 2 <-> block 6
    reading = paged.read()
    assert reading.foreign_tokens == 2 + 0  # request 0's positions 4, 5 read request 1's block (3 of 4 unwritten)
    where = reading.foreign_offender
    assert (where["entry"], where["position"], where["pool"], where["full_slot"]) == (0, 4, "full", 6 * BS)
    assert (where["block"], where["kv_cache_group"]) == (6, 1)


def test_a_block_of_one_group_overwritten_through_the_other_is_corrupt_with_its_layer():
    paged = filled()
    # request 1's full block 5 (layers 1, 3) written through the sliding-window layer 2, sharing layer 3's tensor
    kc, _ = cpu_attn_kv_views(KV[1], D)
    kc[5, 1, 0, 3] += 1.0
    reading = paged.read()
    assert reading.corrupt_tokens == 1 and reading.foreign_tokens == 0
    where = reading.corrupt_offender
    assert (where["entry"], where["position"], where["pool"], where["full_slot"], where["layer"]) == (1, 1, "full",
                                                                                                     5 * BS + 1, 3)
    assert (where["block"], where["kv_cache_group"]) == (5, 1)


def test_the_null_block_is_not_verified_in_the_sliding_window_group():
    paged = filled()
    paged.tables[True][0, 0] = 0  # positions 0-3 of request 0 left the window
    reading = paged.read()
    assert (reading.foreign_tokens, reading.corrupt_tokens) == (0, 0)
    assert reading.stamp_checks == 20 - 4


def test_the_read_check_reads_paged_rows_through_a_block_table():
    """:class:`PagedRows` and :class:`BlockSlots` in place of SGLang's buffers and ``req_to_token``:
    an output computed here from the window's keys agrees, one changed key in the window does not."""
    from otel_swa.device.paged_provenance import PagedRows
    from otel_swa.device.read_check import ReadCheck

    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(BLOCKS, H, BS, 2 * D, generator=gen)
    kc, vc = cpu_attn_kv_views(kv, D)
    table = torch.tensor([[3, 5, 7], [0, 9, 2]])  # request 1's first block left the window (null)
    seq_lens, window, heads = torch.tensor([11, 10]), 5, 2 * H
    q = torch.randn(2, heads, D, generator=gen)
    outs = []
    for row, n in enumerate(seq_lens.tolist()):
        positions = torch.arange(n - window, n)
        slots = BlockSlots(table, BS)[torch.full_like(positions, row), positions]
        k, v = kc[slots // BS, slots % BS], vc[slots // BS, slots % BS]  # [W, H, D]
        k, v = k.repeat_interleave(heads // H, dim=1), v.repeat_interleave(heads // H, dim=1)
        w = torch.softmax(torch.einsum("hd,whd->hw", q[row], k) * 0.25, dim=-1)
        outs.append(torch.einsum("hw,whd->hd", w, v))
    out = torch.stack(outs)

    def run():
        check = ReadCheck("cpu", max_queries=2, layers="all", gate=SamplingGate("cpu"))
        check.check_layer(layer_id=0, q=q, out=out, k_buffer=PagedRows(kc), v_buffer=PagedRows(vc),
                          req_to_token=BlockSlots(table, BS), full_to_swa_index_mapping=None,
                          req_pool_indices=torch.arange(2), seq_lens=seq_lens, query_rows=None, window=window,
                          scaling=0.25, num_q_heads=heads)
        return check.cells.tolist()[:3]

    assert run()[:2] == [2, 0]
    kc[9, 2] += 1.0  # request 1's position 6 (block 9, offset 2), inside its window
    assert run()[:2] == [2, 1]
