"""Environment gate and ring size: values, fallback, and errors naming the variable and value."""

import pytest

from otel_swa.config import ConfigError, divergence_interval, ring_size
from otel_swa.reporter import SwaDivergenceReporter

OURS = "OTEL_SWA_DIVERGENCE_INTERVAL"
SGL = "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, 0),
        ({OURS: "20"}, 20),
        ({OURS: " 7 "}, 7),
        ({SGL: "20"}, 20),
        ({OURS: "5", SGL: "20"}, 5),
        ({OURS: "0", SGL: "20"}, 0),
        ({OURS: "", SGL: "3"}, 3),
    ],
)
def test_interval(env, expected):
    assert divergence_interval(env) == expected


@pytest.mark.parametrize("name", [OURS, SGL])
@pytest.mark.parametrize("value", ["abc", "-3", "2.5", "1e3"])
def test_invalid_interval_names_variable_and_value(name, value):
    with pytest.raises(ConfigError) as info:
        divergence_interval({name: value})
    assert name in str(info.value) and repr(value) in str(info.value)


def test_ring_size():
    assert ring_size({}) == 4
    assert ring_size({"OTEL_SWA_RING_SIZE": "8"}) == 8
    with pytest.raises(ConfigError, match="OTEL_SWA_RING_SIZE='0'"):
        ring_size({"OTEL_SWA_RING_SIZE": "0"})


def test_from_env_off_means_no_reporter():
    assert SwaDivergenceReporter.from_env(environ={}) is None
    assert SwaDivergenceReporter.from_env(environ={OURS: "0"}) is None


def test_from_env_on():
    reporter = SwaDivergenceReporter.from_env(environ={SGL: "20", "OTEL_SWA_RING_SIZE": "2"})
    assert reporter is not None and reporter.interval == 20


def test_provenance_variables():
    from otel_swa import config

    assert config.provenance({}) == ("all", 4096)
    assert config.provenance({"OTEL_SWA_PROVENANCE": " ALL ", "OTEL_SWA_PROVENANCE_BUDGET": "64"}) == ("all", 64)
    assert config.provenance({"OTEL_SWA_PROVENANCE": "prefix"}) == ("prefix", 4096)
    assert config.provenance({"OTEL_SWA_PROVENANCE": "off", "OTEL_SWA_PROVENANCE_BUDGET": "64"}) is None
    for bad in ({"OTEL_SWA_PROVENANCE": "full"}, {"OTEL_SWA_PROVENANCE_BUDGET": "0"},
                {"OTEL_SWA_PROVENANCE_BUDGET": "2.5"}):
        with pytest.raises(config.ConfigError, match="OTEL_SWA_PROVENANCE"):
            config.provenance(bad)


def test_graph_checks_variable_reaches_the_reporter():
    from otel_swa import config

    assert config.graph_checks({}) == "masked"
    with pytest.raises(config.ConfigError, match="OTEL_SWA_GRAPH_CHECKS"):
        config.graph_checks({"OTEL_SWA_GRAPH_CHECKS": "always"})
    reporter = SwaDivergenceReporter.from_env(environ={"OTEL_SWA_DIVERGENCE_INTERVAL": "5",
                                                       "OTEL_SWA_GRAPH_CHECKS": "Conditional"})
    assert reporter.gate.graph_mode == "conditional"
