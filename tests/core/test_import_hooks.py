"""Post-import hooks (``otel_swa.import_hooks``) on real modules written to disk."""

from __future__ import annotations

import importlib
import sys

import pytest

from otel_swa import import_hooks


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh importable package ``hooked_pkg_<n>`` with submodules ``a`` and ``b``."""
    name = f"hooked_pkg_{len(list(tmp_path.parent.iterdir()))}_{tmp_path.name[-6:]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("VALUE = 1\nclass Thing:\n    def run(self):\n        return 'a'\n")
    (root / "b.py").write_text("raise RuntimeError('b fails to import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def test_hook_runs_once_right_after_the_first_import(package):
    seen = []
    import_hooks.when_imported(f"{package}.a", lambda module: seen.append(module.VALUE))
    assert seen == []  # nothing imported by registering
    assert f"{package}.a" not in sys.modules
    module = importlib.import_module(f"{package}.a")
    assert seen == [1]
    importlib.import_module(f"{package}.a")
    assert seen == [1]
    # the module keeps its real loader
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert type(module.__spec__.loader).__name__ == "SourceFileLoader"


def test_hook_on_an_imported_module_runs_at_once(package):
    module = importlib.import_module(f"{package}.a")
    seen = []
    handle = import_hooks.when_imported(f"{package}.a", seen.append)
    assert seen == [module] and handle.done


def test_hooks_run_in_order_and_a_failing_hook_breaks_nothing(package, caplog):
    seen = []

    def broken(module):
        raise ValueError("hook bug")

    import_hooks.when_imported(f"{package}.a", lambda m: seen.append("first"))
    import_hooks.when_imported(f"{package}.a", broken)
    import_hooks.when_imported(f"{package}.a", lambda m: seen.append("third"))
    module = importlib.import_module(f"{package}.a")
    assert module.Thing().run() == "a"
    assert seen == ["first", "third"]
    assert any("hook bug" in (r.exc_text or "") or r.exc_info for r in caplog.records if "post-import hook" in r.getMessage())


def test_cancelled_hook_never_runs(package):
    seen = []
    handle = import_hooks.when_imported(f"{package}.a", seen.append)
    import_hooks.cancel(handle)
    importlib.import_module(f"{package}.a")
    assert seen == [] and not handle.done


def test_a_module_that_fails_to_import_runs_no_hook_and_raises_its_own_error(package):
    seen = []
    import_hooks.when_imported(f"{package}.b", seen.append)
    with pytest.raises(RuntimeError, match="b fails to import"):
        importlib.import_module(f"{package}.b")
    assert seen == []


def test_a_second_finder_that_also_asks_the_meta_path_does_not_loop(package, monkeypatch):
    """Another post-import finder placed before ours (as test harnesses and other instrumentations
    install) looks the module up through the meta path too; neither may bring the lookup back."""
    applied = []

    class OtherFinder:
        busy = False

        def find_spec(self, fullname, path=None, target=None):
            if fullname != f"{package}.a" or self.busy:
                return None
            self.busy = True
            try:
                for finder in sys.meta_path:
                    if finder is not self:
                        spec = finder.find_spec(fullname, path, target)
                        if spec is not None:
                            applied.append("other")
                            return spec
            finally:
                self.busy = False
            return None

    seen = []
    import_hooks.when_imported(f"{package}.a", lambda m: seen.append(m.VALUE))
    monkeypatch.setattr(sys, "meta_path", [OtherFinder(), *sys.meta_path])
    importlib.import_module(f"{package}.a")
    assert seen == [1] and applied == ["other"]
