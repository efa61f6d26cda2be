"""otel-swa: OpenTelemetry instrumentation for the sliding-window-attention KV cache.

See the README for the data path (observe -> step -> device sample -> device-to-host ring ->
record -> sinks) and the OpenTelemetry mapping.

The names below are loaded on first use: the engine plugins import ``otel_swa.config`` in every
engine process to read their switch, and importing this package must not cost them the record
module (``otel_swa.record``) when the switch is off.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LINE_PREFIX", "SwaDivergenceRecord", "find_all", "find_last", "__version__"]

_LAZY = {"LINE_PREFIX": "otel_swa.record", "SwaDivergenceRecord": "otel_swa.record", "find_all": "otel_swa.record",
         "find_last": "otel_swa.record", "__version__": "otel_swa.version"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'otel_swa' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
