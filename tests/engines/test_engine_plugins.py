"""otel-swa's engine plugins (``opentelemetry.instrumentation.swa_plugins``) as installed, without the
engines: the entry points, what a switched-off plugin costs an engine process, and what a
switched-on plugin does where its engine is missing. Inside the real engines: the SGLang and vLLM
suites (``test_sglang_engine.py``, ``test_sglang_server.py``, ``test_vllm_plugin.py``).

Each plugin call runs in a fresh interpreter, as in an engine process: ``sys.modules`` and
OpenTelemetry's global providers are the process's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

PLUGINS = {"sglang.srt.plugins": "opentelemetry.instrumentation.swa_plugins:load_sglang",
           "vllm.general_plugins": "opentelemetry.instrumentation.swa_plugins:load_vllm"}
#: What a switched-off plugin may import beyond the standard library: itself, and otel-swa's
#: variables (the namespace packages ``opentelemetry`` / ``opentelemetry.instrumentation`` are
#: directories, no code).
ALLOWED = {"opentelemetry", "opentelemetry.instrumentation", "opentelemetry.instrumentation.swa_plugins",
           "otel_swa", "otel_swa.config", "otel_swa.environment_variables"}

#: Loads both plugins as the engines do (the entry point, then its call) and prints what that cost:
#: the modules it imported, the milliseconds, whether a global tracer provider was installed.
PROBE = r"""
import json, sys, time
for name in sys.argv[1:]:  # what an engine process has imported long before it loads its plugins
    __import__(name)
from importlib.metadata import entry_points
# the engines' loaders find the entry points whatever is installed; what otel-swa adds starts here
found = [ep for group in ("sglang.srt.plugins", "vllm.general_plugins") for ep in entry_points(group=group)
         if ep.name == "otel_swa"]
before = set(sys.modules)
start = time.perf_counter()
loaded = [ep.load() for ep in found]
imported = time.perf_counter()
for load in loaded:
    load()
done = time.perf_counter()
added = sorted(set(sys.modules) - before)
provider = type(sys.modules["opentelemetry.trace"].get_tracer_provider()).__name__ if "opentelemetry.trace" in sys.modules else None
print(json.dumps({"plugins": len(loaded), "added": added, "load_ms": (imported - start) * 1e3,
                  "call_ms": (done - imported) * 1e3, "tracer_provider": provider}))
"""


def _run(env: dict, *preload: str) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    proc = subprocess.run([sys.executable, "-c", PROBE, *preload], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_entry_points_name_both_plugins_otel_swa():
    for group, value in PLUGINS.items():
        assert [ep.value for ep in entry_points(group=group) if ep.name == "otel_swa"] == [value], group


@pytest.mark.parametrize("env", [{}, {"OTEL_SWA_DIVERGENCE_INTERVAL": "0"},
                                 {"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "0"}],
                         ids=["unset", "otel-swa's variable 0", "sglang's variable 0"])
def test_switched_off_the_plugins_import_nothing_but_the_switch(env, capsys):
    # cold: a bare interpreter; warm: one that has the standard modules an engine has long imported
    cold, stderr = _run(env)
    warm, _ = _run(env, "typing", "logging", "math")
    for measured in (cold, warm):
        assert measured["plugins"] == 2
        extra = [m for m in measured["added"] if m not in ALLOWED and m.split(".")[0] not in sys.stdlib_module_names]
        assert extra == [], extra  # no torch, no OpenTelemetry API or SDK, no instrumentor, no engine
        assert measured["tracer_provider"] is None
    assert stderr == ""
    with capsys.disabled():  # the cost, printed (a benchmark's figure, never asserted)
        print(f"\n  plugins switched off ({env or 'unset'}): entry points loaded in {cold['load_ms']:.2f} ms cold / "
              f"{warm['load_ms']:.2f} ms in a process with typing, logging and math loaded; "
              f"both called in {cold['call_ms']:.3f} / {warm['call_ms']:.3f} ms; imported {cold['added']}")


def test_an_unusable_value_is_logged_once_and_switches_nothing_on():
    measured, stderr = _run({"OTEL_SWA_DIVERGENCE_INTERVAL": "twenty"})
    assert [line for line in stderr.splitlines() if "OTEL_SWA_DIVERGENCE_INTERVAL='twenty'" in line] == [
        "otel-swa: OTEL_SWA_DIVERGENCE_INTERVAL='twenty': expected an integer >= 0; "
        "the engine is not instrumented"]  # the SGLang plugin said it; the vLLM one, same tree, did not again
    assert "opentelemetry.instrumentation.swa_sglang" not in measured["added"] and measured["tracer_provider"] is None


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_switched_on_without_its_engine_a_plugin_says_so_once_and_sets_nothing_up(engine):
    import importlib.util

    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here (its suite runs the plugin)")
    code = ("import sys; from opentelemetry.instrumentation import swa_plugins; "
            f"swa_plugins.load_{engine}(); swa_plugins.load_{engine}(); "
            "from opentelemetry.instrumentation.swa_plugins.activate import outcomes; "
            "from opentelemetry import trace; print(outcomes, type(trace.get_tracer_provider()).__name__)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, "OTEL_SWA_DIVERGENCE_INTERVAL": "20"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [f"{{'{engine}':", "'engine", "unavailable'}", "ProxyTracerProvider"]
    warnings = [line for line in proc.stderr.splitlines() if "not installed" in line]
    assert len(warnings) == 1 and f"swa_{engine}: {engine} is not installed" in warnings[0], proc.stderr


def test_a_switched_on_plugin_with_nothing_configured_writes_the_line_to_the_process_log():
    """The set-up a plugin makes when no ``OTEL_*`` variable says anything: otel-swa's line through
    Python logging (the engine's log), traces and metrics not exported; a reporter attached to it
    writes its records there."""
    code = r"""
import logging, torch
logging.basicConfig(format="[engine log] %(message)s", level=logging.WARNING)
from otel_swa.telemetry.setup import configure_like_the_distro
from otel_swa.reporter import SwaDivergenceReporter, KVPool
from otel_swa.views import SwaBatch
telemetry = configure_like_the_distro()
print(telemetry.exporters)
reporter = telemetry.attach(SwaDivergenceReporter(1, device="cpu"))
req_to_token = torch.zeros((2, 8), dtype=torch.int32); req_to_token[1, :6] = torch.arange(1, 7)
mapping = torch.zeros(8, dtype=torch.int64); mapping[3:7] = torch.tensor([1, 2, 5, 4])
reporter.observe(KVPool.FULL, 6); reporter.observe(KVPool.SWA, 4)
reporter.step(SwaBatch(full_to_swa_index_mapping=mapping, req_to_token=req_to_token,
                       req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([6])))
reporter.close()
"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    proc = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "{'traces': [], 'metrics': [], 'logs': ['swa_logline']}"
    # slots 1, 2 hold tokens out of the window (mapping 0); of 3..6, 5 -> 5 is not remapped
    assert ('[engine log] otel_swa[verify=attention] kv_canary_swa_divergence={"forward_ct":1,"verify_full":6,'
            '"verify_swa":4,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":2}') in proc.stderr.splitlines()


def test_the_suites_probe_looks_at_every_method_the_sglang_instrumentor_wraps():
    from pathlib import Path

    from opentelemetry.instrumentation.swa_sglang import WRAPPED, stop_paths

    sys.path.insert(0, str(Path(__file__).parent / "shims" / "sglang_cpu"))
    try:
        import sglang_step_probe
    finally:
        sys.path.pop(0)
    assert sglang_step_probe.INSTRUMENTED == tuple(spec[:3] for spec in WRAPPED + stop_paths.WRAPPED)


@pytest.mark.parametrize("environ, exporters, filled", [
    ({}, "logline", {}),
    ({"OTEL_SERVICE_NAME": "engine"}, "logline", {}),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "otlp,logline", {}),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4318/v1/metrics"}, "otlp,logline", {}),
    ({"OTEL_METRICS_EXPORTER": "prometheus"}, None,
     {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "prometheus", "OTEL_LOGS_EXPORTER": "otlp"}),
    ({"OTEL_LOGS_EXPORTER": "otlp,swa_logline", "OTEL_TRACES_EXPORTER": "none"}, None,
     {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "otlp,swa_logline"}),
], ids=["nothing", "a resource only", "an endpoint", "a signal's endpoint", "one exporter", "two exporters"])
def test_a_plugin_chooses_the_exporters_the_distro_would_and_keeps_the_line_when_nothing_says_otherwise(
        environ, exporters, filled):
    from otel_swa.telemetry.setup import distro_exporters

    given = dict(environ)
    chosen, env = distro_exporters(given)
    assert chosen == exporters
    assert given == environ  # the mapping given (os.environ by default, which children inherit) is left alone
    for name, value in filled.items():
        assert env[name] == value
