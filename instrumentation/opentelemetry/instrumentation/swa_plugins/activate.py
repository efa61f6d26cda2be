"""What an engine plugin does once the interval variable is set: the work ``opentelemetry-instrument``
would do in this process, for one engine.

1. If ``opentelemetry-instrument`` already ran the engine's instrumentor here (its
   ``sitecustomize`` loads the instrumentors at interpreter start, before any engine code calls
   its plugins), nothing: the instrumentor and the distro's SDK are in place.
2. If the engine is not installed here at a supported version, the instrumentor says so as it
   does under ``opentelemetry-instrument`` (one warning per process tree) and wraps nothing; the
   SDK is not set up.
3. Otherwise OpenTelemetry is set up as the distro would (:func:`otel_swa.telemetry.setup.configure_like_the_distro`;
   global providers already installed are used as they are) and the instrumentor is run with those
   providers. For SGLang the wrappers of the modules this process has already imported go through
   SGLang's own ``HookRegistry`` (around-hooks, applied by ``load_plugins()`` right after the
   plugins ran); the others are wrapped when the process imports their module, as the instrumentor
   does under ``opentelemetry-instrument`` (SGLang's registry imports every target when it applies
   hooks, at ``load_plugins()``, in every process: a hook on the model runner would import it into
   the main process and the detokenizer, seconds each, which never run it).

A failure is logged and leaves the engine as it is: a plugin never stops the engine.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["activate", "ENGINES"]

_log = logging.getLogger("opentelemetry.instrumentation.swa_plugins")

#: Engine -> (instrumentor module, instrumentor class).
ENGINES = {
    "sglang": ("opentelemetry.instrumentation.swa_sglang", "SwaSglangInstrumentor"),
    "vllm": ("opentelemetry.instrumentation.swa_vllm", "SwaVllmInstrumentor"),
}

#: What :func:`activate` did in this process, per engine (for the tests and the plugin's own guard).
outcomes: dict[str, str] = {}
_telemetry: list = []  # the pipeline built here (its providers are also the global ones)


def _sglang_hook_registry(target: str, hook: Any) -> None:
    """``register(target, around_hook)`` for :func:`otel_swa.engine_wrapping.register_around`:
    SGLang's ``HookRegistry`` (sglang 0.5.23, ``sglang/srt/plugins/hook_registry.py``), AROUND."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType.AROUND)


def activate(engine: str) -> str:
    """Instrument this process for ``engine`` (``"sglang"`` or ``"vllm"``); see the module docstring.
    Returns what was done: ``"instrumented"``, ``"already instrumented"`` (by
    ``opentelemetry-instrument``, or by an earlier call), ``"engine unavailable"`` or ``"failed"``.
    Never raises."""
    if engine in outcomes:
        return "already instrumented" if outcomes[engine] == "instrumented" else outcomes[engine]
    try:
        outcome = _activate(engine)
    except Exception:
        _log.exception("otel-swa: the %s plugin failed; the engine runs uninstrumented", engine)
        outcome = "failed"
    outcomes[engine] = outcome
    return outcome


def _activate(engine: str) -> str:
    import importlib

    from otel_swa.config import ConfigError
    from otel_swa.engine_wrapping import unavailable_reason
    from otel_swa.telemetry.setup import configure_like_the_distro

    module_name, class_name = ENGINES[engine]
    cls = getattr(importlib.import_module(module_name), class_name)
    instrumentor = cls()
    if instrumentor.is_instrumented_by_opentelemetry:
        _log.debug("otel-swa: %s is already instrumented (opentelemetry-instrument); the plugin does nothing", engine)
        return "already instrumented"
    if unavailable_reason(cls.distribution, cls.instruments, cls.module) is not None:
        instrumentor.instrument(skip_dep_check=True)  # says why, as under opentelemetry-instrument; wraps nothing
        return "engine unavailable"
    try:
        telemetry = configure_like_the_distro()
    except ConfigError as exc:
        _log.error("otel-swa: OpenTelemetry cannot be set up (%s); %s is not instrumented", exc, engine)
        return "failed"
    _telemetry.append(telemetry)
    kwargs: dict[str, Any] = dict(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider,
                                  logger_provider=telemetry.logger_provider)
    if engine == "sglang":
        from opentelemetry.instrumentation.swa_sglang import stop_paths

        kwargs["hook_registry"] = _sglang_hook_registry
        stop_paths.note_children_instrumented()
    instrumentor.instrument(skip_dep_check=True, **kwargs)
    _log.debug("otel-swa: %s instrumented by its plugin (exporters %s)", engine, telemetry.exporters)
    return "instrumented"
