"""The folds of every layer's K/V bytes (otel_swa.device.kv_folds) against an independent reference:
each row's hash recomputed here from the bytes in plain Python, the folds summed here, the layer of a
change read back; float32, bf16 and fp16 caches (the bytes, never a rounding)."""

from __future__ import annotations

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.kv_folds import FOLD_MARK, PoolFolds, layer_of
from otel_swa.device.provenance import PROVENANCE_WIDTH, KvProvenance
from otel_swa.views import SwaBatch

Q = (1 << 40) - 87
M32 = 0xFFFFFFFF


def reference_hash(row_bytes: bytes, word: int) -> int:
    """The documented hash of one token's K bytes then V bytes, read as little-endian words of
    ``word`` bytes (signed for 4 and 2, unsigned for 1), in plain Python."""
    total = 0
    for j in range(len(row_bytes) // word):
        w = int.from_bytes(row_bytes[j * word:(j + 1) * word], "little", signed=word > 1)
        x = (j * 0x9E3779B1 + 0x7F4A7C15) & M32
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & M32
        x ^= x >> 12
        mult = ((x * 0x297A2D39) & 0x7FFFFFFF) | 1
        y = ((w + x) * mult) & M32
        total += y ^ (y >> 16)
    return total % Q


def row_bytes(buffer: torch.Tensor, slot: int, take: "int | None" = None) -> bytes:
    data = bytes(buffer[slot].contiguous().view(-1).view(torch.uint8).tolist())
    return data if take is None else data[:take]


def reference_folds(layers, slot: int, word: int = 4, take: "int | None" = None) -> "tuple[int, int]":
    """``(f1, f2)`` of ``slot`` from the bytes of ``layers`` (``{layer_id: (k_buffer, v_buffer)}``)."""
    f1, f2 = FOLD_MARK, 0
    for layer_id, (k, v) in layers.items():
        h = reference_hash(row_bytes(k, slot, take) + row_bytes(v, slot, take), word)
        f1 += h
        f2 += (layer_id + 1) * h
    return f1, f2


def make_layers(ids, slots, dtype, shape=(2, 8), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {i: (torch.randn((slots, *shape), generator=gen).to(dtype), torch.randn((slots, *shape), generator=gen).to(dtype))
            for i in ids}


def write_step(folds: PoolFolds, layers, slots: torch.Tensor, seed: int) -> None:
    """A forward step writing ``slots`` in every layer (given K/V in float32, cast by the store)."""
    gen = torch.Generator().manual_seed(seed)
    folds.reset(slots)
    for layer_id, (kb, vb) in layers.items():
        k = torch.randn((slots.shape[0], *kb.shape[1:]), generator=gen)
        v = torch.randn((slots.shape[0], *vb.shape[1:]), generator=gen)
        kb[slots], vb[slots] = k.to(kb.dtype), v.to(vb.dtype)
        folds.add(folds.layer(layer_id, kb, vb), k, v, slots, capturing=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ordered", [False, True])
def test_the_folds_are_the_documented_sums_of_every_layers_hash(dtype, ordered):
    ids = (0, 2, 5, 7)
    layers = make_layers(ids, 12, dtype)
    folds = PoolFolds(12, torch.device("cpu"), None, ids if ordered else None)
    write_step(folds, layers, torch.tensor([3, 4, 9]), seed=1)
    write_step(folds, layers, torch.tensor([5]), seed=2)
    for slot in range(12):
        expected = reference_folds(layers, slot) if slot in (3, 4, 5, 9) else (0, 0)
        assert tuple(folds.table[slot].tolist()) == expected, slot
    written, delta = folds.verify(torch.tensor([3, 4, 5, 9, 1]))
    assert written.tolist() == [True, True, True, True, False]
    assert delta[:4].eq(0).all()


def test_two_byte_words_and_a_prefix_are_hashed_as_documented():
    # 3 bf16 elements a row: 6 bytes, read as 2-byte words
    layers = make_layers((0, 1), 6, torch.bfloat16, shape=(3,))
    folds = PoolFolds(6, torch.device("cpu"), None, (0, 1))
    write_step(folds, layers, torch.tensor([2]), seed=3)
    assert tuple(folds.table[2].tolist()) == reference_folds(layers, 2, word=2)
    # prefix: the first 16 bytes of each row of a 64-byte row
    layers = make_layers((4,), 6, torch.float32, shape=(16,))
    folds = PoolFolds(6, torch.device("cpu"), 16)
    write_step(folds, layers, torch.tensor([1]), seed=4)
    assert tuple(folds.table[1].tolist()) == reference_folds(layers, 1, take=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_byte_changed_anywhere_in_any_layer_is_seen_and_its_layer_named(dtype):
    ids = (1, 3, 4, 6, 8)
    layers = make_layers(ids, 8, dtype, shape=(4, 16))  # rows of 64 elements: 128 - 256 bytes
    folds = PoolFolds(8, torch.device("cpu"), None, ids)
    write_step(folds, layers, torch.arange(1, 8), seed=5)
    slot = torch.tensor([5])
    row = 64 * layers[1][0].element_size()
    for layer_id in ids:
        for which in (0, 1):  # K, V
            for byte in (0, 64, row // 2 + 3, row - 1):  # the first, past the first 64, the sign of the last
                buffer = layers[layer_id][which]
                bytes_ = buffer[5].view(-1).view(torch.uint8)
                bytes_[byte] ^= 0x80
                written, delta = folds.verify(slot)
                d1, d2 = delta[0].tolist()
                assert written.item() and d1 != 0, (layer_id, which, byte)
                assert layer_of(d1, d2, frozenset(ids)) == layer_id
                bytes_[byte] ^= 0x80
                assert folds.verify(slot)[1].eq(0).all()


def test_changes_in_two_layers_are_seen_and_named_as_several_or_a_layer_of_the_pool():
    ids = (0, 1, 2, 3)
    layers = make_layers(ids, 4, torch.float32)
    folds = PoolFolds(4, torch.device("cpu"), None, ids)
    write_step(folds, layers, torch.tensor([1, 2]), seed=6)
    layers[0][0][1, 0, 0] += 1.0
    layers[3][1][1, 1, 7] -= 2.0
    d1, d2 = folds.verify(torch.tensor([1]))[1][0].tolist()
    assert (d1, d2) != (0, 0)
    # the reference: the two layers' hash changes, folded
    old = reference_folds(layers, 1)
    assert old[0] - folds.table[1, 0].item() == d1 and old[1] - folds.table[1, 1].item() == d2
    assert layer_of(d1, d2, frozenset(ids)) in (None, 1, 2)  # never a layer outside the fold


def test_the_step_buffer_and_the_per_layer_path_agree_and_the_order_is_validated():
    ids = (0, 1, 2)
    a, b = make_layers(ids, 10, torch.float16), make_layers(ids, 10, torch.float16)
    ordered, alone = PoolFolds(10, torch.device("cpu"), None, ids), PoolFolds(10, torch.device("cpu"), None)
    for step, slots in enumerate((torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([2, 7]))):
        write_step(ordered, a, slots, seed=10 + step)
        write_step(alone, b, slots, seed=10 + step)
    assert torch.equal(ordered.table, alone.table)
    for bad in ((), (1, 1), (-1,), (5000,)):
        with pytest.raises(ValueError, match="order"):
            PoolFolds(4, torch.device("cpu"), None, bad)


# ---------------------------------------------------------------------- through KvProvenance
class DeepEngine:
    """Two FULL layers (0, 2) and three SWA layers (1, 3, 4), rows of 2 heads of 32 in ``dtype``; one
    request of ``n`` tokens at FULL slots 1 .. n, SWA slots a permutation."""

    def __init__(self, n: int, dtype, ordered: bool):
        self.full_ids, self.swa_ids = (0, 2), (1, 3, 4)
        slots = 64
        self.r2t = torch.zeros((2, 64), dtype=torch.int32)
        self.r2t[1] = torch.arange(64, dtype=torch.int32) + 1
        self.mapping = torch.zeros(slots + 1, dtype=torch.int64)
        self.mapping[1:] = torch.randperm(slots, generator=torch.Generator().manual_seed(2)) + 1
        self.layers = {i: make_layers((i,), slots + 1, dtype, shape=(2, 32), seed=i)[i] for i in range(5)}
        self.prov = KvProvenance("cpu", SamplingGate("cpu"), full_slots=slots + 1, swa_slots=slots + 1,
                                 checksum_order={"full": self.full_ids, "swa": self.swa_ids} if ordered else None)
        self.tokens = list(range(100, 100 + n))
        self.n = n
        loc = self.r2t[1, :n].long()
        self.prov.stamp(input_ids=torch.tensor(self.tokens), positions=torch.arange(n), out_cache_loc=loc,
                        req_pool_indices=torch.tensor([1]), req_to_token=self.r2t, full_to_swa_index_mapping=self.mapping,
                        extend_start_loc=torch.tensor([0]))
        gen = torch.Generator().manual_seed(9)
        for layer_id in range(5):
            swa = layer_id in self.swa_ids
            kb, vb = self.layers[layer_id]
            k, v = torch.randn((n, 2, 32), generator=gen), torch.randn((n, 2, 32), generator=gen)
            at = self.mapping[loc] if swa else loc
            kb[at], vb[at] = k.to(dtype), v.to(dtype)
            self.prov.after_layer(layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=kb, v_buffer=vb, out_cache_loc=loc,
                                  full_to_swa_index_mapping=self.mapping, positions=torch.arange(n))

    def verify(self):
        view = SwaBatch(self.r2t, self.mapping, torch.tensor([1]), torch.tensor([self.n]), seq_lens_cpu=[self.n],
                        request_ids=[0], token_ids=[self.tokens])
        out = torch.zeros(PROVENANCE_WIDTH, dtype=torch.int64)
        return self.prov.stage(out, view).read(out.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ordered", [False, True])
def test_a_change_in_a_deep_layer_past_the_first_64_bytes_is_corrupt_with_its_layer_named(dtype, ordered):
    engine = DeepEngine(10, dtype, ordered)
    clean = engine.verify()
    assert (clean.checksum_checks, clean.corrupt_tokens, clean.foreign_tokens) == (20, 0, 0)
    # the last layer (an SWA layer) only: another token's row copied over position 6's SWA slot
    kb, vb = engine.layers[4]
    slot = int(engine.mapping[7])  # position 6 is FULL slot 7
    kb[slot] = kb[int(engine.mapping[3])]
    got = engine.verify()
    assert (got.corrupt_tokens, got.foreign_tokens) == (1, 0)
    assert {k: got.corrupt_offender[k] for k in ("pool", "position", "swa_slot", "layer")} == {
        "pool": "swa", "position": 6, "swa_slot": slot, "layer": 4}
    # and, the SWA change left there, one bit of a V row of FULL layer 2
    row = engine.layers[2][1][4].view(-1).view(torch.uint8)
    row[100] ^= 0x01  # past the first 64 bytes of the row
    got = engine.verify()
    assert got.corrupt_tokens == 2
    assert {k: got.corrupt_offender[k] for k in ("pool", "position", "full_slot", "layer")} == {
        "pool": "full", "position": 3, "full_slot": 4, "layer": 2}
