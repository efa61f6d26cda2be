"""``opentelemetry-instrument`` with all three instrumentors installed and only the reference engine
present (no sglang, no vllm): every entry point loads, the engine instrumentors each log one
warning and wrap nothing, and the reference instrumentor still produces its SGLang lines.

The loader of opentelemetry-instrumentation 0.66b2 (``auto_instrumentation/_load.py``) calls
``instrument(skip_dep_check=True)`` when the distribution declares no conflicting extra; it skips an
instrumentor that raises ``ImportError`` or ``DependencyConflictError`` (logging a traceback), and
re-raises any other exception, which ends all instrumentation ("Failed to auto initialize").
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys

import pytest
from reference_app_support import REFERENCE_APP

from opentelemetry.instrumentation.swa_sglang import SwaSglangInstrumentor
from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor
from otel_swa.record import find_all


ENGINES = {"swa_sglang": "sglang", "swa_vllm": "vllm"}


def _absent(module: str) -> bool:
    return importlib.util.find_spec(module) is None


@pytest.mark.parametrize("instrumentor_class, engine", [(SwaSglangInstrumentor, "sglang"), (SwaVllmInstrumentor, "vllm")])
def test_missing_engine_under_the_loaders_call_logs_one_warning_and_does_not_raise(
    instrumentor_class, engine, monkeypatch, caplog
):
    if not _absent(engine):
        pytest.skip(f"{engine} is installed here")
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    instrumentor = instrumentor_class()
    try:
        with caplog.at_level(logging.WARNING):
            instrumentor.instrument(skip_dep_check=True)  # what opentelemetry-instrument calls
        ours = [r for r in caplog.records if r.name.startswith("opentelemetry.instrumentation.swa_")]
        assert [r.levelno for r in ours] == [logging.WARNING]
        assert engine in ours[0].getMessage() and "not installed" in ours[0].getMessage()
        assert ours[0].exc_info is None  # one line, no traceback
    finally:
        instrumentor.uninstrument()


def test_opentelemetry_instrument_loads_every_entry_point_without_the_engines(tmp_path):
    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    from importlib.metadata import entry_points

    if launcher is None or not list(entry_points(group="opentelemetry_configurator")):
        pytest.skip("opentelemetry-instrument or a distro (pip install opentelemetry-distro) is missing")
    absent = [name for name, module in ENGINES.items() if _absent(module)]
    if not absent:
        pytest.skip("sglang and vllm are both installed here")
    app = tmp_path / "app.py"
    app.write_text(REFERENCE_APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({"OTEL_SWA_DIVERGENCE_INTERVAL": "4", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "swa_logline"})
    run = subprocess.run([launcher, sys.executable, str(app)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    for message in ("Failed to auto initialize", "Traceback", "Importing of", "Instrumenting of"):
        assert message not in run.stderr, run.stderr
    other = [line for line in run.stderr.splitlines() if "kv_canary_swa_divergence=" not in line]
    for name in absent:
        assert len([line for line in other if f"{name}:" in line and "not installed" in line]) == 1, run.stderr
    # the reference instrumentor, loaded from the same entry-point group, still works
    forward_ct = int(run.stdout.split("forward_ct")[1])
    assert forward_ct >= 8
    assert [r.forward_ct for r in find_all(run.stderr)] == list(range(4, forward_ct + 1, 4))
