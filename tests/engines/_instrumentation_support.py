"""Helpers for the instrumentor tests: the in-memory OpenTelemetry pipeline (``pipeline_support``) and
stand-in engine packages registered as installed distributions (so ``BaseInstrumentor``'s version check runs)."""

from __future__ import annotations

import importlib
import logging
import sys
import types
from pathlib import Path

from pipeline_support import Pipeline  # noqa: F401 (the instrumentor tests import it from here)


def install_distribution(monkeypatch, tmp_path: Path, distribution: str, version: str) -> None:
    """A ``<distribution>-<version>.dist-info`` with its ``METADATA`` in ``tmp_path``, put on ``sys.path``
    (undone by ``monkeypatch``). The folder's name has ``_`` for ``-``, as pip writes it: the
    metadata finder takes a folder's name up to its first ``-`` as the distribution's."""
    info = tmp_path / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def engine_on_disk(monkeypatch, tmp_path: Path, package: str, files: dict[str, str], distribution: str, version: str):
    """A stand-in engine package written to ``tmp_path`` (``files``: path in the package -> source),
    installed as ``distribution`` ``version`` (:func:`install_distribution`), with
    ``OTEL_SWA_DIVERGENCE_INTERVAL=5``; a generator for a fixture: yields the package's folder and,
    after the test, forgets every module of the package that was imported."""
    root = tmp_path / package
    for relative, source in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(source)
    install_distribution(monkeypatch, tmp_path, distribution, version)
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "5")
    importlib.invalidate_caches()
    yield root
    for module in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[module]


def instrument_as_the_loader(instrumentor, pipeline, monkeypatch, caplog, logger: str) -> list[str]:
    """``instrument()`` called as ``opentelemetry-instrument`` calls it (``skip_dep_check=True``), with
    ``OTEL_SWA_DIVERGENCE_INTERVAL=1``; the messages of WARNING and above logged under ``logger``."""
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(skip_dep_check=True, **pipeline.providers())
    return [r.getMessage() for r in caplog.records if r.name == logger]


def install_standin(monkeypatch, tmp_path: Path, distribution: str, version: str, modules: dict[str, dict]) -> None:
    """Register stand-in modules in ``sys.modules`` and a ``<distribution>-<version>.dist-info`` on
    ``sys.path`` (both undone by ``monkeypatch``). ``modules``: dotted name -> attributes; parent
    packages are created empty."""
    install_distribution(monkeypatch, tmp_path, distribution, version)
    names = set()
    for dotted in modules:
        parts = dotted.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name in sorted(names):
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so that children import
        for key, value in modules.get(name, {}).items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)


def vllm_instrumentor():
    """The body of an ``instrumentor`` fixture: a ``SwaVllmInstrumentor``, uninstrumented after the test
    (``instrumentor = pytest.fixture(vllm_instrumentor, name="instrumentor")``)."""
    from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor

    made = SwaVllmInstrumentor()
    yield made
    made.uninstrument()
