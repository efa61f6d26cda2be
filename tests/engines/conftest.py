"""Engine tests: SGLang's real classes and a real ``sglang.Engine`` (markers ``sglang``,
``sglang_engine``), and the vLLM adapter and instrumentor.

The ``sglang`` tests run in their own environment (``.ci/sglang-tests.sh``). They are skipped when
SGLang cannot be imported, unless ``OTEL_SWA_REQUIRE_SGLANG=1`` (the CI script sets it), where a
failed import fails them instead.

Test-only shims (``shims/``) let SGLang load on a CPU-only machine. ``shims/install.py`` puts them
into the suite's environment for every process (the engine's spawned ones too); for the allocator
tests alone, the ``torchvision`` stand-in (its PyPI wheel does not install beside CPU torch) is also
put on ``sys.path`` here when SGLang is installed and no torchvision is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from otel_swa import config
from otel_swa import environment_variables as ev

_SHIMS = Path(__file__).parent / "shims"


def _install_shims() -> None:
    if importlib.util.find_spec("sglang") is None:
        return
    if importlib.util.find_spec("torchvision") is None:
        sys.path.append(str(_SHIMS / "torchvision_stub"))


_install_shims()


def _require_sglang() -> bool:
    return config.require_sglang()


@pytest.fixture(scope="session")
def sglang_modules():
    """SGLang's real classes (a namespace), or skip (fail under ``OTEL_SWA_REQUIRE_SGLANG=1``)."""
    try:
        import _sglang_sim
    except ImportError as exc:
        if _require_sglang():
            pytest.fail(f"{ev.OTEL_SWA_REQUIRE_SGLANG}=1 but SGLang does not import: {exc!r}")
        pytest.skip(f"SGLang is not importable here ({exc}); run .ci/sglang-tests.sh")
    return _sglang_sim


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "sglang" in item.keywords and "sglang_modules" not in getattr(item, "fixturenames", ()):
            item.fixturenames.append("sglang_modules")


@pytest.fixture
def pipeline():
    """An in-memory OpenTelemetry pipeline (spans, metrics, logs) for the instrumentor tests."""
    from _instrumentation_support import Pipeline

    p = Pipeline.make()
    yield p
    p.shutdown()
