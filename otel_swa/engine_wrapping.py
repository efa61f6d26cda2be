"""What the engine instrumentors (``instrumentation/``) share: checking the engine before wrapping it.

An instrumentor wraps private methods of an engine, so before any change it checks (1) that the
engine's distribution is installed at a supported version (``_instruments``), and (2) that every
method it wraps exists with the parameters it relies on. The first failing is normal (the engine
is simply not used here): a warning, nothing wrapped. The second means an unsupported engine
build: :class:`EngineVersionError`, an ``ImportError`` so that ``opentelemetry-instrument`` logs it,
skips this instrumentor and still loads the others (opentelemetry-instrumentation's loader treats
any other exception as fatal to all instrumentation).
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata
from typing import Any, Collection

from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

__all__ = ["EngineVersionError", "unavailable_reason", "installed_version", "resolve_method"]


class EngineVersionError(ImportError):
    """The installed engine lacks a method (or a parameter) an instrumentor wraps."""


def unavailable_reason(distribution: str, instruments: Collection[str]) -> str | None:
    """Why ``distribution`` cannot be instrumented here (not installed, or a version outside
    ``instruments``), or ``None`` when it can. Reads installed metadata only; imports nothing."""
    conflict = get_dependency_conflicts(instruments)
    if conflict is None:
        return None
    if conflict.found is None:
        return f"{distribution} is not installed (supported: {conflict.required})"
    return f"installed {conflict.found} is outside the supported {conflict.required}"


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution``, or ``"unknown"``."""
    try:
        return metadata.version(distribution)
    except Exception:
        return "unknown"


def resolve_method(
    error: type[EngineVersionError],
    instrumentor: str,
    distribution: str,
    supported: str,
    module_name: str,
    class_name: str,
    method: str | None = None,
    params: tuple[str, ...] = (),
) -> Any:
    """Import ``module_name.class_name`` and, when ``method`` is given, check that the class itself
    defines it with ``params`` among its parameters.

    Returns:
        ``(cls, function)`` when ``method`` is given, else the class.

    Raises:
        error: (a subclass of :class:`EngineVersionError`) the class, the method or a parameter is
            missing; the message names the instrumentor, the supported and installed versions and
            what was expected.
    """
    expected = f"{module_name}.{class_name}" + (f".{method}({', '.join(params)}, ...)" if method else "")
    where = f"{instrumentor} supports {supported}; installed {distribution} {installed_version(distribution)}"
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        function = cls.__dict__[method] if method else None
    except (ImportError, AttributeError, KeyError) as exc:
        raise error(f"{where} has no {expected} ({exc!r})") from exc
    if function is None:
        return cls
    missing = [p for p in params if p not in inspect.signature(function).parameters]
    if missing:
        raise error(f"{where}: expected {expected}, its parameters lack {missing}")
    return cls, function
