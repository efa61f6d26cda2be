"""OpenTelemetry instrumentation of vLLM's sliding-window-attention (SWA) KV cache (v1 engine).

Supported: vLLM 0.10 up to (not including) 0.34 (``package.py``); the wrapped methods and the
structures read were taken from vLLM 0.33's source. vLLM does not install on a CPU-only machine
with CPU torch, so this instrumentation is tested against stand-in classes with the same module
paths, method signatures and attributes (``tests/engines/test_vllm_instrumentor.py``), not against
vLLM itself: a test against the real classes is missing.

Instrumenting wraps two methods:

``vllm.v1.core.sched.scheduler.Scheduler.schedule(self)``
    Once per engine step, after it returns (the batch is decided and its KV blocks are allocated,
    ``Request.num_computed_tokens`` already includes the tokens of this step): for the scheduled
    requests (``SchedulerOutput.num_scheduled_tokens``), each holding ``n`` tokens,

    * ``reporter.observe``: FULL ``n``, SWA ``min(n, sliding_window)`` (entries attention reads);
    * ``reporter.step``: every ``interval`` steps the SWA group's block table is read from the
      ``SlidingWindowManager`` (``KVCacheManager.coordinator.single_type_managers``,
      ``req_to_blocks``; the first sliding-window group when there are several) and sampled
      through :func:`otel_swa.views.vllm.batch_view`: null-block tokens count as out of window.

    A step that schedules no token is not a forward step and is not counted. The reporter runs
    on the CPU, in the scheduler's process; it touches no GPU memory.
``vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model(self, scheduler_output, ...)``
    Runs inside the forward-step span ``forward step`` (batch size = scheduled requests). The span
    lives in the worker; the samples are taken in the scheduler, so their events carry the
    context current at ``schedule()`` (no forward-step span), unless both run in one call stack.

Divergence is not applicable to vLLM (no FULL-to-SWA mapping, see :mod:`otel_swa.views.vllm`).
Every sample goes through :func:`otel_swa.views.vllm.batch_view`, whose view sets
``divergence_applicable=False``; the reporter carries it into each record, so the telemetry
records no ``kv_cache.swa.tokens.divergent`` point and the event has
``kv_cache.swa.divergence_applicable=false``. Only the SGLang line, whose fields are integers,
still shows ``"swa_full_idx_divergence":0``.

Switch: ``OTEL_SWA_DIVERGENCE_INTERVAL`` (or ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``),
read when ``instrument()`` runs. Unset or 0: nothing is wrapped. An unusable value is logged and
nothing is wrapped. A scheduler whose KV cache has no sliding-window group gets no reporter.
Pending samples are delivered when the scheduler is garbage-collected, at interpreter exit, and at
``uninstrument()``.

When vLLM is not installed, or its version is outside ``_instruments``, ``instrument()`` logs one
warning (logger ``opentelemetry.instrumentation.swa_vllm``) and wraps nothing, also when called as
``opentelemetry-instrument`` calls it (``instrument(skip_dep_check=True)``), so the loader goes on
to the other instrumentors. Where a supported vLLM lacks a wrapped method or its parameters differ,
``instrument()`` raises :class:`VllmVersionError` naming the installed version and the method it
expected (an ``ImportError``, which the loader of opentelemetry-instrumentation 0.66b2 logs and
skips; any other exception would end all auto-instrumentation). A failure while setting up the
telemetry is logged and leaves vLLM unwrapped.

Providers come from ``instrument(tracer_provider=..., meter_provider=..., logger_provider=...)``,
the global ones otherwise; the instrumentor never installs providers itself. ``uninstrument()``
restores the original functions (the same objects); both calls are idempotent.

Usage::

    # OTEL_SWA_DIVERGENCE_INTERVAL=20 opentelemetry-instrument vllm serve google/gemma-3-1b-it
    from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor

    SwaVllmInstrumentor().instrument()       # in the engine-core process, before it starts
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from types import SimpleNamespace
from typing import Any, Callable

from opentelemetry.instrumentation.swa_vllm.package import _instruments

from otel_swa.engine_wrapping import EngineInstrumentor, EngineVersionError

__all__ = ["SwaVllmInstrumentor", "VllmVersionError", "WRAPPED", "SCHEDULER_ATTRIBUTE"]

_log = logging.getLogger(__name__)

#: Attribute of an instrumented ``Scheduler`` holding its wiring (``None``: not observed).
SCHEDULER_ATTRIBUTE = "_otel_swa_telemetry"
_FORWARD_CT_ATTRIBUTE = "_otel_swa_forward_ct"

#: (module, class, method, parameters the wrapper relies on), as in vLLM 0.33.
WRAPPED = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", ("self",)),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", ("scheduler_output",)),
)
_SLIDING_WINDOW_MANAGER = ("vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager")


class VllmVersionError(EngineVersionError):
    """The installed vLLM lacks a method (or parameter) this instrumentation wraps.

    An ``ImportError``, so that ``opentelemetry-instrument`` logs it, skips this instrumentor and
    loads the others."""


class SwaVllmInstrumentor(EngineInstrumentor):
    """Instrumentor for vLLM's v1 scheduler and GPU model runner (module docstring).

    ``instrument(**kwargs)`` accepts ``tracer_provider``, ``meter_provider``, ``logger_provider``,
    ``span_events`` (default True), ``max_links`` and ``traceparents`` (request id -> W3C
    traceparent: the forward-step span then links to the scheduled requests' spans).

    Raises (from ``instrument``):
        VllmVersionError: a supported vLLM version lacks a wrapped method or
            ``SlidingWindowManager`` (not raised when vLLM is missing or unsupported: a warning
            is logged).
    """

    name = "swa_vllm"
    engine = "vLLM"
    distribution = "vllm"
    instruments = _instruments
    wrapped = WRAPPED
    version_error = VllmVersionError

    def _wrappers(self) -> tuple:
        return (self._wrap_schedule, self._wrap_execute_model)

    def _resolve_more(self) -> None:
        self._swa_manager_class = self._resolve(*_SLIDING_WINDOW_MANAGER)

    # ------------------------------------------------------------------ scheduler side
    def _wire(self, scheduler: Any) -> Any:
        wiring = None
        try:
            managers = scheduler.kv_cache_manager.coordinator.single_type_managers
            swa = next((m for m in managers if isinstance(m, self._swa_manager_class)), None)
            if swa is not None:
                reporter = self._new_reporter("cpu")
                if reporter is not None:
                    num_blocks = int(scheduler.cache_config.num_gpu_blocks)
                    wiring = SimpleNamespace(
                        reporter=reporter, manager=swa, window=int(swa.sliding_window),
                        block_size=int(swa.block_size), num_blocks=num_blocks,
                    )
                    weakref.finalize(scheduler, reporter.close)
        except Exception:
            _log.exception("instrumenting a vLLM scheduler failed; it runs uninstrumented")
            wiring = None
        scheduler.__dict__[SCHEDULER_ATTRIBUTE] = wiring
        return wiring

    def _wrap_schedule(self, original: Callable) -> Callable:
        instrumentor = self

        @functools.wraps(original)
        def schedule(scheduler, *args, **kwargs):
            output = original(scheduler, *args, **kwargs)
            state = scheduler.__dict__
            wiring = state[SCHEDULER_ATTRIBUTE] if SCHEDULER_ATTRIBUTE in state else instrumentor._wire(scheduler)
            if wiring is not None:
                try:
                    instrumentor._after_schedule(wiring, scheduler, output)
                except Exception:  # telemetry never breaks the engine
                    _log.exception("SWA divergence reporter step failed")
            return output

        return schedule

    @staticmethod
    def _after_schedule(wiring: Any, scheduler: Any, output: Any) -> None:
        import torch

        from otel_swa.views import vllm as view

        request_ids = list(output.num_scheduled_tokens)
        if not request_ids:
            return
        num_tokens = [int(scheduler.requests[rid].num_computed_tokens) for rid in request_ids]
        reporter = wiring.reporter
        reporter.observe("full", sum(num_tokens))
        reporter.observe("swa", sum(min(n, wiring.window) for n in num_tokens))

        def sample_view():  # called by the reporter at sampling steps only
            try:
                table = view.block_table_from_manager(wiring.manager, request_ids)
                return view.batch_view(
                    table, torch.tensor(num_tokens, dtype=torch.int64), wiring.block_size,
                    num_blocks=wiring.num_blocks, num_tokens_cpu=num_tokens,
                )
            except Exception:
                _log.exception("vLLM batch view not built; the sample counts an empty batch")
                empty = torch.zeros((0, 1), dtype=torch.int32)
                return view.batch_view(empty, torch.zeros(0, dtype=torch.int64), wiring.block_size,
                                       num_blocks=max(wiring.num_blocks, 1), num_tokens_cpu=())

        reporter.step(sample_view)

    # ------------------------------------------------------------------ worker side
    def _wrap_execute_model(self, original: Callable) -> Callable:
        instrumentor = self

        @functools.wraps(original)
        def execute_model(runner, scheduler_output, *args, **kwargs):
            with contextlib.ExitStack() as stack:
                try:
                    forward_ct = runner.__dict__.get(_FORWARD_CT_ATTRIBUTE, 0) + 1
                    runner.__dict__[_FORWARD_CT_ATTRIBUTE] = forward_ct
                    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
                    stack.enter_context(instrumentor._forward_spans.forward_span(
                        forward_ct=forward_ct,
                        batch_size=len(scheduled),
                        request_ids=list(scheduled) if instrumentor._traceparents is not None else (),
                    ))
                except Exception:
                    _log.exception("forward-step span not started")
                return original(runner, scheduler_output, *args, **kwargs)

        return execute_model
