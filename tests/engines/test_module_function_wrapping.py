"""An engine instrumentor can wrap a module-level function (SGLang's ``kill_process_tree``): an empty
class in its table. The function is replaced where it is defined and wherever the engine imported it
by name, before or after ``instrument()``, and ``uninstrument()`` puts the original back everywhere.

The engine is a package written to disk with its ``dist-info``, laid out as SGLang's is:
``utils/common.py`` defines the function, ``utils/__init__.py`` re-exports it with ``import *``,
``server.py`` imports it from ``utils``.
"""

from __future__ import annotations

import importlib

import pytest
from _instrumentation_support import engine_on_disk as on_disk

from otel_swa.engine_wrapping import EngineInstrumentor, EngineVersionError

ENGINE = "otel_swa_fn_engine"
#: The stand-in engine package: path in the package -> source.
ENGINE_FILES = {
    "__init__.py": "",
    "utils/common.py": "__all__ = ['kill_tree']\ndef kill_tree(pid, include_parent=True):\n    return pid\n",
    "utils/__init__.py": "from .common import *\n",
    "server.py": f"from {ENGINE}.utils import kill_tree\ndef stop(pid):\n    return kill_tree(pid)\n",
}


class FnEngineInstrumentor(EngineInstrumentor):
    name = "swa_fn_engine"
    engine = "FnEngine"
    distribution = "otel-swa-fn-engine"
    instruments = ("otel-swa-fn-engine >= 1.0",)
    more_wrapped = ((f"{ENGINE}.utils.common", "", "kill_tree", ("pid",)),)
    version_error = EngineVersionError

    def _wrappers(self):
        return ()

    def _more_wrappers(self):
        def wrap(original):
            def kill_tree(pid, *args, **kwargs):
                return ("flushed first", original(pid, *args, **kwargs))
            return kill_tree
        return (wrap,)


@pytest.fixture
def engine_on_disk(tmp_path, monkeypatch):
    yield from on_disk(monkeypatch, tmp_path, ENGINE, ENGINE_FILES, "otel-swa-fn-engine", "1.0")


def _modules():
    return [importlib.import_module(f"{ENGINE}.{name}") for name in ("utils.common", "utils", "server")]


@pytest.mark.parametrize("imported_first", [False, True], ids=["instrument-then-import", "import-then-instrument"])
def test_a_module_function_is_wrapped_wherever_it_was_imported_and_restored(engine_on_disk, pipeline, imported_first):
    if imported_first:
        common, utils, server = _modules()
        original = common.kill_tree
    instrumentor = FnEngineInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    try:
        if not imported_first:
            common, utils, server = _modules()
        assert server.stop(42) == ("flushed first", 42)
        assert common.kill_tree is utils.kill_tree is server.kill_tree
        original = instrumentor._originals[(common, "kill_tree")]
    finally:
        instrumentor.uninstrument()
    assert server.stop(42) == 42
    assert common.kill_tree is utils.kill_tree is server.kill_tree is original


def test_a_missing_module_function_is_a_version_error_naming_it(engine_on_disk, pipeline):
    (engine_on_disk / "utils" / "common.py").write_text("__all__ = []\n")
    importlib.import_module(f"{ENGINE}.utils.common")
    with pytest.raises(EngineVersionError, match=rf"has no {ENGINE}\.utils\.common\.kill_tree\(pid, \.\.\.\)"):
        FnEngineInstrumentor().instrument(**pipeline.providers())
