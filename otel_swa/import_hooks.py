"""Post-import hooks: run a function on a module right after the process first imports it.

The engine instrumentors wrap engine classes only in the processes that really import them: under
``opentelemetry-instrument`` every Python process of an engine (SGLang's tokenizer, scheduler and
detokenizer, vLLM's engine core and workers, multiprocessing helpers) loads the instrumentors, and
importing an engine's model runner to wrap it costs seconds in each of them. :func:`when_imported`
defers the work to the import the engine makes itself.

A finder placed first on ``sys.meta_path`` answers only for the module names that have hooks: it asks
the other finders for the spec and gives it a loader that runs the real loader, then the hooks (in
registration order, each once), then puts the real loader back on the module. A hook that raises is
logged and never breaks the import.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from types import ModuleType
from typing import Callable

__all__ = ["when_imported", "cancel", "HookHandle"]

_log = logging.getLogger(__name__)

Hook = Callable[[ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list["HookHandle"]] = {}


class HookHandle:
    """A registered hook; pass it to :func:`cancel`. ``done`` is True once it has run."""

    __slots__ = ("module_name", "hook", "done")

    def __init__(self, module_name: str, hook: Hook) -> None:
        self.module_name = module_name
        self.hook = hook
        self.done = False


def _run(handle: HookHandle, module: ModuleType) -> None:
    handle.done = True
    try:
        handle.hook(module)
    except Exception:
        _log.exception("post-import hook %r on %s failed", handle.hook, handle.module_name)


def _run_hooks(name: str, module: ModuleType) -> None:
    with _lock:
        handles = _hooks.pop(name, [])
    for handle in handles:
        _run(handle, module)


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then its hooks."""

    def __init__(self, loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        spec = getattr(module, "__spec__", None)
        try:
            self._loader.exec_module(module)
        finally:
            # The module keeps its real loader (importlib.resources, reloads and tracebacks use it).
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        _run_hooks(self._name, module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _HookFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        # Names this thread is looking up through the other finders: another finder that asks the
        # meta path in turn (a finder of the same kind) must not bring the lookup back here.
        self._resolving = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _hooks:
            return None
        resolving = self._resolving.__dict__.setdefault("names", set())
        if fullname in resolving:
            return None
        resolving.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _HookedLoader(spec.loader, fullname)
                    return spec
            return None
        finally:
            resolving.discard(fullname)


_finder = _HookFinder()


def when_imported(module_name: str, hook: Hook) -> HookHandle:
    """Call ``hook(module)`` once ``module_name`` is imported: at once when it already is, else right
    after the process imports it (from the importing thread). Returns a handle for :func:`cancel`."""
    handle = HookHandle(module_name, hook)
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _hooks.setdefault(module_name, []).append(handle)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
    if module is not None:
        _run(handle, module)
    return handle


def cancel(handle: HookHandle) -> None:
    """Forget a hook that has not run yet (nothing happens for one that has)."""
    with _lock:
        handles = _hooks.get(handle.module_name)
        if handles and handle in handles:
            handles.remove(handle)
            if not handles:
                del _hooks[handle.module_name]
