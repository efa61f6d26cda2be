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


@pytest.mark.parametrize("env,expected", [
    ({}, True), ({"OTEL_SWA_PROVENANCE": ""}, True), ({"OTEL_SWA_PROVENANCE": " On "}, True),
    ({"OTEL_SWA_PROVENANCE": "off"}, False), ({"OTEL_SWA_PROVENANCE": "OFF"}, False),
])
def test_provenance_switch(env, expected):
    from otel_swa.config import provenance

    assert provenance(env) is expected


def test_a_bad_provenance_value_is_named():
    from otel_swa.config import provenance

    with pytest.raises(ConfigError, match="OTEL_SWA_PROVENANCE='yes'; expected one of on, off"):
        provenance({"OTEL_SWA_PROVENANCE": "yes"})
