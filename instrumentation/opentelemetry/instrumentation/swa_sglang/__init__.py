"""OpenTelemetry instrumentation of SGLang's hybrid sliding-window-attention (SWA) KV cache.

Supported: sglang 0.5.23 up to (not including) 0.6 (``package.py``); the wrapped methods were read
in sglang 0.5.23, and run there inside a real ``sglang.Engine`` (``tests/engines/test_sglang_engine.py``).
Each method is wrapped when the process imports its module (SGLang's scheduler process imports the
model runner; its tokenizer and detokenizer processes never pay for it). The first three are the
points where SGLang's own KV canary calls its SWA divergence reporter:

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

``sglang.srt.managers.scheduler.Scheduler.run_batch(self, batch)``
    Remembers, on the calling thread, the scheduler and the ``ScheduleBatch`` being run (SGLang
    calls ``ModelRunner.forward`` from inside it): the forward-step span links to the root spans of
    SGLang's own request tracing (``req.time_stats.trace_ctx``, ``--enable-trace``) of the batch's
    requests, and each sample is audited against every holder of KV
    (:func:`otel_swa.views.sglang.scheduler_holder_full_slots`). At its first call per scheduler it
    registers the scheduler's pools for the pool usage gauges (``kv_cache.pool.*``, read at
    collection time by :func:`otel_swa.views.sglang.scheduler_pool_usage`, SGLang's own
    computation of its pool gauges, with the process's ranks). The instrumentor also adds the
    method ``Scheduler.otel_swa_flush`` (:data:`FLUSH_RPC_METHOD`).
``sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs(self, ...)``
    Wires the model runner (its reporter, its provenance) before SGLang captures its CUDA graphs
    (sglang 0.5.23 calls it at start-up with or without graphs), so that the captured forwards hold
    the provenance stamps, checksums and write check of the attention layers below. A runner built
    before ``instrument()`` is wired at its first forward instead: its graphs (if any) hold no check,
    so its graph runners' ``can_run_graph`` answers False at sampling steps and those steps run
    eagerly, checked (the other steps replay as before); its provenance is off when it has graphs
    (their replays write KV without stamps), and otherwise counts slots never stamped as unchecked
    (KV written before it was wired). Provenance is also off where SGLang fills slots without a
    forward step (HiCache, LMCache, disaggregation: :func:`otel_swa.views.sglang.kv_filled_outside_forward`).
``sglang.srt.layers.radix_attention.RadixAttention.forward(self, q, k, v, forward_batch, ...)``
    The KV's provenance (:mod:`otel_swa.device.provenance`; ``OTEL_SWA_PROVENANCE``, default
    ``prefix``). Each attention layer of an observed model runner carries its wiring (set when the
    runner is wired, so a capture finds it too). Before the first attention layer of every forward
    step (the lowest layer id of the ``SWAKVPool``), the slots the step writes are stamped from the
    batch's ``input_ids``, ``positions`` and ``out_cache_loc`` (FULL pool) and their
    ``full_to_swa_index_mapping`` (SWA pool); after every layer's forward (which stored the step's
    K/V through ``set_kv_buffer``), the K/V the layer was given are hashed into the checksum table
    when it is its pool's designated layer (index 0 of its sub-pool: the layer SGLang's KV canary
    hashes) and, at sampled steps, compared with what the pool holds at the slot the tables name
    (the write check). Decode, extend and mixed batches that store K/V; not idle, speculative verify
    or cross-attention calls (a model runner with speculative decoding gets no provenance: a verify
    step writes draft tokens' K/V that are later rejected). At each sample the stamps and checksums
    of the batch's live slots are verified against each request's own token ids
    (``Req.origin_input_ids`` + ``Req.output_ids`` of the ``ScheduleBatch`` being run; with the
    overlap scheduler a decode step's input token is not yet on the host, so each request's last
    position is left unchecked there), and the checksums of the slots SGLang's radix cache holds
    (``tree_cache.all_values_flatten()``, read once per sweep pass), a budget of slots per pool and
    sample.
    The read check (:mod:`otel_swa.device.read_check`; ``OTEL_SWA_READ_CHECK``, default
    ``rotate``; with it and provenance off this method is not wrapped at all). At a sampled forward step, after a
    sliding-window layer's attention (``sliding_window_size > -1``), the attention output of the
    last token of up to ``OTEL_SWA_READ_CHECK_QUERIES`` (8) requests is recomputed from the layer's
    KV buffers (``forward_batch.token_to_kv_pool.get_key_buffer(layer_id)`` /
    ``get_value_buffer``: the SWA sub-pool's for a sliding-window layer of ``SWAKVPool``, indexed by
    ``full_to_swa_index_mapping[req_to_token[row, position]]``) over the ``sliding_window_size + 1``
    positions one query reads, with the layer's ``scaling``, ``logit_cap`` (tanh capping),
    ``tp_q_head_num`` / ``tp_k_head_num`` (GQA), ``head_dim`` and the ``sinks`` keyword argument
    when given, and compared with what the backend returned. Checked: decoder self-attention in
    decode, extend (prefill, chunked prefill) and mixed batches with float32, float16 or bfloat16
    KV buffers. Counted as unchecked, never as a fault: cross-attention and encoder-only layers,
    other logit capping methods, speculative target-verify and draft batches, quantized (fp8) KV
    buffers, and a step replayed from a CUDA graph captured without the check. The check is called
    inside a capture too whenever the wrapper knows the runner then (``reporter.checks_wanted()``),
    and the ``ModelRunner.forward`` wrapper sets the reporter's sampling flag before each forward
    (``reporter.before_forward()``): a step replayed from a graph that holds the check is checked at
    its sampled steps as an eager one and counts nothing at the others (:mod:`otel_swa.device.gate`).
    Other steps cost one attribute read per layer call.
``sglang.srt.entrypoints.engine.Engine.shutdown(self)``
    In the main process, before SGLang kills its schedulers with SIGKILL (which runs no exit hook
    there): calls ``otel_swa_flush`` on every scheduler over SGLang's own RPC
    (``RpcReqInput``, ``Scheduler.handle_rpc_request``) and waits for the answer while a scheduler
    is alive, at most the OTLP timeout (:func:`otel_swa.config.otlp_timeout_s`), so the pending
    samples are delivered and the SDK's buffers exported (:func:`otel_swa.lifecycle.flush_all`).
    Only when the schedulers are instrumented too (``opentelemetry-instrument``'s
    ``sitecustomize`` on ``PYTHONPATH``, or otel-swa's SGLang plugin switched on:
    :mod:`opentelemetry.instrumentation.swa_plugins`).
``sglang.srt.utils.common.kill_process_tree`` and ``sglang.srt.entrypoints.http_server._setup_and_run_http_server``
    The other stop paths of the main process (``launch_server``'s end after SIGINT, a child's
    failure): the same flush before SGLang SIGKILLs the schedulers; every way SGLang stops, and
    what flushes in each, is in :mod:`opentelemetry.instrumentation.swa_sglang.stop_paths`.

Ranks: each reporter's metric points, events and forward-step spans carry ``otel_swa.tp_rank``,
``otel_swa.pp_rank`` and ``otel_swa.dp_rank`` as SGLang published them in the process
(``sglang.srt.runtime_context.get_parallel()``): under ``opentelemetry-instrument`` the resource is
built before SGLang knows the rank. Counts from the canary's plans are tagged
``verify_source=kv_canary``; read-entry counts (below) ``verify_source=attention``.

Without the KV canary there are no verify plans; the reporter then counts the entries attention
reads at each forward step: ``seq_len`` per request in the FULL pool and, in the SWA pool, the
union of the windows of the request's new tokens, ``min(seq_len, window + extend_len - 1)`` with
``window = ModelRunner.sliding_window_size + 1`` (the keys one query reads: SGLang's value
excludes the current token) and ``extend_len`` from ``forward_batch.extend_seq_lens_cpu`` (1 in a
decode batch), from ``forward_batch.seq_lens_cpu`` on the host when SGLang has it, else from
``seq_lens`` on the device (two small reductions, no sync; one new token per request assumed).
A model runner whose allocator has no ``full_to_swa_index_mapping`` (not a hybrid SWA model), or
uses SGLang's per-request SWA ring (``allocator.swa_req_ring``: the mapping is never written), and
no canary gets no reporter; with the canary, its reporter counts the canary's entries and samples
no mapping (divergence and out-of-window 0, as for a model without SWA).

The sliding-window check: every view carries the window attention reads,
``ModelRunner.sliding_window_size + 1`` (SGLang's value excludes the current token), and SGLang's
eviction allowance (:func:`otel_swa.views.sglang.sglang_window`: the page rounding, the
prefix-sharing margin and ``SGLANG_SWA_EVICTION_INTERVAL``), so each record counts the in-window
tokens without an SWA slot (premature eviction, must be 0) and the SWA slots held past the window
plus that allowance (late-held; a prefill's are counted at the request's first decode step, before
SGLang's first eviction). In an extend batch the window starts where the chunk's first query reads
(``forward_batch.extend_seq_lens_cpu``: the last ``sliding_window_size + extend_len`` positions).
A model runner whose allocator uses the per-request SWA ring (``swa_req_ring``) gets no window
check: that mode never writes ``full_to_swa_index_mapping``.

Switch: ``OTEL_SWA_DIVERGENCE_INTERVAL`` (or SGLang's
``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``), read when ``instrument()`` runs. Unset or 0:
nothing is wrapped, the engine runs its own code unchanged. An unusable value is logged and
nothing is wrapped. Each model runner gets its own
:class:`~otel_swa.reporter.SwaDivergenceReporter` on its device (``OTEL_SWA_RING_SIZE`` ring
slots); its records become the metrics and events of :mod:`otel_swa.telemetry` (the table
"Record field → instrument" in ``docs/telemetry.md``) and, with the ``swa_logline`` logs exporter,
otel-swa's line (``otel_swa[verify=...] kv_canary_swa_divergence={...}``, the record part
byte-identical to SGLang's). With SGLang's KV canary on, set only ``OTEL_SWA_DIVERGENCE_INTERVAL``:
the SGLang variable also switches on SGLang's own reporter there (sglang 0.5.23 reads it only in
``CanaryManager.__init__``), which then logs its line beside ours. Pending samples are
delivered at every stop of the engine or server (above, and
:mod:`~opentelemetry.instrumentation.swa_sglang.stop_paths`), when the model runner is
garbage-collected, at interpreter exit, and at ``uninstrument()``; while the engine runs, metrics
are exported at least every ``OTEL_SWA_METRIC_EXPORT_INTERVAL`` (5 s;
:mod:`otel_swa.telemetry.export_schedule`), so that a kill from outside loses at most that much.

When SGLang is not installed, or its version is outside ``_instruments``, ``instrument()`` logs one
warning per process tree (logger ``opentelemetry.instrumentation.swa_sglang``; a debug message
instead where another engine instrumentor has its engine) and wraps nothing, also when called as
``opentelemetry-instrument`` calls it (``instrument(skip_dep_check=True)``, which bypasses
``BaseInstrumentor``'s own version check), so the loader goes on to the other instrumentors.
Where a supported SGLang lacks a wrapped method or its parameters differ, ``instrument()`` raises
:class:`SglangVersionError` naming the installed version and the method it expected (an
``ImportError``, the one kind of error the loader of opentelemetry-instrumentation 0.66b2 logs and
skips; any other exception would end all auto-instrumentation) when the module is already
imported; when it is imported later, the same error is logged and that module is left unwrapped. A failure while setting up the
telemetry is logged and leaves SGLang unwrapped.

Providers come from ``instrument(tracer_provider=..., meter_provider=..., logger_provider=...)``,
the global ones otherwise; the instrumentor never installs providers itself. ``uninstrument()``
restores the original functions (the same objects); both calls are idempotent.

Usage::

    # SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL=20 python -m sglang.launch_server ...
    # (SGLang's plugin framework runs it in every process: opentelemetry.instrumentation.swa_plugins)
    # OTEL_SWA_DIVERGENCE_INTERVAL=20 opentelemetry-instrument python -m sglang.launch_server ...
    # (instrument() called in a script does not reach SGLang's spawned scheduler processes; in a
    # process that runs the model runner itself:)
    from opentelemetry.instrumentation.swa_sglang import SwaSglangInstrumentor

    SwaSglangInstrumentor().instrument()     # before SGLang builds its model runners
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import weakref
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
from opentelemetry.instrumentation.swa_sglang import stop_paths
from opentelemetry.instrumentation.swa_sglang.package import _instruments

from otel_swa.engine_wrapping import EngineInstrumentor, EngineVersionError

__all__ = [
    "SwaSglangInstrumentor",
    "SglangVersionError",
    "WRAPPED",
    "RUNNER_ATTRIBUTE",
    "CANARY_ATTRIBUTE",
    "FLUSH_RPC_METHOD",
]

_log = logging.getLogger(__name__)

#: Attribute of an instrumented ``ModelRunner`` holding its wiring (``None``: not observed).
RUNNER_ATTRIBUTE = "_otel_swa_telemetry"
#: Attribute of an instrumented ``Scheduler`` holding its pool usage registration.
POOLS_ATTRIBUTE = "_otel_swa_pools"
#: Attribute of an instrumented ``CanaryManager`` holding the reporter of its model runner.
CANARY_ATTRIBUTE = "_otel_swa_reporter"
#: Attribute of each attention layer (``RadixAttention``) of an observed model runner holding its
#: provenance wiring: the layer finds it also while SGLang captures a CUDA graph (the capture calls
#: the model, not ``ModelRunner.forward``).
PROVENANCE_ATTRIBUTE = "_otel_swa_provenance"

#: (module, class, method, parameters the wrapper relies on), as in sglang 0.5.23.
WRAPPED = (
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward", ("forward_batch",)),
    ("sglang.srt.kv_canary.runner.canary_manager", "CanaryManager", "__init__",
     ("device", "req_to_token_pool", "swa_allocator", "is_eagle_draft_decode")),
    ("sglang.srt.kv_canary.runner.canary_manager", "CanaryManager", "pre_ops_maybe_inside_graph",
     ("forward_batch",)),
    ("sglang.srt.managers.scheduler", "Scheduler", "run_batch", ("batch",)),
    ("sglang.srt.entrypoints.engine", "Engine", "shutdown", ()),
    ("sglang.srt.layers.radix_attention", "RadixAttention", "forward", ("q", "k", "v", "forward_batch")),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "init_cuda_graphs", ()),
)

#: The ``Scheduler`` method the instrumentor adds (:data:`stop_paths.FLUSH_RPC_METHOD`).
FLUSH_RPC_METHOD = stop_paths.FLUSH_RPC_METHOD


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
    more_wrapped = stop_paths.WRAPPED  # kill_process_tree and the HTTP server (stop_paths.py)
    version_error = SglangVersionError

    def __init__(self) -> None:
        super().__init__()
        # The scheduler and the batch being run on this thread (set by the run_batch wrapper and
        # read by the forward wrapper, which SGLang calls from inside run_batch); kept when the
        # singleton is constructed again (see EngineInstrumentor.__init__).
        self.__dict__.setdefault("_running", threading.local())

    def _wrappers(self) -> tuple:
        return (self._wrap_forward, self._wrap_canary_init, self._wrap_pre_ops, self._wrap_run_batch,
                self._wrap_shutdown, self._wrap_attention, self._wrap_init_cuda_graphs)

    def _more_wrappers(self) -> tuple:
        return stop_paths.wrappers()

    def _set_up_telemetry(self, kwargs: dict) -> None:
        from otel_swa.telemetry.pools import pool_metrics

        super()._set_up_telemetry(kwargs)
        self._pools = pool_metrics(self._providers[1])

    def _wrap(self, targets: list, registry: Any = None) -> None:
        super()._wrap(targets, registry)
        for index, (cls, _function) in targets:
            if self.wrapped[index][1] == "Scheduler" and self._ready:
                # an added method: SGLang's HookRegistry hooks attributes that exist, so this is set here
                self._provide(cls, FLUSH_RPC_METHOD, stop_paths.flush_rpc)

    # ------------------------------------------------------------------ reporters
    def _wire(self, runner: Any, *, late: bool = False) -> Any:
        """The wiring of ``runner``, or ``None`` if not observed: made before SGLang captures its
        graphs (``ModelRunner.init_cuda_graphs``), or ``late`` at its first forward after
        ``instrument()`` (the runner was built before it: its KV cache may hold KV already and its
        graphs were captured without the checks; :func:`_graphs_without_checks`)."""
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
                # SGLang's per-request SWA ring (allocator.swa_req_ring) never writes the mapping:
                # nothing to sample there (every token would read as out of window)
                is_swa = (getattr(allocator, "full_to_swa_index_mapping", None) is not None
                          and getattr(allocator, "swa_req_ring", False) is not True)
                window = int(getattr(runner, "sliding_window_size", None) or 0)
                ranks = _ranks()
                if reporter is None and is_swa and window > 0:
                    reporter = self._new_reporter(runner.device, attributes=ranks)
                read_check = provenance = None
                if reporter is not None and is_swa and window > 0 and getattr(runner, "token_to_kv_pool", None) is not None:
                    read_check = _enable_read_check(reporter)
                    provenance = _enable_provenance(reporter, runner, late=late)
                    if late and _graphs_without_checks(runner, reporter):
                        _log.info("this model runner's graphs were captured before otel-swa was wired: "
                                  "its sampled steps run eagerly (checked), the others replay")
                if reporter is not None:
                    hooks = KvCanaryHooks(
                        reporter,
                        swa_allocator=allocator if is_swa else None,
                        req_to_token_pool=runner.req_to_token_pool if is_swa else None,
                        holder_full_slots=self._holder_full_slots if is_swa else None,
                        token_ids=self._token_ids if provenance is not None else None,
                        sweep_full_slots=self._prefix_cache_full_slots if provenance is not None else None,
                        **(_window_check(window, allocator) if is_swa and window > 0 else {}),
                    )
                    wiring = SimpleNamespace(
                        reporter=reporter, hooks=hooks, window=window, counts_from_canary=counts_from_canary,
                        ranks=ranks, read_check=read_check, allocator=allocator if is_swa else None,
                        kv_pool=getattr(runner, "token_to_kv_pool", None), req_to_token_pool=runner.req_to_token_pool,
                        provenance=provenance,
                    )
                    if provenance is not None:
                        _attach_provenance(runner, SimpleNamespace(
                            provenance=provenance[0], layout=provenance[1], allocator=allocator,
                            req_to_token_pool=runner.req_to_token_pool, kv_pool=runner.token_to_kv_pool,
                        ))
                    weakref.finalize(runner, reporter.close)
                    self._add_savings_sink(runner, reporter, ranks)
        except Exception:
            _log.exception("instrumenting an SGLang model runner failed; it runs uninstrumented")
            wiring = None
        runner.__dict__[RUNNER_ATTRIBUTE] = wiring
        return wiring

    def _add_savings_sink(self, runner: Any, reporter: Any, ranks: dict) -> None:
        """``kv_cache.swa.memory.saved`` for ``reporter``'s samples, from the SWA KV pool's bytes per
        token (:func:`otel_swa.views.sglang.swa_kv_bytes_per_token`), when the model has one."""
        from otel_swa.views.sglang import swa_kv_bytes_per_token

        try:
            bytes_per_token = swa_kv_bytes_per_token(getattr(runner, "token_to_kv_pool", None))
            if bytes_per_token:
                reporter.add_sink(self._pools.savings_sink(bytes_per_token, ranks))
        except Exception:  # the reporter's other sinks are unaffected
            _log.exception("kv_cache.swa.memory.saved is not recorded for this model runner")

    def _register_pools(self, scheduler: Any) -> None:
        """Register ``scheduler``'s pools for the pool usage gauges, once per scheduler (and let it
        answer a flush request at its exit: :func:`stop_paths.remember_scheduler`)."""
        from otel_swa.views.sglang import scheduler_pool_usage

        stop_paths.remember_scheduler(scheduler)

        registration = None
        try:
            registration = self._pools.register(scheduler_pool_usage, owner=scheduler, attributes=_ranks())
        except Exception:
            _log.exception("SGLang's KV pools are not observed (pool usage gauges)")
        scheduler.__dict__[POOLS_ATTRIBUTE] = registration

    # ------------------------------------------------------------------ wrappers
    def _wrap_forward(self, original: Callable) -> Callable:
        instrumentor = self

        @functools.wraps(original)
        def forward(runner, forward_batch, *args, **kwargs):
            wiring = (runner.__dict__[RUNNER_ATTRIBUTE] if RUNNER_ATTRIBUTE in runner.__dict__
                      else instrumentor._wire(runner, late=True))
            if wiring is None:
                return original(runner, forward_batch, *args, **kwargs)
            with contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(instrumentor._span(wiring, forward_batch))
                except Exception:
                    _log.exception("forward-step span not started")
                running = instrumentor._running
                running.wiring = wiring  # for the read check of the attention layers it calls
                try:  # the sampling flag of the checks a graph holds (and the eager ones' decision)
                    wiring.reporter.before_forward(micro_batch=instrumentor._micro_batch())
                except Exception:
                    _log.exception("the sampling flag was not set")
                try:
                    output = original(runner, forward_batch, *args, **kwargs)
                finally:
                    running.wiring = None
                try:
                    instrumentor._after_forward(wiring, forward_batch)
                except Exception:  # telemetry never breaks the forward
                    _log.exception("SWA divergence reporter step failed")
            return output

        return forward

    def _span(self, wiring: Any, forward_batch: Any):
        forward_ct = wiring.reporter.forward_ct + 1
        if not self._forward_spans.spans_step(forward_ct):  # no span, nothing looked up
            return self._forward_spans.forward_span(forward_ct=forward_ct)
        batch_size = getattr(forward_batch, "batch_size", None)
        num_prefill, num_decode = _forward_mode_counts(forward_batch, batch_size)
        rids = getattr(forward_batch, "rids", None) if self._traceparents is not None else None
        link_contexts = None
        if self._traceparents is None:  # no lookup given: link to SGLang's own request spans
            link_contexts = _request_span_contexts(getattr(self._running, "batch", None))
        return self._forward_spans.forward_span(
            forward_ct=forward_ct,
            batch_size=batch_size,
            num_prefill=num_prefill,
            num_decode=num_decode,
            request_ids=rids or (),
            link_contexts=link_contexts,
            attributes=wiring.ranks,
        )

    def _holder_full_slots(self) -> Any:
        """Every live holder's FULL slots, from the scheduler running this thread's batch (``None``
        outside ``Scheduler.run_batch``, or when they cannot all be found: no audit then)."""
        from otel_swa.views.sglang import scheduler_holder_full_slots

        scheduler = getattr(self._running, "scheduler", None)
        if scheduler is None:
            return None
        return scheduler_holder_full_slots(scheduler, getattr(self._running, "batch", None))

    def _token_ids(self) -> "list | None":
        """Each request's token ids of the batch being run on this thread (``None`` outside
        ``Scheduler.run_batch``; see :func:`otel_swa.views.sglang.request_token_ids`)."""
        from otel_swa.views.sglang import request_token_ids

        batch = getattr(self._running, "batch", None)
        if batch is None:
            return None
        return request_token_ids(batch, len(batch.reqs))

    def _prefix_cache_full_slots(self) -> Any:
        """The FULL slots SGLang's prefix cache holds, from the scheduler running this thread's batch
        (``None`` outside ``Scheduler.run_batch``; :func:`otel_swa.views.sglang.scheduler_prefix_cache_full_slots`)."""
        from otel_swa.views.sglang import scheduler_prefix_cache_full_slots

        scheduler = getattr(self._running, "scheduler", None)
        return scheduler_prefix_cache_full_slots(scheduler) if scheduler is not None else None

    def _micro_batch(self) -> int | None:
        """The pipeline micro-batch of the batch being run on this thread (``None`` without a
        pipeline; see :func:`otel_swa.views.sglang.scheduler_micro_batch`)."""
        scheduler = getattr(self._running, "scheduler", None)
        if scheduler is None:
            return None
        from otel_swa.views.sglang import scheduler_micro_batch

        return scheduler_micro_batch(scheduler, getattr(self._running, "batch", None))

    def _after_forward(self, wiring: Any, forward_batch: Any) -> None:
        reporter = wiring.reporter
        if not wiring.counts_from_canary:
            window = wiring.window + 1  # the keys one query reads (sliding_window_size excludes itself)
            seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
            if seq_lens is None:
                seq_lens = forward_batch.seq_lens  # device tensor: the sums stay on the device
                reporter.observe("full", seq_lens.sum())
                reporter.observe("swa", seq_lens.clamp(max=window).sum())
            else:  # host lengths: host sums (numpy over the tensor's memory, no torch operation)
                lens = seq_lens.numpy() if hasattr(seq_lens, "numpy") else seq_lens
                reporter.observe("full", int(np.sum(lens)))
                reporter.observe("swa", _swa_entries_read(lens, forward_batch, window))
        check = wiring.read_check
        if check is not None and check.layer_calls == 0 and check.recorded_calls == 0 and reporter.read_check_due():
            # a sampled step whose attention layers did not run in Python (a CUDA graph replay) from
            # a graph that does not hold the check: its queries are counted unchecked, never
            # silently left out (a graph that holds it checked them at the replay)
            indices = getattr(forward_batch, "req_pool_indices", None)
            batch = getattr(forward_batch, "batch_size", None) or (0 if indices is None else int(indices.shape[0]))
            check.unchecked(min(check.max_queries, int(batch)))
        wiring.hooks.step(
            outer_step_counter=reporter.forward_ct + 1, maybe_inaccurate_forward_batch=forward_batch,
            micro_batch=self._micro_batch(),
        )

    def _wrap_attention(self, original: Callable) -> Callable:
        """``RadixAttention.forward``: the provenance stamps, checksums and write check of every
        attention layer, and the read check of sliding-window layers at sampled steps (module
        docstring); the original itself when both ``OTEL_SWA_READ_CHECK`` and
        ``OTEL_SWA_PROVENANCE`` are off."""
        from otel_swa import config

        try:
            reads = config.read_check() is not None
        except config.ConfigError:
            _log.exception("the read check is off: unusable %s", "OTEL_SWA_READ_CHECK(_QUERIES)")
            reads = False
        try:
            provenance = config.provenance() is not None
        except config.ConfigError:
            _log.exception("provenance is off: unusable %s", "OTEL_SWA_PROVENANCE(_BUDGET)")
            provenance = False
        if not reads and not provenance:
            return original
        running = self._running
        failed: set = set()

        def failure(what: str, layer: Any, exc: Exception) -> None:
            if (what, type(exc)) not in failed:
                failed.add((what, type(exc)))
                _log.exception("the %s of layer %s failed; the forward goes on (later %s errors are not logged)",
                               what, getattr(layer, "layer_id", "?"), type(exc).__name__)

        @functools.wraps(original)
        def forward(layer, q, k, v, forward_batch, *args, **kwargs):
            wired = layer.__dict__.get(PROVENANCE_ATTRIBUTE)
            if wired is not None and layer.layer_id == wired.layout["first_layer"]:
                try:
                    _stamp(wired, forward_batch)
                except Exception as exc:  # telemetry never breaks the forward
                    failure("provenance stamp", layer, exc)
            output = original(layer, q, k, v, forward_batch, *args, **kwargs)
            if wired is not None:
                try:
                    _after_layer(wired, layer, k, v, forward_batch, args, kwargs)
                except Exception as exc:
                    failure("provenance check", layer, exc)
            wiring = getattr(running, "wiring", None)
            if wiring is None or wiring.read_check is None or not wiring.reporter.checks_wanted():
                return output
            try:
                _check_read(wiring, layer, q, output, forward_batch, kwargs)
            except Exception as exc:
                failure("read check", layer, exc)
            return output

        return forward

    def _wrap_init_cuda_graphs(self, original: Callable) -> Callable:
        """``ModelRunner.init_cuda_graphs``: wire the model runner before SGLang captures its CUDA
        graphs (sglang 0.5.23 calls it at start-up with or without graphs), so the captured forwards
        hold the provenance stamps, checksums and checks."""
        instrumentor = self

        @functools.wraps(original)
        def init_cuda_graphs(runner, *args, **kwargs):
            if RUNNER_ATTRIBUTE not in runner.__dict__:
                instrumentor._wire(runner)
            return original(runner, *args, **kwargs)

        return init_cuda_graphs

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
                    reporter = instrumentor._new_reporter(
                        bound.arguments["device"], verify_source="kv_canary", attributes=_ranks()
                    )
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

    def _wrap_run_batch(self, original: Callable) -> Callable:
        running = self._running
        instrumentor = self

        @functools.wraps(original)
        def run_batch(scheduler, batch, *args, **kwargs):
            if POOLS_ATTRIBUTE not in scheduler.__dict__:
                instrumentor._register_pools(scheduler)
            running.scheduler, running.batch = scheduler, batch
            try:
                return original(scheduler, batch, *args, **kwargs)
            finally:
                running.scheduler = running.batch = None

        return run_batch

    def _wrap_shutdown(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def shutdown(engine, *args, **kwargs):
            try:
                stop_paths.flush_engine_schedulers(engine)
            except Exception:  # the engine's shutdown always goes on
                _log.exception("asking SGLang's schedulers to flush otel-swa's telemetry failed")
            return original(engine, *args, **kwargs)

        return shutdown


def _enable_read_check(reporter: Any) -> Any:
    """Switch ``reporter``'s read check on as ``OTEL_SWA_READ_CHECK`` says; the check, or ``None``."""
    from otel_swa import config

    try:
        mode = config.read_check()
    except config.ConfigError:
        return None  # logged when the attention layers were (not) wrapped
    if mode is None:
        return None
    return reporter.enable_read_check(max_queries=mode[1], layers=mode[0])


def _enable_provenance(reporter: Any, runner: Any, *, late: bool = False) -> "tuple[Any, dict] | None":
    """Switch ``reporter``'s provenance on for ``runner``'s KV pool as ``OTEL_SWA_PROVENANCE`` (the
    checksum's coverage) and ``OTEL_SWA_PROVENANCE_BUDGET`` say:
    ``(provenance, layout)`` (:func:`otel_swa.views.sglang.provenance_layout`), or ``None``, logged
    with the reason: off, a pool it cannot read, speculative decoding (a target-verify step writes
    the K/V of draft tokens that are later rejected, which the stamps do not follow), KV filled
    without a forward step (:func:`otel_swa.views.sglang.kv_filled_outside_forward`: HiCache, LMCache,
    disaggregation move bytes, not stamps), or a ``late`` runner whose graphs were captured without
    the stamps (their replays would write KV under stale stamps). A ``late`` runner without graphs
    gets provenance whose never-stamped slots are counted unchecked (its cache may hold KV written
    before it was wired)."""
    from otel_swa import config
    from otel_swa.views.sglang import kv_filled_outside_forward, provenance_layout

    try:
        settings = config.provenance()
    except config.ConfigError:
        return None  # logged when the attention layers were (not) wrapped
    if settings is None:
        return None
    speculative = getattr(runner, "spec_algorithm", None)
    if speculative is not None and not speculative.is_none():
        _log.info("KV provenance is off for a model runner with speculative decoding")
        return None
    moved = kv_filled_outside_forward(runner)
    if moved is not None:
        _log.info("KV provenance is off: %s without a forward step, and the stamps do not follow it", moved)
        return None
    if late and _captured_graphs(runner):
        _log.info("KV provenance is off: this model runner's graphs were captured before otel-swa was wired, "
                  "and their replays write KV without stamps")
        return None
    layout = provenance_layout(getattr(runner, "token_to_kv_pool", None))
    if layout is None:
        _log.info("KV provenance is off: the model runner's KV pool is not an SWAKVPool of K/V buffers")
        return None
    try:
        provenance = reporter.enable_provenance(full_slots=layout["full_slots"], swa_slots=layout["swa_slots"],
                                                checksum=settings[0], budget=settings[1],
                                                checksum_layers=layout["checksum_layers"],
                                                never_stamped="unchecked" if late else "foreign")
    except Exception:
        _log.exception("KV provenance is off for this model runner")
        return None
    return provenance, layout


def _captured_graphs(runner: Any) -> list:
    """``runner``'s graph runners that replay captured forwards (sglang 0.5.23
    ``ModelRunner.decode_cuda_graph_runner``, and ``prefill_cuda_graph_runner`` unless it is the
    ``EagerRunner``); empty before ``init_cuda_graphs`` or without graphs."""
    found = []
    for name in ("decode_cuda_graph_runner", "prefill_cuda_graph_runner"):
        graphs = getattr(runner, name, None)
        if graphs is not None and type(graphs).__name__ != "EagerRunner" and callable(getattr(graphs, "can_run_graph", None)):
            found.append(graphs)
    return found


def _graphs_without_checks(runner: Any, reporter: Any) -> bool:
    """For a runner wired after its graphs were captured (their forwards hold none of otel-swa's
    checks): make each graph runner's ``can_run_graph`` answer False at sampling steps (the host
    decision :meth:`~otel_swa.reporter.SwaDivergenceReporter.before_forward` set, ``reporter.gate.due``),
    so that a sampled step runs eagerly, checked as any eager step, and every other step replays as
    before. SGLang's ``ModelRunner._forward_raw`` asks ``can_run_graph`` of both graph runners
    before each forward and runs the eager forward when they answer False (as for a batch larger than
    any captured one). Returns whether any graph runner was found."""
    graphs = _captured_graphs(runner)
    gate = reporter.gate
    for runner_of_graphs in graphs:
        original = runner_of_graphs.can_run_graph

        def can_run_graph(forward_batch, *args, _original=original, **kwargs):
            if gate.due:
                return False
            return _original(forward_batch, *args, **kwargs)

        runner_of_graphs.can_run_graph = can_run_graph  # this instance only; SGLang's class is untouched
    return bool(graphs)


def _attach_provenance(runner: Any, wired: Any) -> None:
    """Give each attention layer (``RadixAttention``) of ``runner``'s model the provenance wiring."""
    import sys

    module = sys.modules.get("sglang.srt.layers.radix_attention")
    attention = getattr(module, "RadixAttention", None)
    model = getattr(runner, "model", None)
    if attention is None or model is None:
        return
    for layer in model.modules():
        if isinstance(layer, attention):
            layer.__dict__[PROVENANCE_ATTRIBUTE] = wired


def _writes_kv(forward_batch: Any) -> bool:
    """Whether the step writes the K/V of its tokens as the stamps follow them: decode, extend and
    mixed batches (not idle, speculative verify or draft steps)."""
    mode = forward_batch.forward_mode
    if mode.is_idle() or getattr(mode, "is_target_verify", lambda: False)():
        return False
    return bool(mode.is_decode() or mode.is_extend())


def _stamp(wired: Any, forward_batch: Any) -> None:
    """Stamp the slots this forward step writes (once per step, before its first attention layer)."""
    if not _writes_kv(forward_batch) or forward_batch.out_cache_loc is None:
        return
    extend = None if forward_batch.forward_mode.is_decode() else forward_batch.extend_start_loc
    wired.provenance.stamp(
        input_ids=forward_batch.input_ids, positions=forward_batch.positions, out_cache_loc=forward_batch.out_cache_loc,
        req_pool_indices=forward_batch.req_pool_indices, req_to_token=wired.req_to_token_pool.req_to_token,
        full_to_swa_index_mapping=wired.allocator.full_to_swa_index_mapping, extend_start_loc=extend,
    )


def _after_layer(wired: Any, layer: Any, k: Any, v: Any, forward_batch: Any, args: tuple, kwargs: dict) -> None:
    """One attention layer's checksum write and write check, after it stored this step's K/V."""
    save_kv_cache = args[0] if args else kwargs.get("save_kv_cache", True)
    if (k is None or v is None or not save_kv_cache or getattr(layer, "is_cross_attention", False)
            or not _writes_kv(forward_batch) or forward_batch.out_cache_loc is None):
        return
    layer_id = int(layer.layer_id)
    swa = layer_id in wired.layout["swa_layers"]
    if not wired.provenance.wants_layer(layer_id, swa):
        return  # not its pool's checksum layer, and no write check on it this step
    pool = wired.kv_pool
    wired.provenance.after_layer(
        layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=pool.get_key_buffer(layer_id),
        v_buffer=pool.get_value_buffer(layer_id), out_cache_loc=forward_batch.out_cache_loc,
        full_to_swa_index_mapping=wired.allocator.full_to_swa_index_mapping if swa else None,
        positions=forward_batch.positions,
        extend_start_loc=None if forward_batch.forward_mode.is_decode() else forward_batch.extend_start_loc,
    )


def _check_read(wiring: Any, layer: Any, q: Any, output: Any, forward_batch: Any, kwargs: dict) -> None:
    """The read check of one ``RadixAttention`` call at a sampled step (module docstring)."""
    window = getattr(layer, "sliding_window_size", -1)
    if window is None or window < 0:
        return  # a full-attention layer: not a sliding-window read
    check = wiring.read_check
    layer_id = int(layer.layer_id)
    if not check.wants(layer_id):
        return
    batch = int(forward_batch.req_pool_indices.shape[0])
    mode = forward_batch.forward_mode
    decode = mode.is_decode()
    attn_type = getattr(getattr(layer, "attn_type", None), "value", "decoder")
    variant_ok = (
        (decode or mode.is_extend()) and not getattr(mode, "is_target_verify", lambda: False)()
        and not getattr(mode, "is_draft_extend", lambda: False)() and not getattr(layer, "is_cross_attention", False)
        and attn_type == "decoder" and (not layer.logit_cap or getattr(layer, "logit_capping_method", "tanh") == "tanh")
    )
    if not variant_ok:
        check.unchecked(min(check.max_queries, batch))
        return
    out = output[0] if isinstance(output, tuple) else output
    pool = wiring.kv_pool  # the model runner's token_to_kv_pool (SWAKVPool for a hybrid model)
    mapping_of = getattr(pool, "layers_mapping", None)
    is_swa = bool(mapping_of[layer_id][1]) if mapping_of is not None and layer_id in mapping_of else False
    query_rows = None
    if not decode:
        query_rows = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
    check.check_layer(
        layer_id=layer_id, q=q, out=out, k_buffer=pool.get_key_buffer(layer_id), v_buffer=pool.get_value_buffer(layer_id),
        req_to_token=wiring.req_to_token_pool.req_to_token,
        full_to_swa_index_mapping=wiring.allocator.full_to_swa_index_mapping if is_swa else None,
        req_pool_indices=forward_batch.req_pool_indices, seq_lens=forward_batch.seq_lens, query_rows=query_rows,
        window=int(window) + 1, scaling=float(layer.scaling), num_q_heads=int(layer.tp_q_head_num),
        logit_cap=float(layer.logit_cap or 0.0), sinks=kwargs.get("sinks"),
    )


def _swa_entries_read(seq_lens_cpu: Any, forward_batch: Any, window: int) -> int:
    """SWA KV entries attention reads in this forward step: per request the union of its new
    tokens' windows, ``min(seq_len, window + extend_len - 1)``; ``extend_len`` from
    ``forward_batch.extend_seq_lens_cpu`` when it has one entry per request (extend and mixed
    batches), else 1 (decode)."""
    lens = np.asarray(seq_lens_cpu, dtype=np.int64).reshape(-1)
    extend = getattr(forward_batch, "extend_seq_lens_cpu", None)
    is_decode = getattr(getattr(forward_batch, "forward_mode", None), "is_decode", None)
    if extend is not None and not (callable(is_decode) and is_decode()):
        extend = np.asarray(extend.numpy() if hasattr(extend, "numpy") else extend, dtype=np.int64).reshape(-1)
        if extend.shape == lens.shape:
            return int(np.minimum(lens, np.maximum(extend, 1) + (window - 1)).sum())
    return int(np.minimum(lens, window).sum())


def _ranks() -> dict[str, int]:
    """This process's tensor / pipeline / data parallel ranks as SGLang published them
    (``sglang.srt.runtime_context.get_parallel()``), as otel-swa attributes; empty when unknown."""
    from otel_swa.telemetry import semconv as sc

    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    except Exception:
        return {}
    ranks = {}
    for key, name in ((sc.ATTR_TP_RANK, "tp_rank"), (sc.ATTR_PP_RANK, "pp_rank"), (sc.ATTR_DP_RANK, "dp_rank")):
        try:
            value = getattr(parallel, name)
        except Exception:  # not published in this process
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            ranks[key] = value
    return ranks


def _request_span_contexts(batch: Any) -> "list | None":
    """The span contexts of SGLang's own request spans (``req.time_stats.trace_ctx``, SGLang's
    request tracing, ``--enable-trace``) for the requests of ``batch``; ``None`` when SGLang traces
    none of them (no links are looked for then)."""
    from opentelemetry import trace

    if batch is None:
        return None
    contexts, traced = [], False
    for req in getattr(batch, "reqs", None) or ():
        trace_ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
        root = getattr(trace_ctx, "root_span_context", None) if getattr(trace_ctx, "tracing_enable", False) else None
        if root is None:
            contexts.append(None)
            continue
        traced = True
        contexts.append(trace.get_current_span(root).get_span_context())
    return contexts if traced else None


def _window_check(sliding_window_size: int, allocator: Any) -> dict:
    """The window check's arguments of :class:`~otel_swa.views.sglang.KvCanaryHooks` for a model
    runner (:func:`otel_swa.views.sglang.sglang_window`), from its ``sliding_window_size``, the
    allocator's page size and SGLang's ``SGLANG_SWA_EVICTION_INTERVAL`` (read through SGLang's own
    ``envs``, default 128 in sglang 0.5.23); ``{}`` (no window check) when they cannot be had."""
    from otel_swa.views.sglang import sglang_window

    try:
        try:
            from sglang.srt.environ import envs

            interval = max(1, int(envs.SGLANG_SWA_EVICTION_INTERVAL.get()))
        except Exception:  # an SGLang without the variable evicts at every step
            interval = 1
        window, allowance = sglang_window(sliding_window_size, int(getattr(allocator, "page_size", 1)), interval)
    except Exception:
        _log.exception("the sliding-window check is off for this model runner")
        return {}
    return {"sliding_window": window, "swa_eviction_allowance": allowance}
