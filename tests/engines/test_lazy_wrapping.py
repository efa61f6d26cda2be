"""Engine instrumentors wrap lazily: a module is wrapped when the process imports it, never imported
for the instrumentor's sake, and an absent engine is reported once per process tree.

The engine here is a package written to disk with its ``dist-info`` (a real import, so the
post-import path runs), instrumented by a minimal :class:`EngineInstrumentor` subclass.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from _instrumentation_support import engine_on_disk as on_disk

from otel_swa.engine_wrapping import EngineInstrumentor, EngineVersionError

ENGINE = "otel_swa_lazy_engine"
#: The stand-in engine package: path in the package -> source.
ENGINE_FILES = {
    "__init__.py": "",
    "runner.py": "class Runner:\n    def forward(self, batch):\n        return batch\n",
    "scheduler.py": "class Scheduler:\n    def schedule(self):\n        return 'plan'\n",
}


class LazyEngineError(EngineVersionError):
    pass


class LazyEngineInstrumentor(EngineInstrumentor):
    name = "swa_lazy_engine"
    engine = "LazyEngine"
    distribution = "otel-swa-lazy-engine"
    instruments = ("otel-swa-lazy-engine >= 1.0",)
    wrapped = (
        (f"{ENGINE}.runner", "Runner", "forward", ("batch",)),
        (f"{ENGINE}.scheduler", "Scheduler", "schedule", ()),
    )
    version_error = LazyEngineError

    def _wrappers(self):
        def tag(label):
            def wrap(original):
                def wrapper(obj, *args, **kwargs):
                    return (label, original(obj, *args, **kwargs))
                return wrapper
            return wrap

        return (tag("forward-wrapped"), tag("schedule-wrapped"))


@pytest.fixture
def engine_on_disk(tmp_path, monkeypatch):
    yield from on_disk(monkeypatch, tmp_path, ENGINE, ENGINE_FILES, "otel-swa-lazy-engine", "1.2")


def test_modules_are_wrapped_when_the_process_imports_them(engine_on_disk, pipeline):
    instrumentor = LazyEngineInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    try:
        assert f"{ENGINE}.runner" not in sys.modules  # instrument() imported nothing
        runner = importlib.import_module(f"{ENGINE}.runner")
        assert runner.Runner().forward(3) == ("forward-wrapped", 3)
        assert f"{ENGINE}.scheduler" not in sys.modules  # still waiting for its own import
        scheduler = importlib.import_module(f"{ENGINE}.scheduler")
        assert scheduler.Scheduler().schedule() == ("schedule-wrapped", "plan")
    finally:
        instrumentor.uninstrument()
    assert runner.Runner().forward(3) == 3 and scheduler.Scheduler().schedule() == "plan"


def test_uninstrument_before_the_import_leaves_the_module_unwrapped(engine_on_disk, pipeline):
    instrumentor = LazyEngineInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    instrumentor.uninstrument()
    runner = importlib.import_module(f"{ENGINE}.runner")
    assert runner.Runner().forward(3) == 3


def test_an_already_imported_module_with_a_missing_method_raises_before_any_change(engine_on_disk, pipeline):
    (engine_on_disk / "scheduler.py").write_text("class Scheduler:\n    pass\n")
    runner = importlib.import_module(f"{ENGINE}.runner")
    importlib.import_module(f"{ENGINE}.scheduler")
    instrumentor = LazyEngineInstrumentor()
    with pytest.raises(LazyEngineError, match=r"1\.2 has no otel_swa_lazy_engine\.scheduler\.Scheduler\.schedule"):
        instrumentor.instrument(**pipeline.providers())
    assert runner.Runner().forward(3) == 3


def test_a_missing_method_found_at_import_is_logged_not_raised_into_the_engine(engine_on_disk, pipeline, caplog):
    (engine_on_disk / "scheduler.py").write_text("class Scheduler:\n    pass\n")
    instrumentor = LazyEngineInstrumentor()
    instrumentor.instrument(**pipeline.providers())
    try:
        with caplog.at_level(logging.ERROR):
            scheduler = importlib.import_module(f"{ENGINE}.scheduler")  # the engine's import succeeds
        assert not hasattr(scheduler.Scheduler, "schedule")
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "Scheduler.schedule" in (errors[0].exc_text or str(errors[0].exc_info[1]))
        # the other module is still wrapped when imported
        assert importlib.import_module(f"{ENGINE}.runner").Runner().forward(1) == ("forward-wrapped", 1)
    finally:
        instrumentor.uninstrument()


CHILD = textwrap.dedent(
    """
    import logging, os, subprocess, sys
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor
    SwaVllmInstrumentor().instrument(skip_dep_check=True)
    if sys.argv[1] == "parent":
        # an engine's child process: it inherits the environment and loads the instrumentors again
        subprocess.run([sys.executable, __file__, "child"], check=True)
    """
)


def test_an_absent_engine_is_reported_once_per_process_tree(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    script = tmp_path / "app.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env["OTEL_SWA_DIVERGENCE_INTERVAL"] = "4"
    run = subprocess.run([sys.executable, str(script), "parent"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if "not installed" in line]
    assert len(warnings) == 1, run.stderr
    assert warnings[0].startswith("opentelemetry.instrumentation.swa_vllm: swa_vllm: vllm is not installed")


class RecordingRegistry:
    """An engine's hook registry reduced to what SGLang's ``HookRegistry`` does with an AROUND hook:
    ``register(target, hook)`` now, ``apply()`` later replaces the target's attribute by
    ``lambda *a, **k: hook(original, *a, **k)``."""

    def __init__(self) -> None:
        self.hooks: list = []

    def __call__(self, target: str, hook) -> None:
        self.hooks.append((target, hook))

    def apply(self) -> None:
        for target, hook in self.hooks:
            owner_path, attribute = target.rsplit(".", 1)
            module_name, class_name = owner_path.rsplit(".", 1)
            owner = getattr(sys.modules[module_name], class_name)
            original = owner.__dict__[attribute]

            def wrapper(*args, _hook=hook, _original=original, **kwargs):
                return _hook(_original, *args, **kwargs)

            setattr(owner, attribute, wrapper)


def test_a_hook_registry_gets_the_wrappers_of_the_modules_already_imported(engine_on_disk, pipeline):
    runner = importlib.import_module(f"{ENGINE}.runner")  # imported before instrument(): the registry's
    registry = RecordingRegistry()
    instrumentor = LazyEngineInstrumentor()
    instrumentor.instrument(hook_registry=registry, **pipeline.providers())
    try:
        assert [target for target, _ in registry.hooks] == [f"{ENGINE}.runner.Runner.forward"]
        assert runner.Runner().forward(3) == 3  # the registry has not applied it yet
        registry.apply()
        assert runner.Runner().forward(3) == ("forward-wrapped", 3)
        # a module imported later is wrapped at its import, as without a registry
        scheduler = importlib.import_module(f"{ENGINE}.scheduler")
        assert scheduler.Scheduler().schedule() == ("schedule-wrapped", "plan")
        assert len(registry.hooks) == 1
    finally:
        instrumentor.uninstrument()
    assert runner.Runner().forward(3) == 3 and scheduler.Scheduler().schedule() == "plan"


def test_a_registry_hook_given_another_original_wraps_that_one():
    from otel_swa.engine_wrapping import register_around

    registry = RecordingRegistry()

    def original(x):
        return x

    def replacement(x):  # another plugin's replacement, applied before the around-hook
        return -x

    made = []

    def make_wrapper(function):
        made.append(function)
        return lambda *args: ("wrapped", function(*args))

    register_around(registry, "engine.mod.f", original, make_wrapper)
    (_, hook), = registry.hooks
    assert hook(original, 2) == ("wrapped", 2) and made == [original]
    assert hook(replacement, 2) == ("wrapped", -2) and hook(replacement, 3) == ("wrapped", -3)
    assert made == [original, replacement]  # one wrapper per original, made once
