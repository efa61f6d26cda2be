"""Provenance stamps and content checksums (otel_swa.device.stamps, .checksum, .provenance) against
plain-Python recomputations of the documented layouts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from otel_swa.device import checksum
from otel_swa.device.checksum import RowHasher
from otel_swa.device.gate import SamplingGate
from otel_swa.device.provenance import PROVENANCE_WIDTH, ChainCache, KvProvenance
from otel_swa.device.stamps import decode_stamp, expected_stamps, mix, mix_numpy, write_stamps
from otel_swa.views import JoinedTokenIds, SwaBatch


# ---------------------------------------------------------------------- the layout, in plain Python
def f(token: int, position: int) -> int:
    """The documented mix, on Python ints."""
    x = token * 0x9E37F + position * 0x7F4A7
    x ^= x >> 17
    x &= 0x7FFFFFFF
    x *= 0x5BD1E995
    x ^= x >> 31
    return (x >> 11) & 0xFFFFF


def stamp_of(tokens: list, p: int, known: bool = True, chain_from: int = 0) -> int:
    """The stamp of position ``p`` of a request with ``tokens`` (bit 63 stamped, 62 unknown chain,
    42-61 chain, 22-41 token, 0-21 position), as a signed int64."""
    chain = sum(f(tokens[i] % (1 << 20), i % (1 << 22)) for i in range(chain_from, p + 1)) % (1 << 20)
    value = (p % (1 << 22)) | (tokens[p] % (1 << 20)) << 22 | chain << 42 | (0 if known else 1) << 62 | 1 << 63
    return value - (1 << 64)


def test_mix_on_the_device_and_on_the_host_is_the_documented_one():
    rng = random.Random(1)
    tokens = [rng.randrange(1 << 20) for _ in range(500)] + [0, (1 << 20) - 1]
    positions = [rng.randrange(1 << 22) for _ in range(500)] + [(1 << 22) - 1, 0]
    expected = [f(t, p) for t, p in zip(tokens, positions)]
    assert mix(torch.tensor(tokens), torch.tensor(positions)).tolist() == expected
    assert mix_numpy(np.array(tokens), np.array(positions)).tolist() == expected


def table_with(rows: list) -> torch.Tensor:
    """req_to_token with row r holding FULL slots ``rows[r]`` (row 0 padding)."""
    width = max(len(r) for r in rows) + 4
    out = torch.zeros((len(rows) + 1, width), dtype=torch.int32)
    for r, slots in enumerate(rows, start=1):
        out[r, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return out


def test_prefill_chunks_and_decodes_of_several_requests_stamp_the_documented_values():
    rng = random.Random(2)
    a = [rng.randrange(300000) for _ in range(12)]
    b = [rng.randrange(300000) for _ in range(7)]
    full_a, full_b = list(range(100, 112)), list(range(200, 207))
    r2t = table_with([full_a, full_b])
    stamps = torch.zeros(300, dtype=torch.int64)
    swa = torch.zeros(300, dtype=torch.int64)
    mapping = torch.zeros(300, dtype=torch.int64)
    mapping[100:112] = torch.arange(50, 62)
    mapping[200:207] = torch.arange(70, 77)

    def step(entries):  # entries: (row, tokens, positions) of one mixed batch
        ids, pos, loc, rows, starts = [], [], [], [], []
        for row, toks, positions in entries:
            starts.append(len(ids))
            rows.append(row)
            for p in positions:
                ids.append(toks[p])
                pos.append(p)
                loc.append(int(r2t[row, p]))
        loc_t = torch.tensor(loc)
        decode = len(ids) == len(entries)
        write_stamps(stamps, torch.tensor(ids), torch.tensor(pos), loc_t, torch.tensor(rows), r2t,
                     None if decode else torch.tensor(starts), ((swa, mapping[loc_t]),))

    step([(1, a, range(0, 5)), (2, b, range(0, 7))])  # two prefill chunks
    step([(1, a, range(5, 11))])  # the rest of a's prompt
    step([(1, a, [11])])  # a decode
    for p in range(12):
        assert int(stamps[full_a[p]]) == stamp_of(a, p), p
        assert int(swa[50 + p]) == stamp_of(a, p), p
    for p in range(7):
        assert int(stamps[full_b[p]]) == stamp_of(b, p), p
    # the host's expected stamps of a whole request: the same values
    assert expected_stamps(np.array(a), 0)[0].tolist() == [stamp_of(a, p) for p in range(12)]


def test_a_request_whose_previous_position_was_never_stamped_carries_an_unknown_chain():
    tokens = [5, 9, 11, 4]
    r2t = table_with([[10, 11, 12, 13]])
    stamps = torch.zeros(20, dtype=torch.int64)
    # positions 0 and 1 were written before provenance: position 2 has no chain to continue
    write_stamps(stamps, torch.tensor([11]), torch.tensor([2]), torch.tensor([12]), torch.tensor([1]), r2t)
    write_stamps(stamps, torch.tensor([4]), torch.tensor([3]), torch.tensor([13]), torch.tensor([1]), r2t)
    for p in (2, 3):
        got = decode_stamp(int(stamps[10 + p]))
        assert got["chain_known"] == 0 and (got["token"], got["position"]) == (tokens[p], p)
        assert int(stamps[10 + p]) == stamp_of(tokens, p, known=False, chain_from=2)


def test_empty_extend_entries_share_their_start_with_the_next():
    tokens = [3, 1, 4, 1]
    r2t = table_with([[5, 6], [7, 8]])
    stamps = torch.zeros(10, dtype=torch.int64)
    # entry 0 has no new token (start 0 == entry 1's start): every token is entry 1's
    write_stamps(stamps, torch.tensor([4, 1]), torch.tensor([0, 1]), torch.tensor([7, 8]), torch.tensor([1, 2]), r2t,
                 torch.tensor([0, 0]))
    assert stamps[7:9].tolist() == [stamp_of([4, 1], 0), stamp_of([4, 1], 1)]
    assert int(stamps[5]) == int(stamps[6]) == 0
    del tokens


def test_the_chain_tells_prefixes_apart():
    rng = random.Random(3)
    base = [rng.randrange(1000) for _ in range(64)]
    swapped = base.copy()
    swapped[3], swapped[17] = swapped[17], swapped[3]  # same tokens, another order
    shifted = base.copy()
    shifted[5] += 1
    shifted[9] -= 1  # same token sum
    for other in (swapped, shifted):
        assert stamp_of(other, 63) != stamp_of(base, 63)
        assert expected_stamps(np.array(other), 0)[0][63] == stamp_of(other, 63)


# ---------------------------------------------------------------------- checksums
def hash_rows(words: list) -> int:
    """The documented hash of one row's words (Python ints, signed as torch reads them), below 2**40."""
    total = 0
    for j, w in enumerate(words):
        x = (j * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 12
        key, mult = x, ((x * 0x297A2D39) & 0x7FFFFFFF) | 1
        y = ((w + key) * mult) & 0xFFFFFFFF
        total += y ^ (y >> 16)
    return total % ((1 << 40) - 87)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix", [16, 64, None])
def test_the_checksum_is_the_documented_hash_and_sees_every_byte_it_covers(dtype, prefix):
    gen = torch.Generator().manual_seed(4)
    k = torch.randn((6, 2, 8), generator=gen).to(dtype)
    v = torch.randn((6, 2, 8), generator=gen).to(dtype)
    hasher = RowHasher(k, v, prefix)
    assert hasher.supported
    row_bytes = 2 * 8 * k.element_size()
    covered = row_bytes if prefix is None else min(prefix, row_bytes)
    slots = torch.tensor([1, 4])
    got = hasher.of_pool(k, v, slots).tolist()
    for i, s in enumerate(slots.tolist()):
        kb = k[s].contiguous().view(torch.uint8).view(-1)[:covered].tolist()
        vb = v[s].contiguous().view(torch.uint8).view(-1)[:covered].tolist()
        words = [int.from_bytes(bytes(b[o:o + 4]), "little", signed=True) for b in (kb, vb) for o in range(0, covered, 4)]
        assert got[i] == hash_rows(words)
    # what a layer was given (float32) hashes as the stored (cast) row
    assert hasher.of_given(k[slots].float(), v[slots].float(), 2).tolist() == got
    # a flipped byte anywhere in the covered bytes changes the hash; beyond them it does not
    for byte in range(row_bytes):
        flipped = k.clone()
        flipped[4].view(-1).view(torch.uint8)[byte] ^= 0x01
        changed = hasher.of_pool(flipped, v, torch.tensor([4])).item() != got[1]
        assert changed == (byte < covered), byte


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_samples_hash_in_int32_lanes_and_chunks_equals_the_int64_form(dtype, monkeypatch):
    # the CPU's form of RowHasher.of_rows (int32 lanes, chunks) against the int64 form of the step
    # folds (hash_words), on rows whose words take the extremes of their width (top bit set or not)
    gen = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (40, 2, 24), generator=gen, dtype=torch.uint8)
    raw[0] = 0xFF
    raw[1] = 0x00
    raw[2, :, 3::4] = 0x80  # the top byte of each 32-bit word: negative int32 words
    raw[3, :, 3::4] = 0x7F
    k, v = raw.view(40, -1).view(dtype), raw.flip(0).reshape(40, -1).view(dtype)
    hasher = RowHasher(k, v, None)
    slots = torch.arange(39, -1, -1)
    step = torch.cat([hasher.word_rows(k, True), hasher.word_rows(v, False)], dim=1)[slots]  # [40, words]
    expected = hasher.hash_words(step)
    monkeypatch.setattr(checksum, "CPU_CHUNK_WORDS", 3 * hasher.words)  # 3 rows a chunk: 14 chunks
    got = hasher.of_rows([(k, v)], slots)
    assert got.shape == (40, 1) and torch.equal(got[:, 0], expected)
    assert int(got[39, 0]) == hash_rows(step[39].tolist())  # the documented hash of an extreme row
    monkeypatch.setattr(checksum, "CPU_CHUNK_WORDS", 1 << 18)  # one chunk
    assert torch.equal(hasher.of_rows([(k, v), (v, k)], slots)[:, 0], expected)


def test_fp8_like_caches_are_not_hashed():
    k = torch.zeros((4, 16), dtype=torch.uint8)
    assert not RowHasher(k, k, 64).supported


# ---------------------------------------------------------------------- verification at a sample
class Engine:
    """A tiny hybrid cache driven through KvProvenance: FULL slots = 1 + position + 50 * row, SWA
    slots a permutation, K/V rows random (2 heads of 8, float32)."""

    def __init__(self, lens, window=None, budget=4096, checksum="prefix", reporter=None):
        self.gate = SamplingGate("cpu") if reporter is None else reporter.gate
        rows = len(lens)
        self.r2t = torch.zeros((rows + 1, 64), dtype=torch.int32)
        for r in range(1, rows + 1):
            self.r2t[r] = torch.arange(64, dtype=torch.int32) + 1 + 64 * (r - 1)
        full_slots = 64 * rows + 1 + 256  # room to move slots to
        self.mapping = torch.zeros(full_slots, dtype=torch.int64)
        self.mapping[1:] = torch.randperm(full_slots - 1, generator=torch.Generator().manual_seed(5)) + 1
        self.k = torch.zeros((full_slots, 2, 8))
        self.v = torch.zeros((full_slots, 2, 8))
        self.swa_k, self.swa_v = self.k.clone(), self.v.clone()
        if reporter is None:
            self.prov = KvProvenance("cpu", self.gate, full_slots=full_slots, swa_slots=full_slots, budget=budget,
                                     checksum=checksum)
        else:
            self.prov = reporter.enable_provenance(full_slots=full_slots, swa_slots=full_slots, budget=budget,
                                                   checksum=checksum)
        rng = random.Random(6)
        self.tokens = [[rng.randrange(500) for _ in range(64)] for _ in range(rows)]
        self.window = window
        self.gen = torch.Generator().manual_seed(7)
        self.lens = [0] * rows
        self.write(list(lens))

    def write(self, news):
        """A step writing ``news[i]`` new tokens of request ``i``."""
        ids, pos, rows, starts = [], [], [], []
        for i, n in enumerate(news):
            starts.append(len(ids))
            rows.append(i + 1)
            for p in range(self.lens[i], self.lens[i] + n):
                ids.append(self.tokens[i][p])
                pos.append(p)
        loc = torch.tensor([int(self.r2t[rows[i], p]) for i, n in enumerate(news) for p in range(self.lens[i], self.lens[i] + n)])
        self.prov.stamp(input_ids=torch.tensor(ids), positions=torch.tensor(pos), out_cache_loc=loc,
                        req_pool_indices=torch.tensor(rows), req_to_token=self.r2t,
                        full_to_swa_index_mapping=self.mapping, extend_start_loc=torch.tensor(starts))
        for swa, (kb, vb) in ((False, (self.k, self.v)), (True, (self.swa_k, self.swa_v))):
            k = torch.randn((len(ids), 2, 8), generator=self.gen)
            v = torch.randn((len(ids), 2, 8), generator=self.gen)
            slots = self.mapping[loc] if swa else loc
            kb[slots], vb[slots] = k, v
            self.prov.after_layer(layer_id=int(swa), swa=swa, k=k, v=v, k_buffer=kb, v_buffer=vb, out_cache_loc=loc,
                                  full_to_swa_index_mapping=self.mapping, positions=torch.tensor(pos))
        self.lens = [a + b for a, b in zip(self.lens, news)]

    def view(self, tokens=True):
        batch = len(self.lens)
        return SwaBatch(self.r2t, self.mapping, torch.arange(1, batch + 1), torch.tensor(self.lens),
                        seq_lens_cpu=list(self.lens), sliding_window=self.window, request_ids=list(range(batch)),
                        token_ids=[t[:n] for t, n in zip(self.tokens, self.lens)] if tokens else None)

    def verify(self, view=None):
        out = torch.zeros(PROVENANCE_WIDTH, dtype=torch.int64)
        meta = self.prov.stage(out, view if view is not None else self.view())
        return meta.read(out.tolist())


def test_a_clean_cache_verifies_every_live_slot_of_both_pools():
    engine = Engine([10, 20, 5], window=8)
    got = engine.verify()
    # FULL: every token; SWA: the last `window` positions of each request (positions read)
    swa = sum(min(n, 8) for n in engine.lens)
    assert (got.stamp_checks, got.foreign_tokens, got.stamp_unchecked) == (35 + swa, 0, 0)
    assert (got.checksum_checks, got.corrupt_tokens, got.checksum_unchecked) == (35 + swa, 0, 0)
    engine.write([1, 1, 1])  # a decode step
    assert engine.verify().stamp_checks == 38 + sum(min(n, 8) for n in engine.lens)


def test_a_slot_overwritten_by_another_request_is_foreign_and_named():
    engine = Engine([10, 20], window=8)
    r2t = engine.r2t
    # request 1's position 3 now names request 2's position 3 (a stale table entry)
    r2t[1, 3] = r2t[2, 3]
    got = engine.verify()
    assert got.foreign_tokens == 1 + (0 if 3 < 10 - 8 else 1)
    off = got.foreign_offender
    assert (off["pool"], off["entry"], off["row"], off["position"], off["full_slot"]) == ("full", 0, 1, 3, int(r2t[2, 3]))
    assert (off["expected_token"], off["found_token"]) == (engine.tokens[0][3], engine.tokens[1][3])
    assert off["expected_position"] == off["found_position"] == 3
    assert got.corrupt_tokens == 0  # the bytes at that slot are the ones hashed there


def test_the_same_token_at_the_same_position_after_another_prefix_is_foreign():
    engine = Engine([12, 12])
    engine.tokens[1][:12] = engine.tokens[0][:12]
    engine.tokens[1][2] += 1  # one earlier token differs
    engine.prov.reset()
    engine.lens = [0, 0]
    engine.write([12, 12])
    engine.r2t[1, 11] = engine.r2t[2, 11]  # request 1's last position names request 2's slot
    got = engine.verify()
    assert got.foreign_tokens >= 1
    off = got.foreign_offender
    assert (off["position"], off["found_position"], off["expected_token"], off["found_token"]) == (
        11, 11, engine.tokens[0][11], engine.tokens[0][11])


def test_a_flipped_byte_is_corrupt_in_its_pool_and_a_wrong_index_write_too():
    engine = Engine([10, 6], window=4)
    slot = int(engine.mapping[int(engine.r2t[2, 5])])
    engine.swa_k[slot].view(-1).view(torch.uint8)[0] ^= 0xFF
    got = engine.verify()
    assert got.corrupt_tokens == 1 and got.foreign_tokens == 0
    off = got.corrupt_offender
    assert (off["pool"], off["entry"], off["position"], off["swa_slot"]) == ("swa", 1, 5, slot)


def test_token_ids_not_given_leave_stamps_unchecked_but_checksums_checked():
    engine = Engine([10, 6])
    got = engine.verify(engine.view(tokens=False))
    assert (got.stamp_checks, got.stamp_unchecked) == (0, 32)  # 16 FULL + 16 SWA slots
    assert (got.checksum_checks, got.checksum_unchecked) == (32, 0)
    view = engine.view()
    short = SwaBatch(view.req_to_token, view.full_to_swa_index_mapping, view.req_pool_indices, view.seq_lens,
                     seq_lens_cpu=view.seq_lens_cpu, token_ids=[engine.tokens[0][:10], engine.tokens[1][:3]])
    got = engine.verify(short)
    # request 1's positions 0-2 are judged in both pools, its positions 3-5 (past its ids) are not
    assert (got.stamp_checks, got.stamp_unchecked) == (20 + 2 * 3, 12 - 2 * 3)


def test_a_live_slot_never_stamped_is_foreign_and_named_as_never_written():
    # a slot the table names that no forward step wrote: a write that went to another slot, or a
    # prefix naming slots nothing wrote (the KV read there is not the token's)
    engine = Engine([10])
    slot = int(engine.r2t[1, 4])
    engine.prov.stamps[0][slot] = 0
    got = engine.verify()
    assert (got.stamp_checks, got.stamp_unchecked, got.foreign_tokens) == (20, 0, 1)
    off = got.foreign_offender
    assert (off["pool"], off["position"], off["full_slot"], off["expected_token"]) == ("full", 4, slot, engine.tokens[0][4])
    assert "found_token" not in off  # the stamp names nothing


def test_with_never_stamped_unchecked_a_live_slot_never_stamped_is_counted_unchecked():
    # provenance switched on over a KV cache that already held KV (an engine wired late)
    engine = Engine([10])
    engine.prov.never_stamped = "unchecked"
    engine.prov.stamps[0][int(engine.r2t[1, 4])] = 0
    got = engine.verify()
    assert (got.stamp_checks, got.stamp_unchecked, got.foreign_tokens) == (19, 1, 0)


def test_never_stamped_takes_only_its_documented_values():
    with pytest.raises(ValueError, match="never_stamped must be one of foreign, unchecked, got 'yes'"):
        KvProvenance("cpu", SamplingGate("cpu"), full_slots=8, never_stamped="yes")


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_the_budget_rotation_judges_every_slot_within_its_bound(budget):
    engine = Engine([10, 30, 3], budget=budget)
    fault = int(engine.r2t[2, 17])
    engine.prov.stamps[0][fault] ^= 1 << 22  # a foreign token id at request 2's position 17
    total = 43  # FULL candidates (the SWA pool: all 43 too, no window)
    rounds = -(-total // budget)
    seen = []
    for _ in range(rounds):
        got = engine.verify()
        assert got.stamp_checks == 2 * min(budget, total)
        assert got.stamp_unchecked == 2 * max(0, total - budget)
        seen.append(got.foreign_tokens)
    assert sum(seen) == 1  # seen exactly once in ceil(N / budget) samples


def test_the_chain_cache_gives_the_values_of_a_fresh_computation():
    rng = random.Random(9)
    tokens = [rng.randrange(1 << 20) for _ in range(5000)]
    cache = ChainCache(every=256)
    fresh = expected_stamps(np.array(tokens), 0)[0]
    assert [int(x) for x in fresh[:20]] == [stamp_of(tokens, p) for p in range(20)]
    for lo, hi in ((0, 10), (4000, 4100), (300, 900), (4990, 5000), (0, 5000), (1023, 1025)):
        assert cache.expected("r", tokens, lo, hi).tolist() == fresh[lo:hi].tolist()
        assert cache.expected(None, JoinedTokenIds(tokens[:7], tokens[7:]), lo, hi).tolist() == fresh[lo:hi].tolist()
    assert len(cache) == 1


def test_moved_slots_keep_their_provenance():
    engine = Engine([8])
    src = engine.r2t[1, :8].long()
    dst = src + 200
    engine.prov.move_slots("full", src, dst)
    engine.k[dst], engine.v[dst] = engine.k[src], engine.v[src]
    engine.mapping[dst] = engine.mapping[src]  # the SWA slots stay where they are
    engine.r2t[1, :8] = dst.to(torch.int32)
    got = engine.verify()
    assert (got.foreign_tokens, got.corrupt_tokens) == (0, 0) and got.stamp_checks == 16


def test_the_chain_keeps_apart_prefixes_with_a_swap_or_the_same_token_sum():
    """65,536 random 64-token prefixes (vocabulary 512), each against itself with two tokens swapped
    and with a change that keeps the token sum: uniform 20-bit chains would agree about 0.06 times
    each; a mix whose structure survives (a linear form times a constant) agrees about 12 times."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 512, (1 << 16, 64))
    positions = np.arange(64)

    def chains(t):
        return mix_numpy(t, positions).sum(axis=1) % (1 << 20)

    base = chains(tokens)
    swapped = tokens.copy()
    swapped[:, [3, 17]] = swapped[:, [17, 3]]
    differ = tokens[:, 3] != tokens[:, 17]
    kept = tokens.copy()
    kept[:, 5] += 1
    kept[:, 9] -= 1
    assert int((chains(swapped) == base)[differ].sum()) <= 1
    assert int((chains(kept) == base).sum()) <= 1


# ---------------------------------------------------------------------- the sweep of held slots
def _batch_of_first(engine, sweep):
    """A view of request 1 alone, sweeping ``sweep`` (the slots another holder keeps)."""
    n = engine.lens[0]
    return SwaBatch(engine.r2t, engine.mapping, torch.tensor([1]), torch.tensor([n]), seq_lens_cpu=[n],
                    request_ids=[0], token_ids=[engine.tokens[0][:n]], kv_sweep_full_slots=sweep)


def test_a_flipped_byte_in_a_held_slot_no_request_reads_is_found_by_the_sweep():
    engine = Engine([10, 6])
    held = engine.r2t[2, :6].long()  # request 2 finished: its KV is only held (a prefix cache)
    slot = int(held[4])
    engine.k[slot].view(-1).view(torch.uint8)[0] ^= 0xFF
    without = engine.verify(_batch_of_first(engine, None))
    assert (without.checksum_checks, without.corrupt_tokens) == (20, 0)  # request 1's 10 FULL + 10 SWA
    got = engine.verify(_batch_of_first(engine, held))
    assert (got.checksum_checks, got.corrupt_tokens) == (20 + 6 + 6, 1)  # and 6 held slots in each pool
    assert got.corrupt_offender == {"entry": None, "row": None, "position": None, "pool": "full",
                                    "full_slot": slot, "swa_slot": None, "layer": 0}
    assert got.foreign_tokens == 0 and got.stamp_checks == 20  # the sweep compares no stamps


def test_the_sweep_finds_a_flipped_swa_byte_and_skips_unmapped_slots():
    engine = Engine([10, 6])
    held = engine.r2t[2, :6].long()
    engine.mapping[held[:2]] = 0  # two held tokens left the window: no SWA slot to check
    swa = int(engine.mapping[held[5]])
    engine.swa_v[swa].view(-1).view(torch.uint8)[1] ^= 0x01
    got = engine.verify(_batch_of_first(engine, lambda: held))
    assert (got.checksum_checks, got.corrupt_tokens) == (20 + 6 + 4, 1)
    assert (got.corrupt_offender["pool"], got.corrupt_offender["full_slot"], got.corrupt_offender["swa_slot"]) == (
        "swa", int(held[5]), swa)


def test_a_sweep_whose_slots_all_left_the_window_checks_none_in_the_swa_pool_and_still_the_full_pool():
    engine = Engine([10, 6])
    held = engine.r2t[2, :6].long()
    engine.mapping[held] = 0  # every held token left the window
    engine.k[int(held[3])].view(-1).view(torch.uint8)[5] ^= 0x10
    got = engine.verify(_batch_of_first(engine, held))
    assert (got.checksum_checks, got.corrupt_tokens) == (20 + 6, 1)  # request 1's 20, the 6 held FULL slots
    assert (got.corrupt_offender["pool"], got.corrupt_offender["full_slot"]) == ("full", int(held[3]))


def test_the_sweep_goes_through_its_list_a_budget_at_a_time():
    engine = Engine([3, 40], budget=16)
    held = engine.r2t[2, :40].long()
    slot = int(held[37])
    engine.k[slot].view(-1).view(torch.uint8)[0] ^= 0xFF
    calls = []

    def listed():
        calls.append(1)
        return held

    found = [engine.verify(_batch_of_first(engine, listed)).corrupt_tokens for _ in range(4)]
    # the list (40 slots, sorted) is read once per pass of ceil(40 / 16) = 3 samples; slot 37 of the
    # request is in the third part; the fourth sample starts a new pass
    assert found == [0, 0, 1, 0] and len(calls) == 2


def test_a_corrupt_slot_found_by_the_sweep_reaches_the_record_named_by_its_slots():
    from otel_swa.reporter import SwaDivergenceReporter

    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: got.append(record)])
    engine = Engine([10, 6], reporter=reporter)
    held = engine.r2t[2, :6].long()
    slot = int(held[2])
    engine.k[slot].view(-1).view(torch.uint8)[0] ^= 0xFF
    reporter.step(_batch_of_first(engine, held))
    reporter.close()
    (record,) = got
    assert (record.kv_checksum_checks, record.kv_corrupt_tokens, record.kv_foreign_tokens) == (20 + 12, 1, 0)
    offender = record.offender("kv_corrupt_tokens")
    assert (offender.pool, offender.full_slot, offender.swa_slot) == ("full", slot, None)
    assert (offender.request, offender.row, offender.position) == (None, None, None)


def test_every_layer_by_default_and_with_prefix_only_the_checksum_layers_and_the_write_checks_want_a_layer():
    gate = SamplingGate("cpu")
    every = KvProvenance("cpu", gate, full_slots=16, swa_slots=16)
    # by default every layer folds its hash, sampled or not
    for flag in (False, True):
        gate.set(flag)
        assert all(every.wants_layer(layer, swa) for layer, swa in ((0, True), (1, False), (2, True), (3, False)))
    prov = KvProvenance("cpu", gate, full_slots=16, swa_slots=16, checksum="prefix",
                        checksum_layers={"full": 1, "swa": 0})
    # a step that is not sampled: each pool's checksum layer only (layers 0 and 2 are SWA, 1 and 3 FULL)
    gate.set(False)
    assert [prov.wants_layer(layer, swa) for layer, swa in ((0, True), (1, False), (2, True), (3, False))] == [
        True, True, False, False]
    # a sampled step: the write check's turn adds one layer of each kind (the first seen, rotation 0)
    gate.set(True)
    assert [prov.wants_layer(layer, swa) for layer, swa in ((0, True), (1, False), (2, True), (3, False))] == [
        True, True, False, False]
    no_checksums = KvProvenance("cpu", gate, full_slots=16, swa_slots=16, checksum="off")
    assert [no_checksums.wants_layer(layer, swa) for layer, swa in ((0, True), (1, False), (2, True))] == [
        True, True, False]
    gate.set(False)
    assert not no_checksums.wants_layer(0, True) and not no_checksums.wants_layer(1, False)
