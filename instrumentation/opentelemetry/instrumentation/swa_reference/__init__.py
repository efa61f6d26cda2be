"""OpenTelemetry instrumentation of otel-swa's reference hybrid-SWA engine.

Instrumenting wraps :class:`otel_swa.reference.engine.ReferenceEngine` so that every engine created
afterwards is observed:

* it gets an SWA divergence reporter from ``SwaDivergenceReporter.from_env`` when it was given none:
  ``OTEL_SWA_DIVERGENCE_INTERVAL`` (or SGLang's ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``)
  unset or 0 means no reporter and no reporter work at all; an unusable value of any otel-swa
  variable (:func:`otel_swa.config.check_environment`) is logged by ``instrument()``, which then
  wraps nothing: the engine runs as it is;
* the reporter's records become the metrics of :data:`otel_swa.telemetry.metrics.INSTRUMENTS`
  (their names, kinds, units and sources: the table "Record field → instrument" in
  ``docs/telemetry.md``) and the event ``kv_cache.swa.divergence_sample`` (Logs API and span
  event) under the forward step where each sample was taken;
* each forward step runs in a span ``forward step`` linked to the spans of its requests;
* the pool usage gauges ``kv_cache.pool.tokens.{used,available,evictable,limit}`` and
  ``kv_cache.pool.utilization`` (``pool=full|swa``) read the engine's free lists
  (``HybridKVPools.usage()``) when the SDK collects, never during a step; the engine has no prefix
  cache, so ``evictable`` is 0. When the engine runs the model and has a reporter,
  ``kv_cache.swa.memory.saved`` is each sample's out-of-window tokens x the SWA layer's K/V bytes
  per slot (from the engine's KV storage tensors: ``2 x num_heads x head_dim x 4`` for float32);
* each submitted request gets a span ``request`` (kind SERVER, its own trace) from submission to
  completion, unless the request object carries a W3C ``traceparent`` attribute (from a serving
  front end), in which case the forward steps link to that span instead;
* ``run_until_done`` flushes the reporter at its end, and the interpreter's exit flushes it too
  (before the SDK's providers shut down: :mod:`otel_swa.lifecycle`), so the last samples are
  delivered and exported without a ``close()`` in the program; a reporter that delivered no sample
  by then gives its liveness warning (``otel_swa_liveness=``: no forward step reached it through
  ``ReferenceEngine.step``, or none of its samples was delivered).

Providers come from ``instrument(tracer_provider=..., meter_provider=..., logger_provider=...)``,
the global ones otherwise; the instrumentor never installs providers itself. ``uninstrument()``
restores the class; engines created before keep their wiring. Both are idempotent.

Usage::

    from opentelemetry.instrumentation.swa_reference import SwaReferenceInstrumentor
    from otel_swa.reference.engine import ReferenceEngine

    SwaReferenceInstrumentor().instrument()          # or: opentelemetry-instrument python app.py
    engine = ReferenceEngine()                       # reporter per OTEL_SWA_DIVERGENCE_INTERVAL
    ...
    engine.run_until_done()
"""

from __future__ import annotations

import functools
import logging
import weakref
from types import SimpleNamespace
from typing import Any, Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from opentelemetry.instrumentation.swa_reference.package import _instruments

__all__ = ["SwaReferenceInstrumentor"]

_log = logging.getLogger(__name__)

#: Attribute of an instrumented engine holding its telemetry wiring.
ENGINE_ATTRIBUTE = "_otel_swa_telemetry"
_WRAPPED = ("__init__", "submit", "step", "run_until_done")
_ENGINE_MODULE = "otel_swa.reference.engine"


class SwaReferenceInstrumentor(BaseInstrumentor):
    """Instrumentor for :class:`otel_swa.reference.engine.ReferenceEngine` (module docstring).

    ``instrument(**kwargs)`` accepts ``tracer_provider``, ``meter_provider``, ``logger_provider``,
    ``span_events`` (default True) and ``max_links`` (forward-step link limit).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        from otel_swa import config, import_hooks

        self._originals = {}
        self._hook = None
        try:
            config.check_environment()
        except config.ConfigError as exc:  # logged; the engine runs as it is, never stopped by a variable
            _log.error("otel-swa: the reference engine is not instrumented: %s", exc)
            return
        # Wrapped when the process imports the engine (at once if it already has): a process that
        # never runs the reference engine (another engine's worker under opentelemetry-instrument)
        # imports nothing and builds no telemetry for it.
        self._originals = {}
        self._hook = import_hooks.when_imported(_ENGINE_MODULE, lambda module: self._wrap_class(module, kwargs))

    def _wrap_class(self, module: Any, kwargs: dict) -> None:
        from otel_swa.engine_wrapping import instrument_telemetry

        engine_class = module.ReferenceEngine
        from otel_swa.telemetry.pools import pool_metrics

        telemetry = instrument_telemetry(kwargs)
        self._providers = telemetry.providers
        self._pools = pool_metrics(telemetry.providers[1])
        self._sink = telemetry.sink
        self._tracer = telemetry.tracer
        self._max_links = telemetry.max_links
        self._originals = {name: engine_class.__dict__[name] for name in _WRAPPED}
        self._engine_class = engine_class
        for name in _WRAPPED:
            setattr(engine_class, name, getattr(self, f"_wrap_{name.strip('_')}")(self._originals[name]))

    def _uninstrument(self, **kwargs: Any) -> None:
        from otel_swa import import_hooks

        if self._hook is not None:
            import_hooks.cancel(self._hook)
        for name, original in self._originals.items():
            setattr(self._engine_class, name, original)
        self._originals = {}

    # ------------------------------------------------------------------ per engine
    def _wire(self, engine: Any) -> None:
        from otel_swa.engine_wrapping import request_span_hooks
        from otel_swa.reporter import SwaDivergenceReporter
        from otel_swa.telemetry import ForwardSpans, RequestSpans

        if getattr(engine, "reporter", None) is None:
            try:
                engine.reporter = SwaDivergenceReporter.from_env(device=engine.device)
            except Exception:  # an unusable variable must not stop the engine
                _log.exception("SWA divergence reporter not created; the engine runs without it")
                engine.reporter = None
        sink = None
        if engine.reporter is not None:
            from otel_swa import lifecycle

            sink = self._sink.for_another_reporter()
            sink.attach(engine.reporter)
            lifecycle.track(engine.reporter, self._providers)  # delivered at exit, before the SDK shuts down
            lifecycle.expect_forward_steps(engine.reporter, "ReferenceEngine.step")  # or said to be silent
            weakref.finalize(engine, engine.reporter.close)  # an engine dropped before the process ends
            bytes_per_token = swa_kv_bytes_per_token(engine)
            if bytes_per_token:
                engine.reporter.add_sink(self._pools.savings_sink(bytes_per_token))
        self._pools.register(_pool_usage, owner=engine)
        request_spans = RequestSpans(self._tracer)
        traceparents: dict[Any, str] = {}
        forward_spans = ForwardSpans(self._tracer, traceparents, max_links=self._max_links)
        engine.forward_span = forward_spans.forward_span
        setattr(engine, ENGINE_ATTRIBUTE, SimpleNamespace(
            sink=sink, request_spans=request_spans, traceparents=traceparents, forward_spans=forward_spans,
            request_hooks=request_span_hooks(request_spans.start, request_spans.end, traceparents),
        ))

    def _wrap_init(self, original):
        instrumentor = self

        @functools.wraps(original)
        def __init__(engine, *args, **kwargs):
            original(engine, *args, **kwargs)
            try:
                instrumentor._wire(engine)
            except Exception:
                _log.exception("instrumenting the reference engine failed; it runs uninstrumented")

        return __init__

    def _wrap_submit(self, original):
        @functools.wraps(original)
        def submit(engine, request, *args, **kwargs):
            state = original(engine, request, *args, **kwargs)
            wiring = getattr(engine, ENGINE_ATTRIBUTE, None)
            if wiring is not None:
                try:
                    wiring.request_hooks["on_submit"](state, request)
                except Exception:
                    _log.exception("request span not started")
            return state

        return submit

    def _wrap_step(self, original):
        @functools.wraps(original)
        def step(engine, *args, **kwargs):
            result = original(engine, *args, **kwargs)
            wiring = getattr(engine, ENGINE_ATTRIBUTE, None)
            if wiring is not None and result is not None:
                try:
                    wiring.request_hooks["on_step"](result)
                except Exception:
                    _log.exception("request spans not ended")
            return result

        return step

    def _wrap_run_until_done(self, original):
        @functools.wraps(original)
        def run_until_done(engine, *args, **kwargs):
            stats = original(engine, *args, **kwargs)
            reporter = getattr(engine, "reporter", None)
            if reporter is not None and getattr(engine, ENGINE_ATTRIBUTE, None) is not None:
                try:
                    reporter.flush()
                except Exception:
                    _log.exception("flushing the SWA divergence reporter failed")
            return stats

        return run_until_done


def _pool_usage(engine: Any) -> Any:
    """The reference engine's pools now (the source registered per engine; holds no reference)."""
    return engine.pools.usage()


def swa_kv_bytes_per_token(engine: Any) -> "int | None":
    """K and V bytes one token takes in the engine's sliding-window layer, read from the shapes and
    dtypes of its KV storage (``engine.kv.swa_k`` / ``swa_v``: ``[num_slots, num_heads, head_dim]``;
    no device access); ``None`` when the engine keeps no KV (``run_model=False``)."""
    kv = getattr(engine, "kv", None)
    return None if kv is None else kv.swa_bytes_per_token
