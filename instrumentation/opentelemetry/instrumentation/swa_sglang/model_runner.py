"""The SGLang instrumentor's wiring of the model runner (``ModelRunner.forward`` and
``init_cuda_graphs``): its reporter, the forward-step span, the counts of entries attention reads,
the window check's arguments and the sample after each forward."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from opentelemetry.instrumentation.swa_sglang.attributes import CANARY_ATTRIBUTE, RUNNER_ATTRIBUTE
from opentelemetry.instrumentation.swa_sglang.process import _ranks
from opentelemetry.instrumentation.swa_sglang.provenance import (
    _attach_provenance, _enable_provenance, _graphs_without_checks,
)
from opentelemetry.instrumentation.swa_sglang.read_check import _enable_read_check

_log = logging.getLogger(__package__)  # the instrumentor's logger (opentelemetry.instrumentation.swa_sglang)


class ModelRunnerWiring:
    """The ``ModelRunner`` wrappers of :class:`~opentelemetry.instrumentation.swa_sglang.SwaSglangInstrumentor`
    (``runner.__dict__[RUNNER_ATTRIBUTE]``: a runner's wiring, made once)."""

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
