import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.paged_write import paged_layer_store
from otel_swa.device.write_check import WriteCheck, write_counts, write_offender_fields

BLOCKS, BS, H, D = 6, 16, 2, 8


def _cache():
    return torch.zeros(2, BLOCKS, BS, H, D, dtype=torch.bfloat16)


def _store(cache, slots, k, v):
    # reference store: plain indexing by (block, offset)
    for i, s in enumerate(slots):
        if s >= 0:
            cache[0, s // BS, s % BS] = k[i].to(cache.dtype)
            cache[1, s // BS, s % BS] = v[i].to(cache.dtype)


def _run(cache, slots, k, v):
    check = WriteCheck("cpu", SamplingGate("cpu"))
    check.check_layer(paged_layer_store(3, True, k, v, cache, torch.tensor(slots, dtype=torch.int64)))
    values = check.take().tolist()
    return write_counts(values), write_offender_fields(values)


def _kv(t):
    g = torch.Generator().manual_seed(t)
    return torch.randn(t, H, D, generator=g), torch.randn(t, H, D, generator=g)


def test_correct_write_and_padding():
    k, v = _kv(4)
    slots = [17, 35, 50, -1]
    cache = _cache()
    _store(cache, slots, k, v)
    assert _run(cache, slots, k, v) == ((3, 0, 0), None)


def test_write_to_another_slot_and_wrong_block():
    k, v = _kv(3)
    slots = [17, 35, 50]
    cache = _cache()
    _store(cache, [17, 36, 50 - BS], k, v)  # token 1 off by one, token 2 one block early
    (checked, bad, unchecked), first = _run(cache, slots, k, v)
    assert (checked, bad, unchecked) == (3, 2, 0)
    assert first["entry"] == 1 and first["full_slot"] == slots[first["entry"]] and first["pool"] == "full"


def test_lost_store():
    k, v = _kv(2)
    cache = _cache()
    _store(cache, [20, 40], k, v)
    cache[1, 40 // BS, 40 % BS] = 0
    (checked, bad, _), first = _run(cache, [20, 40], k, v)
    assert (checked, bad) == (2, 1) and first["entry"] == 1 and first["full_slot"] == 40
