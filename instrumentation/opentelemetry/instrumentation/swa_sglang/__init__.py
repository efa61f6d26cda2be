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
    forward step (LMCache, disaggregation: :func:`otel_swa.views.sglang.kv_filled_outside_forward`);
    with HiCache it stays on and follows the KV to the host pools and back
    (:mod:`~opentelemetry.instrumentation.swa_sglang.hicache`: ``HostKVCache``'s copy calls and
    ``alloc`` are wrapped in the scheduler process when the first such runner is wired).
``sglang.srt.layers.radix_attention.RadixAttention.forward(self, q, k, v, forward_batch, ...)``
    The KV's provenance (:mod:`otel_swa.device.provenance`; ``OTEL_SWA_PROVENANCE``, default
    ``all``: every layer, every byte; ``prefix`` the cheaper one-layer, 64-byte option). Each attention layer of an observed model runner carries its wiring (set when the
    runner is wired, so a capture finds it too). Before the first attention layer of every forward
    step (the lowest layer id of the ``SWAKVPool``), the slots the step writes are stamped from the
    batch's ``input_ids``, ``positions`` and ``out_cache_loc`` (FULL pool) and their
    ``full_to_swa_index_mapping`` (SWA pool); after every layer's forward (which stored the step's
    K/V through ``set_kv_buffer``), the K/V the layer was given are hashed and folded into its pool's
    two folds per slot (:mod:`otel_swa.device.kv_folds`; with ``prefix`` only the pool's designated
    layer, index 0 of its sub-pool: the layer SGLang's KV canary hashes) and, at sampled steps, compared with what the pool holds at the slot the tables name
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

import functools
import logging
import threading
from typing import Any, Callable

from opentelemetry.instrumentation.swa_sglang import stop_paths
from opentelemetry.instrumentation.swa_sglang.attention import AttentionWiring
from opentelemetry.instrumentation.swa_sglang.attributes import (  # noqa: F401 (importable here, as before)
    CANARY_ATTRIBUTE, POOLS_ATTRIBUTE, PROVENANCE_ATTRIBUTE, RUNNER_ATTRIBUTE,
)
from opentelemetry.instrumentation.swa_sglang.canary import KvCanaryWiring
from opentelemetry.instrumentation.swa_sglang.model_runner import ModelRunnerWiring
from opentelemetry.instrumentation.swa_sglang.package import _instruments
from opentelemetry.instrumentation.swa_sglang.provenance import (  # noqa: F401 (importable here, as before)
    _captured_graphs, _enable_provenance, _graphs_without_checks,
)
from opentelemetry.instrumentation.swa_sglang.scheduler import SchedulerWiring

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

# The wiring, one module per SGLang part it hooks: the model runner (model_runner.py), the scheduler
# (scheduler.py), the KV canary (canary.py), the attention layers (attention.py, with provenance.py
# and read_check.py), and every stop path of the engine (stop_paths.py).

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


class SwaSglangInstrumentor(ModelRunnerWiring, SchedulerWiring, KvCanaryWiring, AttentionWiring, EngineInstrumentor):
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

    def _wrap_shutdown(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def shutdown(engine, *args, **kwargs):
            try:
                stop_paths.flush_engine_schedulers(engine)
            except Exception:  # the engine's shutdown always goes on
                _log.exception("asking SGLang's schedulers to flush otel-swa's telemetry failed")
            return original(engine, *args, **kwargs)

        return shutdown
