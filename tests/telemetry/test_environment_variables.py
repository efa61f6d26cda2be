"""Every variable of ``otel_swa.environment_variables``, each with bad values: ``otel-swa replay``
exits 2 naming the variable, the value and what was expected (one line, one shape), and an engine
instrumentor logs the same and wraps nothing, the engine running as it is.

The table below must name every variable of the module: a variable added later without bad
values here (or without a reader in :data:`otel_swa.config.VARIABLE_READERS`) fails the first test.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from otel_swa import config
from otel_swa import environment_variables as ev
from otel_swa.cli import main

#: variable -> (bad values, what the error says was expected). Every variable has a word among its
#: bad values (a word for a switch, a word for a number; not for the list of names), and every
#: numeric or 0/1 one a negative.
BAD_VALUES = {
    ev.OTEL_SWA_DIVERGENCE_INTERVAL: (["abc", "-3", "2.5", "yes"], "an integer >= 0"),
    ev.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL: (["abc", "-1", "1e3", "on"], "an integer >= 0"),
    ev.OTEL_SWA_RING_SIZE: (["abc", "-1", "0", "1025", "true"], "an integer from 1 to 1024"),
    ev.OTEL_SWA_TP_RANK: (["x", "-1", "1.5", "first"], "an integer >= 0"),
    ev.OTEL_SWA_DP_RANK: (["x", "-2", "0.5", "first"], "an integer >= 0"),
    ev.OTEL_SWA_PP_RANK: (["x", "-1", "2.0", "last"], "an integer >= 0"),
    ev.OTEL_SWA_REQUIRE_SGLANG: (["maybe", "true", "yes", "2", "-1"], "0 or 1"),
    ev.OTEL_SWA_REQUIRE_VLLM: (["maybe", "true", "no", "2", "-1"], "0 or 1"),
    ev.OTEL_SWA_SIGTERM_FLUSH: (["maybe", "true", "off", "2", "-1"], "0 or 1"),
    ev.OTEL_SWA_METRIC_EXPORT_INTERVAL: (["xyz", "-1", "1.5", "off"], "an integer >= 0"),
    ev.OTEL_SWA_MICRO_BATCHES: (["some", "all", "2", "-1", "true"], "one of one, every"),
    ev.OTEL_SWA_LIVENESS_STEPS: (["-4", "abc", "2.5", "never"], "an integer >= 0"),
    ev.OTEL_SWA_FORWARD_SPANS: (["maybe", "every", "1", "-1", "true"], "one of sampled, all, off"),
    ev.OTEL_SWA_READ_CHECK: (["maybe", "on", "1", "-1", "true"], "one of rotate, all, off"),
    ev.OTEL_SWA_READ_CHECK_QUERIES: (["0", "257", "-1", "abc", "many"], "an integer from 1 to 256"),
    ev.OTEL_SWA_WARNED: (["swa_sglang;swa_vllm", "swa sglang", "all!"],
                         "instrumentor names separated by commas (set by otel-swa itself)"),
    ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET: (["-1", "abc", "1.5", "local"], "'rank' or an integer >= 0"),
    ev.OTEL_SWA_PROMETHEUS_LINGER: (["-1", "soon", "601", "nan", "inf"], "seconds from 0 to 600"),
    ev.OTEL_SWA_GRAPH_CHECKS: (["maybe", "on", "1", "-1", "true"], "one of masked, conditional"),
    ev.OTEL_SWA_PROVENANCE: (["maybe", "on", "1", "-1", "true"], "one of all, prefix, off"),
    ev.OTEL_SWA_PROVENANCE_BUDGET: (["0", "1048577", "-1", "abc", "many", "2.5"], "an integer from 1 to 1048576"),
}
CASES = [(name, value) for name, (values, _) in BAD_VALUES.items() for value in values]


def module_variables() -> set:
    """Every variable name the module defines (upper-case constants holding their own name)."""
    return {value for key, value in vars(ev).items() if key.isupper() and value == key}


def expected_error(name: str, value: str) -> str:
    return f"{name}={value!r}: expected {BAD_VALUES[name][1]}"


@pytest.fixture
def clean_environment(monkeypatch):
    for name in module_variables():  # CI scripts set some of them for the whole run
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_variable_has_bad_values_here_and_a_reader_that_validates_it():
    names = module_variables()
    assert len(names) >= 18
    assert set(BAD_VALUES) == names, "each variable needs its bad values in BAD_VALUES"
    assert set(config.VARIABLE_READERS) == names, "each variable needs its reader in config.VARIABLE_READERS"
    for name, (values, expected) in BAD_VALUES.items():
        assert values, name
        if "names" not in expected:  # a word is a name, the one thing OTEL_SWA_WARNED holds
            assert any(value.isalpha() for value in values), name
        if "integer" in expected or "seconds" in expected or expected == "0 or 1":
            assert any(value.startswith("-") for value in values), name


@pytest.mark.parametrize("name, value", CASES)
def test_each_bad_value_is_an_error_of_its_reader_and_of_the_whole_check(name, value):
    with pytest.raises(config.ConfigError) as info:
        config.VARIABLE_READERS[name]({name: value})
    assert str(info.value) == expected_error(name, value)
    with pytest.raises(config.ConfigError) as info:
        config.check_environment({name: value})
    assert str(info.value) == expected_error(name, value)


def test_good_values_and_unset_variables_pass_the_check():
    config.check_environment({})
    config.check_environment({
        ev.OTEL_SWA_DIVERGENCE_INTERVAL: "20", ev.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL: "0",
        ev.OTEL_SWA_RING_SIZE: "1024", ev.OTEL_SWA_TP_RANK: "3", ev.OTEL_SWA_DP_RANK: "0", ev.OTEL_SWA_PP_RANK: "1",
        ev.OTEL_SWA_REQUIRE_SGLANG: "1", ev.OTEL_SWA_REQUIRE_VLLM: "0", ev.OTEL_SWA_SIGTERM_FLUSH: " 0 ",
        ev.OTEL_SWA_METRIC_EXPORT_INTERVAL: "0", ev.OTEL_SWA_MICRO_BATCHES: "EVERY", ev.OTEL_SWA_LIVENESS_STEPS: "0",
        ev.OTEL_SWA_FORWARD_SPANS: "off", ev.OTEL_SWA_READ_CHECK: "all", ev.OTEL_SWA_READ_CHECK_QUERIES: "256",
        ev.OTEL_SWA_WARNED: "swa_sglang,swa_vllm", ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET: "Rank",
        ev.OTEL_SWA_PROMETHEUS_LINGER: "2.5", ev.OTEL_SWA_GRAPH_CHECKS: "Conditional", ev.OTEL_SWA_PROVENANCE: "all",
        ev.OTEL_SWA_PROVENANCE_BUDGET: "1048576",
    })
    assert config.sigterm_flush({ev.OTEL_SWA_SIGTERM_FLUSH: "0"}) is False
    assert config.require_sglang({ev.OTEL_SWA_REQUIRE_SGLANG: "1"}) is True
    assert config.warned_names({ev.OTEL_SWA_WARNED: " swa_sglang , swa_vllm "}) == ["swa_sglang", "swa_vllm"]
    assert config.prometheus_port_offset({ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET: "2"}) == 2
    assert config.provenance({ev.OTEL_SWA_PROVENANCE: " ALL ", ev.OTEL_SWA_PROVENANCE_BUDGET: "16"}) == ("all", 16)
    assert config.provenance({ev.OTEL_SWA_PROVENANCE: "off"}) is None
    assert config.graph_checks({}) == "masked"


@pytest.mark.parametrize("name, value", CASES)
def test_replay_exits_2_naming_the_variable_the_value_and_what_was_expected(clean_environment, capsys, name, value):
    clean_environment.setenv(name, value)
    # --interval given: the run would not need the interval variables, and is still refused
    assert main(["replay", "--requests", "2", "--no-model", "--interval", "5", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"otel-swa replay: {expected_error(name, value)}\n"


def test_a_bad_marker_of_logged_warnings_never_stops_a_warning_once(clean_environment):
    environ = {ev.OTEL_SWA_WARNED: "swa sglang"}
    assert config.warn_once("swa_vllm", environ) is True
    assert environ[ev.OTEL_SWA_WARNED] == "swa_vllm"
    assert config.warn_once("swa_vllm", environ) is False


# ------------------------------------------------------------------ inside an engine
def test_the_reference_instrumentor_logs_a_bad_value_and_leaves_the_engine_as_it_is(clean_environment, pipeline, caplog):
    from opentelemetry.instrumentation.swa_reference import ENGINE_ATTRIBUTE, SwaReferenceInstrumentor
    from otel_swa.reference.engine import EngineConfig, ReferenceEngine

    originals = dict(vars(ReferenceEngine))
    clean_environment.setenv(ev.OTEL_SWA_DIVERGENCE_INTERVAL, "2")
    for name, (values, _) in BAD_VALUES.items():
        clean_environment.setenv(name, values[0])
        caplog.clear()
        instrumentor = SwaReferenceInstrumentor()
        with caplog.at_level(logging.ERROR):
            instrumentor.instrument(**pipeline.providers())
        try:
            assert dict(vars(ReferenceEngine)) == originals, name  # nothing wrapped
            engine = ReferenceEngine(EngineConfig(full_pool_size=256, swa_pool_size=64, window=8, max_running=2,
                                                  token_budget=16, max_context_len=64, step_time_s=0.0))
            assert not hasattr(engine, ENGINE_ATTRIBUTE) and engine.reporter is None
            assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
                f"otel-swa: the reference engine is not instrumented: {expected_error(name, values[0])}"]
        finally:
            instrumentor.uninstrument()
        clean_environment.delenv(name)


class _StandInInstrumentor:
    """An engine instrumentor over a module made here (SGLang's and vLLM's share its base)."""

    @staticmethod
    def make():
        from otel_swa.engine_wrapping import EngineInstrumentor

        module = types.ModuleType("otel_swa_standin_engine")

        class Scheduler:
            def step(self, batch):
                return batch

        module.Scheduler = Scheduler

        class StandIn(EngineInstrumentor):
            name = "swa_standin"
            engine = "StandIn"
            distribution = "otel-swa-standin"
            instruments = ("otel-swa-standin >= 1.0",)
            wrapped = (("otel_swa_standin_engine", "Scheduler", "step", ("batch",)),)

            def _wrappers(self):
                return (lambda original: original,)

        return module, StandIn


def test_an_engine_instrumentor_logs_a_bad_value_and_wraps_nothing(clean_environment, pipeline, caplog, monkeypatch):
    module, cls = _StandInInstrumentor.make()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    step = module.Scheduler.__dict__["step"]
    clean_environment.setenv(ev.OTEL_SWA_DIVERGENCE_INTERVAL, "2")
    for name, (values, _) in BAD_VALUES.items():
        clean_environment.setenv(name, values[-1])
        caplog.clear()
        instrumentor = cls()
        with caplog.at_level(logging.ERROR):
            instrumentor.instrument(skip_dep_check=True, **pipeline.providers())
        try:
            assert module.Scheduler.__dict__["step"] is step and not instrumentor._hooks, name
            assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
                f"swa_standin: StandIn is not instrumented: {expected_error(name, values[-1])}"]
        finally:
            instrumentor.uninstrument()
        clean_environment.delenv(name)
