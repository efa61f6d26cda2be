"""When the SGLang instrumentor switches the KV's provenance on, and how it judges slots never
stamped: on with HiCache (its host pools' copies carry the stamps), off where SGLang fills slots
without a forward step otherwise (LMCache, disaggregation move bytes, not stamps), off for a model runner wired after its graphs were captured (their replays write
KV without stamps), and never-stamped slots counted unchecked for a runner wired late without graphs
(its cache may hold KV from before). No sglang needed: stand-ins below."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from opentelemetry.instrumentation.swa_sglang import _enable_provenance
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views.sglang import kv_filled_outside_forward


def runner(**server_args):
    """Stands for sglang 0.5.23's ``ModelRunner``: ``server_args`` and a ``token_to_kv_pool`` shaped
    as ``SWAKVPool`` (``full_kv_pool`` / ``swa_kv_pool`` with per-layer ``k_buffer``, and
    ``layers_mapping``: layer id -> (index in its sub-pool, is_swa)); no speculative decoding."""
    pool = SimpleNamespace(
        full_kv_pool=SimpleNamespace(k_buffer=[torch.zeros(64, 1, 4)]),
        swa_kv_pool=SimpleNamespace(k_buffer=[torch.zeros(32, 1, 4)]),
        layers_mapping={0: (0, True), 1: (0, False)},
    )
    return SimpleNamespace(server_args=SimpleNamespace(**server_args), token_to_kv_pool=pool, spec_algorithm=None)


class DisaggregationMode:  # sglang's enum: its members carry .value
    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("args, expected", [
    ({}, None),
    ({"enable_hierarchical_cache": False, "enable_lmcache": False, "disaggregation_mode": "null"}, None),
    ({"disaggregation_mode": DisaggregationMode("null")}, None),
    ({"enable_hierarchical_cache": True}, None),  # its host pools' copies move the stamps too
    ({"enable_lmcache": True}, "LMCache loads KV from its store"),
    ({"enable_unified_memory": True}, "unified memory compacts KV pages by copying them"),
    ({"disaggregation_mode": "decode"}, "a disaggregated decode receives the prefill's KV"),
    ({"disaggregation_mode": DisaggregationMode("prefill")}, None),  # a prefill instance computes its KV
    ({"disaggregation_mode": DisaggregationMode("decode")}, "a disaggregated decode receives the prefill's KV"),
])
def test_kv_filled_outside_forward_names_the_setting(args, expected):
    assert kv_filled_outside_forward(runner(**args)) == expected


@pytest.fixture
def reporter(monkeypatch):
    monkeypatch.setenv("OTEL_SWA_PROVENANCE", "prefix")
    made = SwaDivergenceReporter(1, device="cpu")
    yield made
    made.close()


def test_provenance_is_on_and_judges_never_stamped_slots_for_a_runner_wired_before_capture(reporter):
    provenance, layout = _enable_provenance(reporter, runner())
    assert provenance.never_stamped == "foreign"
    assert (layout["full_slots"], layout["swa_slots"]) == (64, 32)


def test_provenance_is_on_with_hicache_and_follows_its_host_pools(reporter, caplog):
    with caplog.at_level(logging.INFO, logger="opentelemetry.instrumentation.swa_sglang"):
        provenance, layout = _enable_provenance(reporter, runner(enable_hierarchical_cache=True))
    assert provenance.never_stamped == "foreign" and layout["host_tier"].provenance is provenance
    assert "KV provenance is off" not in caplog.text and "L3 storage" not in caplog.text


def test_with_hicaches_l3_storage_one_line_says_so_and_never_stamped_slots_are_unchecked(reporter, caplog):
    with caplog.at_level(logging.INFO, logger="opentelemetry.instrumentation.swa_sglang"):
        provenance, _ = _enable_provenance(reporter, runner(enable_hierarchical_cache=True,
                                                            hicache_storage_backend="file"))
    assert provenance.never_stamped == "unchecked"
    lines = [r.getMessage() for r in caplog.records if "L3 storage" in r.getMessage()]
    assert lines == ["KV provenance: HiCache's L3 storage (file) fills host slots that no table follows; "
                     "slots loaded from it are counted unchecked"]


def test_a_runner_wired_late_with_graphs_gets_no_provenance_and_without_counts_never_stamped_unchecked(reporter, caplog):
    late = runner()
    late.decode_cuda_graph_runner = SimpleNamespace(can_run_graph=lambda forward_batch: True)
    with caplog.at_level(logging.INFO, logger="opentelemetry.instrumentation.swa_sglang"):
        assert _enable_provenance(reporter, late, late=True) is None
    assert "captured before otel-swa was wired" in caplog.text
    provenance, _ = _enable_provenance(reporter, runner(), late=True)
    assert provenance.never_stamped == "unchecked"
