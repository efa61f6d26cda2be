"""OpenTelemetry instrumentation of SGLang's hybrid sliding-window-attention (SWA) KV cache.

Supported: sglang 0.5.23 up to (not including) 0.6 (``package.py``); the wrapped methods were read
in sglang 0.5.23. Instrumenting wraps three methods, at the points where SGLang's own KV canary
calls its SWA divergence reporter:

``sglang.srt.model_executor.model_runner.ModelRunner.forward(self, forward_batch, ...)``
    One call per forward step of the target model (SGLang's canary counts its outer steps here too;
    draft workers are skipped, as the canary skips them). The call runs inside the forward-step
    span ``forward step``; after the forward, inside that span, the reporter counts the step and,
    every ``interval`` steps, samples the batch through
    :func:`otel_swa.views.sglang.batch_view` (the allocator's ``full_to_swa_index_mapping``, the
    ``req_to_token`` rows and this batch's ``req_pool_indices`` / ``seq_lens``, read at the step they
    describe, not one step later as SGLang's reporter does).
``sglang.srt.kv_canary.runner.canary_manager.CanaryManager.__init__``
    When SGLang's KV canary is installed (its own switch, ``--enable-kv-canary``-style server
    arguments), the canary manager gets the model runner's reporter at construction, before CUDA
    graph capture, so the counting below is captured into the graphs.
``CanaryManager.pre_ops_maybe_inside_graph(self, forward_batch)``
    After each forward's plans: the entries the canary verified per pool
    (``VerifyPlan.verify_num_valid`` per buffer group, ``PoolKind.FULL`` / ``PoolKind.SWA``) go to
    ``reporter.observe``: an in-place device add, no host sync, safe inside CUDA graph capture.

Without the KV canary there are no verify plans; the reporter then counts the entries attention
reads at each forward step: ``seq_len`` per request in the FULL pool and ``min(seq_len, window)``
in the SWA pool (``ModelRunner.sliding_window_size``), from ``forward_batch.seq_lens_cpu`` on the
host when SGLang has it, else from ``seq_lens`` on the device (two small reductions, no sync).
A model runner whose allocator has no ``full_to_swa_index_mapping`` (not a hybrid SWA model) and
no canary gets no reporter.

Switch: ``OTEL_SWA_DIVERGENCE_INTERVAL`` (or SGLang's
``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``), read when ``instrument()`` runs. Unset or 0:
nothing is wrapped, the engine runs its own code unchanged. An unusable value is logged and
nothing is wrapped. Each model runner gets its own
:class:`~otel_swa.reporter.SwaDivergenceReporter` on its device (``OTEL_SWA_RING_SIZE`` ring
slots); its records become the metrics and events of :mod:`otel_swa.telemetry` (the table
"Record field → instrument" in ``docs/telemetry.md``) and, with the ``swa_logline`` logs exporter,
SGLang's ``kv_canary_swa_divergence={...}`` line. Set only ``OTEL_SWA_DIVERGENCE_INTERVAL``: the
SGLang variable also switches on SGLang's own reporter, which then logs its line beside ours.
Pending samples are delivered when the model runner is garbage-collected, at interpreter exit,
and at ``uninstrument()``.

When SGLang is not installed, or its version is outside ``_instruments``, ``instrument()`` logs one
warning (logger ``opentelemetry.instrumentation.swa_sglang``) and wraps nothing, also when called as
``opentelemetry-instrument`` calls it (``instrument(skip_dep_check=True)``, which bypasses
``BaseInstrumentor``'s own version check), so the loader goes on to the other instrumentors.
Where a supported SGLang lacks a wrapped method or its parameters differ, ``instrument()`` raises
:class:`SglangVersionError` naming the installed version and the method it expected (an
``ImportError``, the one kind of error the loader of opentelemetry-instrumentation 0.66b2 logs and
skips; any other exception would end all auto-instrumentation). A failure while setting up the
telemetry is logged and leaves SGLang unwrapped.

Providers come from ``instrument(tracer_provider=..., meter_provider=..., logger_provider=...)``,
the global ones otherwise; the instrumentor never installs providers itself. ``uninstrument()``
restores the original functions (the same objects); both calls are idempotent.

Usage::

    # OTEL_SWA_DIVERGENCE_INTERVAL=20 opentelemetry-instrument python -m sglang.launch_server ...
    from opentelemetry.instrumentation.swa_sglang import SwaSglangInstrumentor

    SwaSglangInstrumentor().instrument()     # before SGLang builds its model runners
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from types import SimpleNamespace
from typing import Any, Callable

from opentelemetry.instrumentation.swa_sglang.package import _instruments

from otel_swa.engine_wrapping import EngineInstrumentor, EngineVersionError

__all__ = ["SwaSglangInstrumentor", "SglangVersionError", "WRAPPED", "RUNNER_ATTRIBUTE", "CANARY_ATTRIBUTE"]

_log = logging.getLogger(__name__)

#: Attribute of an instrumented ``ModelRunner`` holding its wiring (``None``: not observed).
RUNNER_ATTRIBUTE = "_otel_swa_telemetry"
#: Attribute of an instrumented ``CanaryManager`` holding the reporter of its model runner.
CANARY_ATTRIBUTE = "_otel_swa_reporter"

#: (module, class, method, parameters the wrapper relies on), as in sglang 0.5.23.
WRAPPED = (
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward", ("forward_batch",)),
    ("sglang.srt.kv_canary.runner.canary_manager", "CanaryManager", "__init__",
     ("device", "req_to_token_pool", "swa_allocator", "is_eagle_draft_decode")),
    ("sglang.srt.kv_canary.runner.canary_manager", "CanaryManager", "pre_ops_maybe_inside_graph",
     ("forward_batch",)),
)


class SglangVersionError(EngineVersionError):
    """The installed SGLang lacks a method (or parameter) this instrumentation wraps.

    An ``ImportError``, so that ``opentelemetry-instrument`` logs it, skips this instrumentor and
    loads the others."""


def _forward_mode_counts(forward_batch: Any, batch_size: int | None) -> tuple[int | None, int | None]:
    """``(num_prefill, num_decode)`` of a pure extend or pure decode batch, else ``(None, None)``."""
    mode = getattr(forward_batch, "forward_mode", None)
    try:
        if mode.is_decode():
            return 0, batch_size
        if mode.is_extend() and not mode.is_mixed():
            return batch_size, 0
    except Exception:
        pass
    return None, None


class SwaSglangInstrumentor(EngineInstrumentor):
    """Instrumentor for SGLang's model runner and KV canary (module docstring).

    ``instrument(**kwargs)`` accepts ``tracer_provider``, ``meter_provider``, ``logger_provider``,
    ``span_events`` (default True), ``max_links`` (forward-step link limit) and ``traceparents``
    (request id -> W3C traceparent, a mapping or callable: the forward-step span then links to the
    spans of ``forward_batch.rids``).

    Raises (from ``instrument``):
        SglangVersionError: a supported SGLang version lacks a wrapped method or has other
            parameters (not raised when SGLang is missing or unsupported: a warning is logged).
    """

    name = "swa_sglang"
    engine = "SGLang"
    distribution = "sglang"
    instruments = _instruments
    wrapped = WRAPPED
    version_error = SglangVersionError

    def _wrappers(self) -> tuple:
        return (self._wrap_forward, self._wrap_canary_init, self._wrap_pre_ops)

    # ------------------------------------------------------------------ reporters
    def _wire(self, runner: Any) -> Any:
        """The wiring of ``runner`` (made at its first forward), or ``None`` if not observed."""
        from otel_swa.views.sglang import KvCanaryHooks

        wiring = None
        try:
            if not getattr(runner, "is_draft_worker", False):
                canary = getattr(runner, "canary_manager", None)
                reporter = getattr(canary, CANARY_ATTRIBUTE, None) if canary is not None else None
                # The canary's pre_ops hook counts verified entries only for the reporter it
                # carries; a reporter made here (canary built before instrument(), or none)
                # counts the entries attention reads after each forward instead.
                counts_from_canary = reporter is not None
                allocator = getattr(runner, "token_to_kv_pool_allocator", None)
                is_swa = getattr(allocator, "full_to_swa_index_mapping", None) is not None
                window = int(getattr(runner, "sliding_window_size", None) or 0)
                if reporter is None and is_swa and window > 0:
                    reporter = self._new_reporter(runner.device)
                if reporter is not None:
                    hooks = KvCanaryHooks(
                        reporter,
                        swa_allocator=allocator if is_swa else None,
                        req_to_token_pool=runner.req_to_token_pool if is_swa else None,
                    )
                    wiring = SimpleNamespace(
                        reporter=reporter, hooks=hooks, window=window, counts_from_canary=counts_from_canary
                    )
                    weakref.finalize(runner, reporter.close)
        except Exception:
            _log.exception("instrumenting an SGLang model runner failed; it runs uninstrumented")
            wiring = None
        runner.__dict__[RUNNER_ATTRIBUTE] = wiring
        return wiring

    # ------------------------------------------------------------------ wrappers
    def _wrap_forward(self, original: Callable) -> Callable:
        instrumentor = self

        @functools.wraps(original)
        def forward(runner, forward_batch, *args, **kwargs):
            wiring = runner.__dict__[RUNNER_ATTRIBUTE] if RUNNER_ATTRIBUTE in runner.__dict__ else instrumentor._wire(runner)
            if wiring is None:
                return original(runner, forward_batch, *args, **kwargs)
            with contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(instrumentor._span(wiring, forward_batch))
                except Exception:
                    _log.exception("forward-step span not started")
                output = original(runner, forward_batch, *args, **kwargs)
                try:
                    instrumentor._after_forward(wiring, forward_batch)
                except Exception:  # telemetry never breaks the forward
                    _log.exception("SWA divergence reporter step failed")
            return output

        return forward

    def _span(self, wiring: Any, forward_batch: Any):
        batch_size = getattr(forward_batch, "batch_size", None)
        num_prefill, num_decode = _forward_mode_counts(forward_batch, batch_size)
        rids = getattr(forward_batch, "rids", None) if self._traceparents is not None else None
        return self._forward_spans.forward_span(
            forward_ct=wiring.reporter.forward_ct + 1,
            batch_size=batch_size,
            num_prefill=num_prefill,
            num_decode=num_decode,
            request_ids=rids or (),
        )

    @staticmethod
    def _after_forward(wiring: Any, forward_batch: Any) -> None:
        reporter = wiring.reporter
        if not wiring.counts_from_canary:
            seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
            if seq_lens is None:
                seq_lens = forward_batch.seq_lens  # device tensor: the sums stay on the device
                reporter.observe("full", seq_lens.sum())
                reporter.observe("swa", seq_lens.clamp(max=wiring.window).sum())
            else:
                reporter.observe("full", int(seq_lens.sum()))
                reporter.observe("swa", int(seq_lens.clamp(max=wiring.window).sum()))
        wiring.hooks.step(outer_step_counter=reporter.forward_ct + 1, maybe_inaccurate_forward_batch=forward_batch)

    def _wrap_canary_init(self, original: Callable) -> Callable:
        instrumentor = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(manager, *args, **kwargs):
            original(manager, *args, **kwargs)
            try:
                # device and is_eagle_draft_decode may come by position or by keyword
                bound = signature.bind(manager, *args, **kwargs)
                bound.apply_defaults()
                reporter = None
                if not bound.arguments.get("is_eagle_draft_decode", False):
                    reporter = instrumentor._new_reporter(bound.arguments["device"])
                setattr(manager, CANARY_ATTRIBUTE, reporter)
            except Exception:
                _log.exception("SWA divergence reporter not attached to the KV canary")

        return __init__

    def _wrap_pre_ops(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def pre_ops_maybe_inside_graph(manager, forward_batch, *args, **kwargs):
            output = original(manager, forward_batch, *args, **kwargs)
            reporter = getattr(manager, CANARY_ATTRIBUTE, None)
            if reporter is not None:
                try:
                    from otel_swa.views.sglang import observe_verified

                    for group, plan in zip(manager._buffer_groups, output.verify_plans):
                        observe_verified(reporter, group, plan.verify_num_valid)
                except Exception:
                    _log.exception("verified KV entries not counted")
            return output

        return pre_ops_maybe_inside_graph
