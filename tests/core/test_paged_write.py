"""The write check over vLLM 0.33's paged KV cache (:mod:`otel_swa.device.paged_write`).

The caches here are built as vLLM 0.33.0's ``create_kv_cache_views`` builds them: a logical
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view of one flat buffer whose physical
axis order is the group's ``KVCacheLayout`` (``LBHNC``: identity; ``LBNHC``: blocks, then tokens,
then heads). :func:`_reshape_and_cache_flash` stores as vLLM's ``reshape_and_cache_flash`` does
(token ``i`` at block ``slot // block_size``, offset ``slot % block_size``; ``-1`` not stored; only
``len(slot_mapping)`` tokens), written with plain loops, independently of the check.
"""

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.paged_write import paged_kv_views, paged_layer_store
from otel_swa.device.write_check import WriteCheck, write_counts, write_offender_fields

BLOCKS, BS, H, D = 6, 16, 2, 8
LAYOUTS = ("LBHNC", "LBNHC")


def _cache(layout: str, dtype=torch.bfloat16) -> torch.Tensor:
    if layout == "LBHNC":
        return torch.zeros(BLOCKS, H, BS, 2 * D, dtype=dtype)
    return torch.zeros(BLOCKS, BS, H, 2 * D, dtype=dtype).permute(0, 2, 1, 3)  # physical [B, N, H, C]


def _reshape_and_cache_flash(kv_cache, key, value, slots):
    for i, s in enumerate(slots):
        if s < 0:
            continue
        for h in range(H):
            kv_cache[s // BS, h, s % BS, :D] = key[i, h].to(kv_cache.dtype)
            kv_cache[s // BS, h, s % BS, D:] = value[i, h].to(kv_cache.dtype)


def _kv(t, seed=0):
    g = torch.Generator().manual_seed(seed + t)
    return torch.randn(t, H, D, generator=g), torch.randn(t, H, D, generator=g)


def _run(cache, slots, k, v, *, swa=False, quantized=False, query_start_loc=None, positions=None):
    check = WriteCheck("cpu", SamplingGate("cpu"))
    check.check_layer(paged_layer_store(3, swa, k, v, cache, torch.tensor(slots, dtype=torch.int64), head_size=D,
                                        quantized=quantized, query_start_loc=query_start_loc, positions=positions))
    values = check.take().tolist()
    return write_counts(values), write_offender_fields(values)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_split_k_then_v_per_head(layout):
    cache = _cache(layout)
    key_cache, value_cache = paged_kv_views(cache, D)
    assert key_cache.shape == value_cache.shape == (BLOCKS, BS, H, D)
    cache[2, 1, 5, :D] = 1.5
    cache[2, 1, 5, D:] = -2.0
    assert torch.equal(key_cache[2, 5, 1], torch.full((D,), 1.5, dtype=cache.dtype))
    assert torch.equal(value_cache[2, 5, 1], torch.full((D,), -2.0, dtype=cache.dtype))
    assert key_cache.data_ptr() == cache.data_ptr()  # views, not copies


@pytest.mark.parametrize("layout", LAYOUTS)
def test_correct_write_padding_and_padded_key(layout):
    k, v = _kv(6)  # key/value padded longer than the slot mapping (CUDA graph padding)
    slots = [17, 35, 50, -1, 81]
    cache = _cache(layout)
    _reshape_and_cache_flash(cache, k, v, slots)
    expected_checked = sum(s > 0 for s in slots)
    assert _run(cache, slots, k, v) == ((expected_checked, 0, 0), None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_one_slot_off_is_found_with_its_location(layout):
    k, v = _kv(3)
    slots = [17, 35, 50]
    cache = _cache(layout)
    _reshape_and_cache_flash(cache, k, v, [s + 1 for s in slots])
    (checked, bad, unchecked), first = _run(cache, slots, k, v, swa=True, positions=torch.tensor([40, 41, 42]))
    assert (checked, bad, unchecked) == (3, 3, 0)
    assert first == {"entry": 0, "position": 40, "full_slot": None, "swa_slot": 17, "layer": 3, "pool": "swa"}


def test_skipped_token_and_request_entry_from_query_start_loc():
    k, v = _kv(5)
    slots = [20, 21, 22, 40, 60]  # request 0: tokens 0-2, request 1: token 3, request 2: token 4
    cache = _cache("LBNHC")
    _reshape_and_cache_flash(cache, k, v, [s if i != 3 else -1 for i, s in enumerate(slots)])  # token 3 lost
    (checked, bad, _), first = _run(cache, slots, k, v, query_start_loc=torch.tensor([0, 3, 4, 5], dtype=torch.int32))
    assert (checked, bad) == (5, 1)
    assert first["entry"] == 1 and first["full_slot"] == 40 and first["swa_slot"] is None and first["pool"] == "full"
    assert first["position"] is None


def test_fp8_counted_unchecked():
    k, v = _kv(4)
    slots = [17, -1, 50, 51]
    cache = _cache("LBHNC", dtype=torch.uint8)  # vLLM's fp8 caches: uint8 storage of scaled values
    assert _run(cache, slots, k, v, quantized=True) == ((0, 0, 3), None)
    cache = _cache("LBHNC")
    _reshape_and_cache_flash(cache, k, v, slots)
    assert _run(cache, slots, k, v, quantized=True) == ((0, 0, 3), None)  # the flag alone suffices


def test_more_tokens_than_checked_rotate():
    t = 20
    k, v = _kv(t)
    slots = list(range(16, 16 + t))
    cache = _cache("LBHNC")
    _reshape_and_cache_flash(cache, k, v, [s if i != 12 else s + 40 for i, s in enumerate(slots)])
    check = WriteCheck("cpu", SamplingGate("cpu"), max_tokens=8)
    found = []
    for _ in range(3):  # tokens 0-7, 8-15, 16-19 and 0-3
        check.check_layer(paged_layer_store(0, False, k, v, cache, torch.tensor(slots), head_size=D))
        values = check.take().tolist()
        found.append((write_counts(values), (write_offender_fields(values) or {}).get("entry")))
    assert found == [((8, 0, 0), None), ((8, 1, 0), 12), ((8, 0, 0), None)]


def test_wrong_shape_raises():
    with pytest.raises(ValueError, match="2 \\* 8"):
        paged_kv_views(torch.zeros(2, BLOCKS, BS, H, D), D)


@pytest.mark.parametrize("due", [False, True])
def test_recorded_path_counts_only_under_the_flag(due):
    """The path a CUDA graph holds (``force_recorded``, as the CPU tests of the gate drive it): the
    same counts as the eager check when the flag is set, none when it is not."""
    k, v = _kv(5)
    slots = [17, 35, -1, 50, 51]
    cache = _cache("LBNHC")
    _reshape_and_cache_flash(cache, k, v, [s + 1 if s >= 0 else s for s in slots])
    eager = _run(cache, slots, k, v)
    gate = SamplingGate("cpu")
    gate.force_recorded = True
    gate.set(due)
    check = WriteCheck("cpu", gate)
    check.check_layer(paged_layer_store(3, False, k, v, cache, torch.tensor(slots), head_size=D))
    values = check.take().tolist()
    assert eager[0] == (4, 4, 0)
    assert (write_counts(values), write_offender_fields(values)) == (eager if due else ((0, 0, 0), None))
