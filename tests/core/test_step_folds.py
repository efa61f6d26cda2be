"""The shared step buffer of both pools' layers (otel_swa.device.step_folds): the tables it writes are
the ones each layer folding alone writes, bit for bit (and the plain-Python reference of
test_kv_folds), in fewer device operations; a step whose layers did not all call still folds what
they gave, and the missing layer is the one named."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from otel_swa.device.gate import SamplingGate
from otel_swa.device.kv_folds import FOLD_MARK
from otel_swa.device.provenance import KvProvenance
from test_kv_folds import DeepEngine, reference_folds

_VIEWS = {"slice", "select", "view", "unsqueeze", "alias", "as_strided", "detach", "_reshape_alias", "expand",
          "t", "transpose", "reshape", "_unsafe_view", "unbind"}


class Ops(TorchDispatchMode):
    """The device operations dispatched (views left out: they launch nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _VIEWS:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


FULL, SWA = (0, 2), (1, 3, 4)


def provenance(ordered: bool, slots: int) -> KvProvenance:
    return KvProvenance("cpu", SamplingGate("cpu"), full_slots=slots, swa_slots=slots, write_check=False,
                        checksum_order={"full": FULL, "swa": SWA} if ordered else None)


def decode_step(prov: KvProvenance, layers, mapping, loc, step: int, given_dtype, skip=()) -> None:
    """One decode step of len(loc) requests at FULL slots ``loc`` writing every layer (but ``skip``)."""
    n = loc.shape[0]
    prov.stamp(input_ids=torch.arange(n) + 7 * step, positions=torch.full((n,), step), out_cache_loc=loc,
               req_pool_indices=torch.arange(n), req_to_token=torch.zeros((n, 64), dtype=torch.int32),
               full_to_swa_index_mapping=mapping)
    gen = torch.Generator().manual_seed(100 + step)
    for layer_id in range(5):
        kb, vb = layers[layer_id]
        k, v = torch.randn((n, 2, 32), generator=gen).to(given_dtype), torch.randn((n, 64), generator=gen).to(given_dtype)
        swa = layer_id in SWA
        at = mapping[loc] if swa else loc
        kb[at], vb[at] = k.to(kb.dtype), v.reshape(n, 2, 32).to(vb.dtype)
        if layer_id not in skip:
            prov.after_layer(layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=kb, v_buffer=vb, out_cache_loc=loc,
                             full_to_swa_index_mapping=mapping)


@pytest.mark.parametrize("cache_dtype,given_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.float16, torch.float16)])
def test_one_pass_over_both_pools_writes_the_tables_each_layer_alone_writes(cache_dtype, given_dtype):
    engines = []
    for ordered in (True, False):
        engine = DeepEngine(10, cache_dtype, ordered)
        engine.prov.write_check = None
        engines.append(engine)
    for step, loc in enumerate((torch.tensor([11, 12, 13, 14]), torch.tensor([15, 16, 17, 18]), torch.tensor([19]))):
        for engine in engines:
            decode_step(engine.prov, engine.layers, engine.mapping, loc, step + 1, given_dtype)
    shared, alone = engines
    assert shared.prov._step_folds is not None and shared.prov._step_folds.shared
    for p in (0, 1):
        assert torch.equal(shared.prov.folds[p].table, alone.prov.folds[p].table)
        assert torch.equal(shared.prov.stamps[p], alone.prov.stamps[p])
    # and the plain-Python sums of the bytes now in the buffers, at a FULL and an SWA slot
    full_layers = {i: shared.layers[i] for i in FULL}
    swa_layers = {i: shared.layers[i] for i in SWA}
    assert tuple(shared.prov.folds[0].table[19].tolist()) == reference_folds(full_layers, 19)
    swa_slot = int(shared.mapping[19])
    assert tuple(shared.prov.folds[1].table[swa_slot].tolist()) == reference_folds(swa_layers, swa_slot)


def test_a_decode_steps_write_path_is_33_operations_and_one_per_layer_and_ten():
    engine = DeepEngine(10, torch.float32, True)
    engine.prov.write_check = None
    loc = torch.tensor([11, 12, 13, 14])
    decode_step(engine.prov, engine.layers, engine.mapping, loc, 1, torch.float32)  # the kept buffer made
    args = dict(input_ids=torch.arange(4), positions=torch.full((4,), 2), out_cache_loc=loc,
                req_pool_indices=torch.arange(4), req_to_token=torch.zeros((4, 64), dtype=torch.int32),
                full_to_swa_index_mapping=engine.mapping)
    with Ops() as stamp_ops:
        engine.prov.stamp(**args)
    k = torch.zeros((4, 64))
    with Ops() as layer_ops:
        for layer_id in range(5):
            kb, vb = engine.layers[layer_id]
            engine.prov.after_layer(layer_id=layer_id, swa=layer_id in SWA, k=k, v=k, k_buffer=kb, v_buffer=vb,
                                    out_cache_loc=loc, full_to_swa_index_mapping=engine.mapping)
    # 5 copies into the step buffer; the hash (6), the weighted sum over layers (2), one index_add_ per pool
    assert layer_ops.ops == {"cat": 5, "addcmul": 1, "bitwise_and_": 1, "__rshift__": 1, "bitwise_xor_": 1,
                             "sum": 2, "remainder_": 1, "mul": 1, "index_add_": 2}
    # the stamps of both pools (31: the mix's last reduction and a second clamp of the slots gone) and
    # the two pools' fold resets
    assert sum(stamp_ops.ops.values()) == 33


def test_a_layer_that_did_not_call_is_named_and_the_others_still_fold():
    engine = DeepEngine(10, torch.float32, True)
    engine.prov.write_check = None
    loc = torch.tensor([11])
    decode_step(engine.prov, engine.layers, engine.mapping, loc, 1, torch.float32, skip=(3,))
    # the next step's stamp folds what the unfinished step gave: every layer but 3
    decode_step(engine.prov, engine.layers, engine.mapping, torch.tensor([12]), 2, torch.float32)
    full_layers = {i: engine.layers[i] for i in FULL}
    assert tuple(engine.prov.folds[0].table[11].tolist()) == reference_folds(full_layers, 11)
    swa_slot = int(engine.mapping[11])
    expected = reference_folds({i: engine.layers[i] for i in SWA}, swa_slot)
    missing = reference_folds({3: engine.layers[3]}, swa_slot)
    got = tuple(engine.prov.folds[1].table[swa_slot].tolist())
    assert (got[0] - expected[0], got[1] - expected[1]) == (FOLD_MARK - missing[0], -missing[1])
    written, delta = engine.prov.folds[1].verify(torch.tensor([swa_slot]))
    d1, d2 = delta[0].tolist()
    assert written.tolist() == [True] and d1 != 0 and d2 // d1 - 1 == 3 and d2 % d1 == 0


def test_layers_of_another_layout_end_the_shared_pass_without_losing_a_step():
    prov = provenance(True, 40)
    mapping = torch.arange(40)
    gen = torch.Generator().manual_seed(3)
    layers = {i: (torch.randn((40, 2, 32), generator=gen), torch.randn((40, 2, 32), generator=gen)) for i in range(5)}
    layers[4] = tuple(b.to(torch.float16) for b in layers[4])  # one layer of another dtype
    alone = provenance(False, 40)
    for step, loc in enumerate((torch.tensor([5, 6]), torch.tensor([7, 8]))):
        decode_step(prov, layers, mapping, loc, step + 1, torch.float32)
        decode_step(alone, layers, mapping, loc, step + 1, torch.float32)
    assert not prov._step_folds.shared
    for p in (0, 1):
        assert torch.equal(prov.folds[p].table, alone.folds[p].table)
