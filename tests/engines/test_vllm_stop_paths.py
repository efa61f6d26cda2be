"""The wrapper of vLLM's ``vllm.v1.utils.shutdown(procs, timeout)``
(``opentelemetry.instrumentation.swa_vllm.stop_paths``): the engine core gets at least the SIGTERM
flush's time (the OTLP timeout less half a second) before vLLM's SIGKILL. The original here is a
stand-in with 0.32.0 / 0.33.0's signature that records what it was given; the real one runs in
the engine suite's server test (``test_vllm_server.py``, ``kill -TERM``)."""

from __future__ import annotations

import pytest

from opentelemetry.instrumentation.swa_vllm import stop_paths
from opentelemetry.instrumentation.swa_vllm.stop_paths import wrap_shutdown


def _recording():
    given = []

    def shutdown(procs, timeout=None):  # vllm/v1/utils.py line 605's signature
        given.append((procs, timeout))

    return shutdown, given


@pytest.mark.parametrize("timeout, expected", [(None, 3.5), (0, 3.5), (2.0, 3.5), (30.0, 30.0)])
def test_the_engine_core_gets_the_flushs_time_at_least(monkeypatch, timeout, expected):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "4")  # seconds, as the Python exporters read it
    original, given = _recording()
    wrapped = wrap_shutdown(original)
    procs = ["EngineCore_DP0"]
    wrapped(procs) if timeout is None else wrapped(procs, timeout)
    assert given == [(procs, expected)]
    assert wrapped.__wrapped__ is original


def test_a_failure_of_its_own_leaves_vllms_timeout(monkeypatch):
    original, given = _recording()

    def broken():
        raise RuntimeError("no timeout here")

    monkeypatch.setattr("otel_swa.lifecycle.sigterm_flush_timeout_s", broken)
    wrap_shutdown(original)(["EngineCore_DP0"], 0)
    assert given == [(["EngineCore_DP0"], 0)]


def _standin(monkeypatch, name: str):
    """A stand-in of vLLM's module ``name`` in ``sys.modules`` with the ``shutdown`` otel-swa wraps
    there: ``vllm.v1.engine.utils``'s function or ``vllm.v1.engine.core``'s ``EngineCore.shutdown``;
    returns ``(owner, original)``."""
    import sys
    import types

    module = types.ModuleType(name)
    if name == stop_paths.MODULE:
        module.shutdown = _recording()[0]
        owner = module
    else:
        class EngineCore:
            def shutdown(self):
                return None

        module.EngineCore = owner = EngineCore
    monkeypatch.setitem(sys.modules, name, module)
    return owner, vars(owner)["shutdown"]


@pytest.mark.parametrize("install, name", [("install", stop_paths.MODULE),
                                           ("install_engine_core_flush", stop_paths.CORE_MODULE)])
def test_installed_when_its_module_is_imported_and_restored(monkeypatch, install, name):
    """``install`` replaces vLLM's ``shutdown`` (a stand-in module here) once the module is imported,
    once however often it is called, and the original it records is what the instrumentor restores."""
    from otel_swa import import_hooks

    owner, original = _standin(monkeypatch, name)
    originals: dict = {}
    handle = getattr(stop_paths, install)(originals)
    try:
        assert owner.shutdown is not original and owner.shutdown.__wrapped__ is original
        assert originals == {(owner, "shutdown"): original}
        getattr(stop_paths, install)(originals)  # a second install leaves the wrapper as it is
        assert owner.shutdown.__wrapped__ is original
    finally:
        import_hooks.cancel(handle)


def test_a_function_of_other_parameters_is_left_alone(monkeypatch, caplog):
    import sys
    import types

    module = types.ModuleType(stop_paths.MODULE)
    module.shutdown = lambda processes, grace=None: None
    monkeypatch.setitem(sys.modules, stop_paths.MODULE, module)
    kept = module.shutdown
    originals: dict = {}
    stop_paths.install(originals)
    assert module.shutdown is kept and originals == {}
    assert any("is not vLLM's shutdown(procs, timeout)" in r.getMessage() for r in caplog.records)


def test_the_instrumentor_installs_it_only_when_it_instruments(monkeypatch, tmp_path):
    """Switched off (no interval variable): nothing waits for ``vllm.v1.engine.utils``."""
    from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor

    from otel_swa import import_hooks

    monkeypatch.delenv("OTEL_SWA_DIVERGENCE_INTERVAL", raising=False)
    instrumentor = SwaVllmInstrumentor()
    try:
        instrumentor.instrument(skip_dep_check=True)
        assert stop_paths.MODULE not in import_hooks._hooks
        assert stop_paths.CORE_MODULE not in import_hooks._hooks
    finally:
        instrumentor.uninstrument()


# A process whose SIGTERM is back at its default action (vLLM's engine core after its busy loop) is
# sent SIGTERM while otel-swa flushes (the API server's shutdown after the same Ctrl-C): the
# reporter's flush here sends it to its own process, then writes what it delivered.
_FLUSH_UNDER_SIGTERM = r"""
import os, signal, sys, time
from otel_swa import lifecycle

class Reporter:
    def flush(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        sys.stdout.write("delivered\n"); sys.stdout.flush()

reporter = Reporter()
lifecycle.track(reporter)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
getattr(lifecycle, sys.argv[1])(2.0)
sys.stdout.write("went on after the signal\n"); sys.stdout.flush()
"""


@pytest.mark.parametrize("flush, delivered", [("flush_holding_signals", True), ("flush_all", False)])
def test_a_sigterm_during_the_flush_waits_for_it_then_ends_the_process(tmp_path, flush, delivered):
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, OTEL_SWA_SIGTERM_FLUSH="0")
    run = subprocess.run([sys.executable, "-c", _FLUSH_UNDER_SIGTERM, flush], capture_output=True, text=True,
                         env=env, timeout=60)
    assert run.returncode == -signal.SIGTERM, run.stderr
    assert run.stdout == ("delivered\n" if delivered else "")


def test_the_engine_core_flushes_before_its_teardown(monkeypatch):
    """``EngineCore.shutdown``'s wrapper runs otel-swa's flush first, then vLLM's teardown, and
    returns what it returns; a flush that fails still tears down."""
    order = []

    class EngineCore:  # vllm/v1/engine/core.py: EngineCore.shutdown(self)
        def shutdown(self):
            order.append("teardown")
            return "torn down"

    monkeypatch.setattr("otel_swa.lifecycle.flush_holding_signals", lambda: order.append("flush"))
    wrapped = stop_paths.wrap_engine_core_shutdown(EngineCore.shutdown)
    assert wrapped(EngineCore()) == "torn down" and order == ["flush", "teardown"]

    def broken():
        raise RuntimeError("flush failed")

    monkeypatch.setattr("otel_swa.lifecycle.flush_holding_signals", broken)
    order.clear()
    assert wrapped(EngineCore()) == "torn down" and order == ["teardown"]
