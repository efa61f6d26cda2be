"""Test-only stand-in for ``triton`` (the real wheel is about 1 GB installed and unused on CPU).

SGLang decorates its kernels with ``triton.jit`` / ``triton.autotune`` and builds ``tl.constexpr``
values at import time; on CPU it takes its pure-torch paths and never launches them. This stand-in
makes those imports succeed: ``jit``/``autotune``/``heuristics`` return the function unchanged and
every other attribute or ``triton.*`` submodule is an inert placeholder. ``tests/engines/conftest.py``
puts it on ``sys.path`` only when SGLang is installed and no real triton is, and first calls
``torch.utils._triton.has_triton_package()`` so that torch caches "no triton" and never treats the
stand-in as a compiler backend.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {})


class _Placeholder(metaclass=_PlaceholderMeta):
    """Accepts any construction; any attribute is another placeholder class."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _PlaceholderMeta(name, (_Placeholder,), {})


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_SubmoduleFinder(__name__))


def jit(fn=None, **kwargs):
    return (lambda f: f) if fn is None else fn


def autotune(*args, **kwargs):
    return lambda f: f


heuristics = autotune
