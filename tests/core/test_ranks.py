"""Rank identity without configuration (otel_swa.ranks)."""

from __future__ import annotations

import sys
import types

import pytest

from otel_swa.config import ConfigError
from otel_swa.ranks import process_ranks


def _fake_dist(monkeypatch, *, initialized: bool, rank: int = 0, world: int = 1):
    """Stands in for torch.distributed after init_process_group (no process group here)."""
    dist = types.ModuleType("torch.distributed")
    dist.is_available = lambda: True
    dist.is_initialized = lambda: initialized
    dist.get_rank = lambda: rank
    dist.get_world_size = lambda: world
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)


def test_nothing_known_is_an_empty_identity(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    assert process_ranks({}) == {}


def test_an_initialised_process_group_gives_rank_and_world_size(monkeypatch):
    _fake_dist(monkeypatch, initialized=True, rank=3, world=4)
    assert process_ranks({}) == {"rank": 3, "world_size": 4}
    _fake_dist(monkeypatch, initialized=False, rank=3, world=4)
    assert process_ranks({}) == {}


def test_launcher_and_otel_swa_variables_win(monkeypatch):
    _fake_dist(monkeypatch, initialized=True, rank=3, world=4)
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "OTEL_SWA_TP_RANK": "1", "OTEL_SWA_PP_RANK": "2"}
    assert process_ranks(env) == {"rank": 5, "world_size": 8, "local_rank": 1, "tp": 1, "pp": 2}


@pytest.mark.parametrize("env, message", [({"RANK": "x"}, r"RANK='x': expected an integer >= 0"),
                                          ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0': expected an integer >= 1"),
                                          ({"OTEL_SWA_DP_RANK": "-1"}, r"OTEL_SWA_DP_RANK='-1': expected an integer >= 0")])
def test_bad_rank_variables_are_named(env, message):
    with pytest.raises(ConfigError, match=message):
        process_ranks(env)
