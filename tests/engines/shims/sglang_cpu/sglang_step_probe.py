"""A probe inside a real SGLang scheduler process, for the engine tests (never for users).

The process a test starts is not the one that runs the forward: ``sglang.Engine`` spawns a scheduler
process per rank. This module is imported there (through the shims' ``.pth`` file) when
``OTEL_SWA_TEST_SGLANG_PROBE`` names a directory, and does what a test cannot do from outside:

* **recount**: after every ``ModelRunner.forward`` of the target model (the call otel-swa's SGLang
  instrumentor counts), it recounts in plain Python, from the allocator's
  ``full_to_swa_index_mapping`` and ``req_to_token`` rows of the forward batch, the tokens whose SWA
  slot differs from their FULL slot and those whose SWA slot is 0, and appends
  ``{"pid", "step", "divergence", "out_of_window", "live_tokens"}`` to ``probe-<pid>.jsonl``: the
  independent value the reporter's records are compared with; with the model's window
  (``ModelRunner.sliding_window_size``, which SGLang's attention reads one more than), also
  ``"premature"``: the live tokens some query of the step reads (a query at ``q`` reads ``q -
  sliding_window_size .. q``; the step's queries are the last ``extend_seq_lens_cpu[i]`` positions
  in an extend or mixed batch, the last one in a decode batch) whose SWA slot is 0, and
  ``"held_past_window"``: those before them with an SWA slot, ``"queries"`` and ``"seq_lens"``:
  each request's queries in the step and its length, and ``"last_window_remapped"``: the tokens
  in the window of each request's last token whose SWA slot differs from their FULL slot (where a
  read at the raw FULL slots reads other KV);
* **leak** (``OTEL_SWA_TEST_SGLANG_LEAK_AT_STEP=N``): after forward step ``N``, takes the first page
  off the SWA allocator's free list, a leak made on purpose (the page is neither free nor mapped by
  any token); the line gets ``"leaked_page"``;
* **pools**: after every ``Scheduler.run_batch``, SGLang's own pool statistics
  (``scheduler.pool_stats_observer.get_pool_stats()``, what its Prometheus pool gauges report)
  beside what otel-swa's reader (:func:`otel_swa.views.sglang.scheduler_pool_usage`) gives at
  that moment, and, when otel-swa's flush RPC arrives (``Engine.shutdown``: the metric collection
  that exports the pool gauges runs inside it, on the same thread), SGLang's statistics just
  before it; one line each in ``pools-<pid>.jsonl`` (``"at": "run_batch"`` or ``"flush"``);
* **hooks** for the fault injections (``sglang_faults``, ``sglang_perturb_phases``): callbacks when
  SGLang builds a step's ``ForwardBatch`` (:func:`on_forward_batch`), before and after each forward
  step (:func:`before_forward`, :func:`after_forward`) and before SGLang processes a batch's result
  (:func:`before_result`), and the ``ScheduleBatch`` being run (:func:`current_batch`);
* **the process** at its first forward step: which of the methods otel-swa's SGLang instrumentor
  wraps carry otel-swa's wrapper and how (:func:`otel_swa_wrappers`), whether the instrumentor's
  module was imported at all, and how many otel-swa reporters live in the process (one JSON
  object in ``process-<pid>.json``): what tells a plugin run, an ``opentelemetry-instrument`` run,
  both at once and an engine with the switch off apart from inside;
* **by hand** (``OTEL_SWA_TEST_SGLANG_BY_HAND=1``): replaces the reporter SGLang's KV canary builds
  (``canary_manager.SwaDivergenceReporter``) by otel-swa's :class:`~otel_swa.views.sglang.KvCanaryHooks`
  with the SGLang log line as its sink, the one-line substitution ``docs/engines.md`` describes for
  users who wire otel-swa by hand.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import sglang_cpu_patches

#: Called after every forward step of the target model with ``(model_runner, forward_batch, step,
#: line)`` (``line``: the probe's JSON line of that step, which a callback may add keys to): the
#: fault injections of ``sglang_faults`` use it.
_AFTER_FORWARD: list = []
#: Called with ``(model_runner, forward_batch, step)`` right before the forward step ``step`` of the
#: target model (inside otel-swa's wrapper of ``ModelRunner.forward``, before SGLang's own code).
_BEFORE_FORWARD: list = []
#: Called with ``(forward_batch, step)`` when SGLang builds the ``ForwardBatch`` of forward step
#: ``step`` (``ForwardBatch.init_new``, before any ``ModelRunner.forward`` wrapper runs).
_ON_FORWARD_BATCH: list = []
#: Called with ``(scheduler, batch, step)`` before SGLang processes the result of the batch whose
#: last forward step was ``step`` (``Scheduler.process_batch_result``: before finished requests
#: free their KV).
_BEFORE_RESULT: list = []
_STATE = {"step": 0, "batch": None}


def after_forward(callback) -> None:
    """Call ``callback(model_runner, forward_batch, step, line)`` after each forward step."""
    _AFTER_FORWARD.append(callback)


def before_forward(callback) -> None:
    """Call ``callback(model_runner, forward_batch, step)`` before each forward step."""
    _BEFORE_FORWARD.append(callback)


def on_forward_batch(callback) -> None:
    """Call ``callback(forward_batch, step)`` when the ``ForwardBatch`` of forward step ``step`` is built."""
    _ON_FORWARD_BATCH.append(callback)


def before_result(callback) -> None:
    """Call ``callback(scheduler, batch, step)`` before each ``Scheduler.process_batch_result``."""
    _BEFORE_RESULT.append(callback)


def current_batch():
    """The ``ScheduleBatch`` being run (inside ``Scheduler.run_batch``), else ``None``."""
    return _STATE["batch"]


def current_step() -> int:
    """Forward steps of the target model run so far in this process."""
    return _STATE["step"]


_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
_SCHEDULER = "sglang.srt.managers.scheduler"
_CANARY_MANAGER = "sglang.srt.kv_canary.runner.canary_manager"
_FORWARD_BATCH_INFO = "sglang.srt.model_executor.forward_batch_info"


#: ``(module, class ("": a module function), method)`` of every method otel-swa's SGLang instrumentor
#: wraps (its ``WRAPPED`` and ``stop_paths.WRAPPED``; a suite test keeps the two equal), spelled out
#: here so that the probe never imports the instrumentor itself.
INSTRUMENTED = (
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward"),
    ("sglang.srt.kv_canary.runner.canary_manager", "CanaryManager", "__init__"),
    ("sglang.srt.kv_canary.runner.canary_manager", "CanaryManager", "pre_ops_maybe_inside_graph"),
    ("sglang.srt.managers.scheduler", "Scheduler", "run_batch"),
    ("sglang.srt.entrypoints.engine", "Engine", "shutdown"),
    ("sglang.srt.layers.radix_attention", "RadixAttention", "forward"),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "init_cuda_graphs"),
    ("sglang.srt.utils.common", "", "kill_process_tree"),
    ("sglang.srt.entrypoints.http_server", "", "_setup_and_run_http_server"),
)
#: Where otel-swa's code lives (its wrappers copy the wrapped function's name and module, not its code).
_OUR_CODE = (os.sep + os.path.join("opentelemetry", "instrumentation", "swa_"), os.sep + "otel_swa" + os.sep)
_HOOK_REGISTRY_CODE = os.path.join("sglang", "srt", "plugins", "hook_registry.py")


def _has_our_code(function, depth: int = 6) -> bool:
    """Whether ``function``, or a function it wraps (``__wrapped__``; the hook a HookRegistry wrapper
    calls, from its closure), is otel-swa's code."""
    stack, seen = [(function, 0)], set()
    while stack:
        item, level = stack.pop()
        if item is None or id(item) in seen or level > depth:
            continue
        seen.add(id(item))
        code = getattr(item, "__code__", None)
        if code is not None and any(part in code.co_filename for part in _OUR_CODE):
            return True
        stack.append((getattr(item, "__wrapped__", None), level + 1))
        if code is None or not code.co_filename.endswith(_HOOK_REGISTRY_CODE):
            continue  # another wrapper's closure (this probe's own) holds what it calls, not what it wraps
        for cell in getattr(item, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if callable(value):
                stack.append((value, level + 1))
    return False


def otel_swa_wrappers() -> dict:
    """How each method of :data:`INSTRUMENTED` whose module this process imported is wrapped by
    otel-swa: ``"hook_registry"`` (SGLang's HookRegistry wrapper around otel-swa's hook), ``"direct"``
    (otel-swa's wrapper set by the instrumentor itself); unwrapped methods are left out. Also
    ``"Scheduler.otel_swa_flush": "added"`` when the instrumentor added its flush method."""
    found = {}
    for module_name, class_name, method in INSTRUMENTED:
        module = sys.modules.get(module_name)
        owner = getattr(module, class_name, None) if class_name else module
        function = getattr(owner, "__dict__", {}).get(method) if owner is not None else None
        if function is None or not _has_our_code(function):
            continue
        code = getattr(function, "__code__", None)
        how = "hook_registry" if code is not None and code.co_filename.endswith(_HOOK_REGISTRY_CODE) else "direct"
        found[f"{class_name or module_name.rsplit('.', 1)[-1]}.{method}"] = how
    scheduler = getattr(sys.modules.get("sglang.srt.managers.scheduler"), "Scheduler", None)
    if scheduler is not None and "otel_swa_flush" in scheduler.__dict__:
        found["Scheduler.otel_swa_flush"] = "added"
    return found


def otel_swa_process() -> dict:
    """What otel-swa did in this process (see the module docstring): its wrappers, whether its
    SGLang instrumentor's module is imported, and the otel-swa reporters alive."""
    reporters = 0
    reporter_module = sys.modules.get("otel_swa.reporter")
    if reporter_module is not None:
        reporters = sum(1 for o in gc.get_objects() if isinstance(o, reporter_module.SwaDivergenceReporter))
    return {"pid": os.getpid(), "wrappers": otel_swa_wrappers(), "reporters": reporters,
            "instrumentor_imported": "opentelemetry.instrumentation.swa_sglang" in sys.modules}


def recount(mapping: list[int], req_to_token, rows: list[int], seq_lens: list[int]) -> tuple[int, int, int]:
    """``(divergent, out_of_window, live)`` over the live tokens of the batch, in plain Python."""
    divergent = out_of_window = live = 0
    for row, length in zip(rows, seq_lens):
        for full in req_to_token[row][:length]:
            swa = mapping[full]
            live += 1
            if swa == 0:
                out_of_window += 1
            elif swa != full:
                divergent += 1
    return divergent, out_of_window, live


def window_recount(mapping: list[int], req_to_token, rows: list[int], seq_lens: list[int], sliding_window_size: int,
                   queries: list[int]) -> tuple[int, int]:
    """``(premature, held_past_window)`` over the live tokens of the batch, in plain Python: the
    positions the step's queries read (the last ``queries[i]`` positions, each reading itself and
    the ``sliding_window_size`` before it) without an SWA slot, those before them with one."""
    premature = held = 0
    for row, length, count in zip(rows, seq_lens, queries):
        read = set()
        for query in range(max(0, length - count), length):
            read.update(range(max(0, query - sliding_window_size), query + 1))
        for pos, full in enumerate(req_to_token[row][:length]):
            if pos in read:
                premature += mapping[full] == 0
            elif pos < min(read, default=length):
                held += mapping[full] != 0
    return premature, held


def last_window_remapped(mapping: list[int], req_to_token, rows: list[int], seq_lens: list[int],
                         sliding_window_size: int) -> int:
    """Tokens in the window of each request's last token (positions ``seq_len - 1 -
    sliding_window_size .. seq_len - 1``, what the read check recomputes) whose SWA slot is non-zero
    and differs from the FULL slot: where a read at the raw FULL slots reads other KV."""
    remapped = 0
    for row, length in zip(rows, seq_lens):
        for pos in range(max(0, length - 1 - sliding_window_size), length):
            full = req_to_token[row][pos]
            remapped += mapping[full] not in (0, full)
    return remapped


def step_queries(forward_batch, batch: int) -> list[int]:
    """The queries of each request in this forward step: ``extend_seq_lens_cpu`` in an extend or
    mixed batch (``forward_mode.is_extend()``), else 1."""
    extend = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if forward_batch.forward_mode.is_extend() and extend is not None and len(extend) == batch:
        return [max(1, int(n)) for n in extend]
    return [1] * batch


def _patch_model_runner(module) -> None:
    out_dir = os.environ["OTEL_SWA_TEST_SGLANG_PROBE"]
    leak_at = int(os.environ.get("OTEL_SWA_TEST_SGLANG_LEAK_AT_STEP", "0") or 0)
    runner_class = module.ModelRunner
    original = runner_class.forward
    state = _STATE

    def forward(self, forward_batch, *args, **kwargs):
        draft = getattr(self, "is_draft_worker", False)
        if not draft:
            for callback in _BEFORE_FORWARD:
                callback(self, forward_batch, state["step"] + 1)
        output = original(self, forward_batch, *args, **kwargs)
        if draft:
            return output
        state["step"] += 1
        if state["step"] == 1:
            with open(os.path.join(out_dir, f"process-{os.getpid()}.json"), "w") as out:
                json.dump({"role": "scheduler", **otel_swa_process()}, out)
        allocator = self.token_to_kv_pool_allocator
        line = {"pid": os.getpid(), "step": state["step"]}
        mapping = getattr(allocator, "full_to_swa_index_mapping", None)
        if mapping is not None and forward_batch.req_pool_indices is not None:
            rows = forward_batch.req_pool_indices.tolist()
            lengths = forward_batch.seq_lens.tolist()
            table = self.req_to_token_pool.req_to_token[rows].tolist() if rows else []
            divergent, out_of_window, live = recount(mapping.tolist(), {r: t for r, t in zip(rows, table)}, rows, lengths)
            line.update(divergence=divergent, out_of_window=out_of_window, live_tokens=live)
            sliding_window_size = int(getattr(self, "sliding_window_size", None) or 0)
            if sliding_window_size > 0:
                tables = {r: t for r, t in zip(rows, table)}
                queries = step_queries(forward_batch, len(rows))
                premature, held = window_recount(mapping.tolist(), tables, rows, lengths, sliding_window_size, queries)
                line.update(premature=premature, held_past_window=held, queries=queries, seq_lens=lengths)
                line["last_window_remapped"] = last_window_remapped(mapping.tolist(), tables, rows, lengths,
                                                                    sliding_window_size)
        if leak_at and state["step"] == leak_at:
            swa = allocator.swa_attn_allocator
            line["leaked_page"] = int(swa.free_pages[0])
            swa.free_pages = swa.free_pages[1:]
        for callback in _AFTER_FORWARD:
            callback(self, forward_batch, state["step"], line)
        with open(os.path.join(out_dir, f"probe-{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(line) + "\n")
        return output

    forward.__wrapped__ = original
    runner_class.forward = forward


def sglang_pool_figures(scheduler) -> dict:
    """SGLang's own pool statistics of ``scheduler`` now, as ``{pool: [used, available, evictable, capacity]}``."""
    stats = scheduler.pool_stats_observer.get_pool_stats()
    figures = {"full": [stats.full_num_used, stats.full_available_size, stats.full_evictable_size, stats.full_capacity]}
    if stats.is_hybrid_swa:
        figures["swa"] = [stats.swa_num_used, stats.swa_available_size, stats.swa_evictable_size, stats.swa_capacity]
    return figures


def _patch_scheduler(module) -> None:
    from otel_swa.views.sglang import scheduler_pool_usage

    out_dir = os.environ["OTEL_SWA_TEST_SGLANG_PROBE"]
    scheduler_class = module.Scheduler
    run_batch, handle_rpc_request = scheduler_class.run_batch, scheduler_class.handle_rpc_request

    def write(line: dict) -> None:
        with open(os.path.join(out_dir, f"pools-{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps({"pid": os.getpid(), **line}) + "\n")

    def probed_run_batch(self, batch, *args, **kwargs):
        _STATE["batch"] = batch
        try:
            result = run_batch(self, batch, *args, **kwargs)
        finally:
            _STATE["batch"] = None
        try:
            ours = {u.pool: [u.used, u.available, u.evictable, u.total] for u in scheduler_pool_usage(self)}
            write({"at": "run_batch", "sglang": sglang_pool_figures(self), "ours": ours})
        except Exception as exc:  # the test reads the error; the engine goes on
            write({"at": "run_batch", "error": repr(exc)})
        return result

    def probed_handle_rpc_request(self, recv_req, *args, **kwargs):
        if getattr(recv_req, "method", None) == "otel_swa_flush":
            try:
                write({"at": "flush", "sglang": sglang_pool_figures(self)})
            except Exception as exc:
                write({"at": "flush", "error": repr(exc)})
        return handle_rpc_request(self, recv_req, *args, **kwargs)

    process_batch_result = scheduler_class.process_batch_result

    def probed_process_batch_result(self, batch, *args, **kwargs):
        for callback in _BEFORE_RESULT:
            callback(self, batch, _STATE["step"])
        return process_batch_result(self, batch, *args, **kwargs)

    probed_run_batch.__wrapped__ = run_batch
    probed_handle_rpc_request.__wrapped__ = handle_rpc_request
    probed_process_batch_result.__wrapped__ = process_batch_result
    scheduler_class.run_batch = probed_run_batch
    scheduler_class.handle_rpc_request = probed_handle_rpc_request
    scheduler_class.process_batch_result = probed_process_batch_result


def _patch_forward_batch_info(module) -> None:
    forward_batch_class = module.ForwardBatch
    init_new = forward_batch_class.init_new.__func__

    def probed_init_new(cls, *args, **kwargs):
        forward_batch = init_new(cls, *args, **kwargs)
        for callback in _ON_FORWARD_BATCH:
            callback(forward_batch, _STATE["step"] + 1)
        return forward_batch

    probed_init_new.__wrapped__ = init_new
    forward_batch_class.init_new = classmethod(probed_init_new)


def _patch_canary_manager(module) -> None:
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views.sglang import KvCanaryHooks, log_line_sink

    def reporter_by_hand(*, device, d2h_stream, interval, swa_allocator=None, req_to_token_pool=None):
        reporter = SwaDivergenceReporter(interval, device=device, sinks=[log_line_sink()], verify_source="kv_canary")
        return KvCanaryHooks(reporter, swa_allocator=swa_allocator, req_to_token_pool=req_to_token_pool)

    module.SwaDivergenceReporter = reporter_by_hand


def install() -> None:
    sglang_cpu_patches.add_patch(_MODEL_RUNNER, _patch_model_runner)
    sglang_cpu_patches.add_patch(_SCHEDULER, _patch_scheduler)
    sglang_cpu_patches.add_patch(_FORWARD_BATCH_INFO, _patch_forward_batch_info)
    if os.environ.get("OTEL_SWA_TEST_SGLANG_BY_HAND") == "1":
        sglang_cpu_patches.add_patch(_CANARY_MANAGER, _patch_canary_manager)
