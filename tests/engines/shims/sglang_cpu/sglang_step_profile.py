"""Where otel-swa's time goes inside a real SGLang scheduler process, for the engine benchmark
(``benchmarks/bench_sglang_engine.py``; never for users).

Imported in every process of the engine suite's environment through the shims' ``.pth``
(``sglang_cpu_patches.install``) when ``OTEL_SWA_TEST_SGLANG_PROFILE`` names a directory. It wraps
the otel-swa functions the SGLang instrumentor runs at a forward step with counters of calls, wall
time (``time.perf_counter``) and CPU time of the calling thread (``time.thread_time``), and writes
them to ``profile-<pid>.json`` in that directory every 20 forward steps and at otel-swa's flush
RPC (``Engine.shutdown``), as ``{part: [calls, wall s, thread CPU s]}``. The parts nest (the
reporter's step holds the view, the sample and the hand-off): each is its own row, not a share of
a total. The delivery thread's parts are timed on that thread. The process's garbage collections
from its first forward step on are counted too (``gc.callbacks``, a part per generation), with or
without otel-swa: a full collection of a process holding SGLang and torch costs tenths of a second,
and when one falls inside a timed run it weighs more than any part above.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import time

import sglang_cpu_patches

_INSTRUMENTOR = "opentelemetry.instrumentation.swa_sglang"
#: (module, attribute path, part): what is timed. Methods are wrapped on their class, functions in the
#: module that calls them (scheduler_holder_full_slots: the instrumentor imports it from the facade).
PARTS = (
    (_INSTRUMENTOR, "SwaSglangInstrumentor._after_forward", "after the forward: observe + reporter step (all below)"),
    ("otel_swa.views.sglang_canary", "KvCanaryHooks._view", "view of the ScheduleBatch (batch_view)"),
    ("otel_swa.views.sglang", "scheduler_holder_full_slots", "holders (every request row and the radix tree)"),
    ("otel_swa.views.sglang_batch", "swa_free_page_lists", "SWA free lists"),
    ("otel_swa.reporter", "validate_view", "view validation"),
    ("otel_swa.reporter", "stage_sample", "device sample (counts, window, audit)"),
    ("otel_swa.reporter", "SwaDivergenceReporter._deliver", "record and hand-off to the sinks"),
    (_INSTRUMENTOR + ".attention", "_check_read", "read check, per sliding-window layer call"),
    (_INSTRUMENTOR + ".attention", "_stamp", "provenance stamps, per forward step (every step)"),
    (_INSTRUMENTOR + ".attention", "_after_layer", "provenance checksum + write check, per attention layer call"),
    ("otel_swa.device.provenance", "KvProvenance.stage", "provenance verification, per sample"),
    (_INSTRUMENTOR + ".model_runner", "_request_span_contexts", "request span contexts of the batch (links)"),
    ("otel_swa.telemetry.sink", "SwaTelemetrySink._deliver", "delivery thread: metrics + events, per record"),
    ("otel_swa.telemetry.events", "SampleEvents.emit", "delivery thread: Logs API event + span event"),
    ("otel_swa.telemetry.logline", "SwaLogLineExporter.export", "delivery thread: the line"),
)
_SPANS = ("otel_swa.telemetry.spans", "ForwardSpans.forward_span", "forward-step span (start + end)")

_TOTALS: dict[str, list] = {}
_THREADS: list = []  # [forward steps, thread_cpu()] at each write: the threads' CPU between two of them
_STATE = {"steps": 0}


def _count(part: str, wall: float, cpu: float) -> None:
    entry = _TOTALS.setdefault(part, [0, 0.0, 0.0])
    entry[0] += 1
    entry[1] += wall
    entry[2] += cpu


#: ``OTEL_SWA_TEST_SGLANG_PYPROFILE=1`` beside the directory: from the 10th forward step on (after
#: the driver's warm-up) the scheduler's thread runs under ``cProfile`` with its thread CPU time as
#: the clock, written to ``pyprofile-<pid>.prof`` in the directory with the totals (for ``pstats``,
#: with and without otel-swa): every function's own CPU time, torch's operations each a row under
#: the function that called them. Its own overhead inflates every row: read totals from a run
#: without it.
_PYPROFILE: list = []


def _timed(function, part: str):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            _count(part, time.perf_counter() - wall, time.thread_time() - cpu)

    return timed


def _timed_context(function, part: str):
    @functools.wraps(function)
    @contextlib.contextmanager
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        manager = function(*args, **kwargs)
        value = manager.__enter__()
        spent = [time.perf_counter() - wall, time.thread_time() - cpu]
        try:
            yield value
        except BaseException as exc:  # pragma: no cover - the forward raised
            if not manager.__exit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            wall, cpu = time.perf_counter(), time.thread_time()
            manager.__exit__(None, None, None)
            spent[0] += time.perf_counter() - wall
            spent[1] += time.thread_time() - cpu
        finally:
            _count(part, *spent)

    return timed


_GC_STARTED = [0.0, 0.0]


def _gc_callback(phase: str, info: dict) -> None:
    if not _STATE["steps"]:
        return  # start-up's collections are not the forward steps'
    if phase == "start":
        _GC_STARTED[:] = time.perf_counter(), time.thread_time()
    elif _GC_STARTED[0]:
        _count(f"garbage collection, generation {info['generation']}", time.perf_counter() - _GC_STARTED[0],
               time.thread_time() - _GC_STARTED[1])
        _GC_STARTED[0] = 0.0


def thread_cpu() -> dict:
    """CPU seconds (user + system) of every thread of this process so far, by name (Python's thread
    name where the thread is a Python one, else the kernel's ``comm``; equal names summed), from
    ``/proc/self/task/<tid>/stat``: which threads besides the scheduler's own spend the process's CPU
    (the delivery thread, the OpenTelemetry SDK's export threads, gRPC's pollers). Empty where
    ``/proc`` is not there."""
    import threading

    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    found: dict = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        name = names.get(int(task), comm)
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def write() -> None:
    out_dir = os.environ["OTEL_SWA_TEST_SGLANG_PROFILE"]
    with open(os.path.join(out_dir, f"profile-{os.getpid()}.json"), "w") as out:
        _THREADS.append([_STATE["steps"], thread_cpu()])
        json.dump({"steps": _STATE["steps"], "parts": _TOTALS, "threads": _THREADS}, out)
    for profile in _PYPROFILE:
        profile.disable()
        profile.dump_stats(os.path.join(out_dir, f"pyprofile-{os.getpid()}.prof"))
        profile.enable()


def _wrap(module, path: str, wrapper, part: str) -> None:
    owner_name, _, name = path.rpartition(".")
    owner = getattr(module, owner_name, None) if owner_name else module
    if owner is not None and hasattr(owner, name):  # (an older otel-swa may lack a part)
        setattr(owner, name, wrapper(getattr(owner, name), part))


def _patch(entries):
    def patch(module) -> None:
        for _, path, part in entries:
            _wrap(module, path, _timed_context if (path, part) == _SPANS[1:] else _timed, part)

    return patch


def _patch_model_runner(module) -> None:
    runner_class = module.ModelRunner
    original = runner_class.forward

    def forward(self, forward_batch, *args, **kwargs):  # innermost: counts the steps
        output = original(self, forward_batch, *args, **kwargs)
        if not getattr(self, "is_draft_worker", False):
            _STATE["steps"] += 1
            if _STATE["steps"] == 10 and os.environ.get("OTEL_SWA_TEST_SGLANG_PYPROFILE"):
                import cProfile

                _PYPROFILE.append(cProfile.Profile(time.thread_time))
                _PYPROFILE[0].enable()
            if _STATE["steps"] % 20 == 0:  # (the scheduler is killed at shutdown: no exit hook runs)
                write()
        return output

    forward.__wrapped__ = original
    runner_class.forward = forward


def _patch_scheduler(module) -> None:
    scheduler_class = module.Scheduler
    handle_rpc_request = scheduler_class.handle_rpc_request

    def profiled_handle_rpc_request(self, recv_req, *args, **kwargs):
        if getattr(recv_req, "method", None) == "otel_swa_flush":
            write()
        return handle_rpc_request(self, recv_req, *args, **kwargs)

    profiled_handle_rpc_request.__wrapped__ = handle_rpc_request
    scheduler_class.handle_rpc_request = profiled_handle_rpc_request


def install() -> None:
    modules: dict[str, list] = {}
    for entry in (*PARTS, _SPANS):
        modules.setdefault(entry[0], []).append(entry)
    for module_name, entries in modules.items():
        sglang_cpu_patches.add_patch(module_name, _patch(entries))
    sglang_cpu_patches.add_patch("sglang.srt.model_executor.model_runner", _patch_model_runner)
    sglang_cpu_patches.add_patch("sglang.srt.managers.scheduler", _patch_scheduler)
    gc.callbacks.append(_gc_callback)
