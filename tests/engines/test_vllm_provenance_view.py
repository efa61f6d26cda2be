"""The KV provenance tables read from vLLM's scheduler (``otel_swa.views.vllm_provenance``), on
stand-ins of its KV cache managers (the attributes read: ``coordinator.single_type_managers``, each
with ``kv_cache_spec``, ``block_size``, ``req_to_blocks``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from otel_swa.views.vllm_provenance import provenance_groups, provenance_view


class FullAttentionSpec:  # the class names vLLM's specs have (vllm/v1/kv_cache_interface.py)
    pass


class SlidingWindowSpec:
    sliding_window = 64


def manager(spec, tables: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_spec=spec, block_size=4,
                           req_to_blocks={rid: [SimpleNamespace(block_id=b) for b in blocks] for rid, blocks in tables.items()})


def kv_manager(full: dict, swa: dict) -> SimpleNamespace:
    managers = [manager(SlidingWindowSpec(), swa), manager(FullAttentionSpec(), full)]
    return SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=managers))


def test_two_groups_of_each_kind_are_found_and_others_refused():
    kv = kv_manager({}, {})
    full, swa = provenance_groups(kv)
    assert isinstance(full.kv_cache_spec, FullAttentionSpec) and isinstance(swa.kv_cache_spec, SlidingWindowSpec)
    kv.coordinator.single_type_managers.append(manager(SlidingWindowSpec(), {}))
    assert provenance_groups(kv) is None


def test_the_positions_written_before_the_step_and_both_tables():
    requests = {"a": SimpleNamespace(num_computed_tokens=10, all_token_ids=list(range(11))),
                "b": SimpleNamespace(num_computed_tokens=5, all_token_ids=list(range(5)))}
    kv = kv_manager({"a": [1, 2, 3], "b": [4, 5]}, {"a": [0, 7, 8], "b": [9, 10]})
    view = provenance_view(kv, requests, ["a", "b"], [1, 5])
    assert view.seq_lens_cpu == [9, 0]
    assert view.kv_cache_groups == (1, 0) and view.sliding_window == 64 and view.swa_eviction_allowance == 4
    rows, positions = torch.tensor([0, 0, 1]), torch.tensor([2, 9, 4])
    assert view.req_to_token[rows, positions].tolist() == [1 * 4 + 2, 3 * 4 + 1, 5 * 4]
    assert view.swa_req_to_token.live_slots(rows, positions).tolist() == [0, 8 * 4 + 1, 10 * 4]  # block 0: none
    assert view.token_ids[0] is requests["a"].all_token_ids  # the request's own list, not a copy


def test_a_prefix_hit_on_a_block_the_step_still_writes_stops_before_it():
    # "b" was admitted in this step with a hit on "a"'s blocks 1 and 2 (8 tokens); "a" writes its
    # positions 4 .. 9 in this step (block 2 and 3): "b"'s positions stop at block 2's first
    requests = {"a": SimpleNamespace(num_computed_tokens=10, all_token_ids=list(range(10))),
                "b": SimpleNamespace(num_computed_tokens=9, all_token_ids=list(range(9)))}
    kv = kv_manager({"a": [1, 2, 3], "b": [1, 2, 6]}, {"a": [7, 8, 9], "b": [7, 8, 11]})
    view = provenance_view(kv, requests, ["a", "b"], [6, 1])
    assert view.seq_lens_cpu == [4, 4]
