"""The ways an SGLang server or engine stops, and the flush otel-swa asks for before each one.

Read in sglang 0.5.23. The model runs in scheduler processes (one per tensor / pipeline parallel
rank, titled ``sglang::scheduler...``) that the main process spawned; otel-swa's reporters and the
OpenTelemetry SDK's buffers live there. A scheduler that leaves its event loop and exits normally
runs the interpreter's exit hooks (:mod:`otel_swa.lifecycle` delivers the pending samples, then the
SDK's providers export and shut down). A scheduler killed with SIGKILL runs nothing, and that is how
SGLang's main process ends them: ``kill_process_tree`` (``sglang.srt.utils.common``) SIGKILLs every
child. What reaches the schedulers first, per way of stopping:

================================================  =========================================  ==============================
stop                                              SGLang's main process                      flush
================================================  =========================================  ==============================
``Engine.shutdown()`` (also at exit, ``with``)    ``kill_process_tree`` of its children      the ``Engine.shutdown`` wrapper: RPC
                                                                                              over the engine's ``send_to_rpc``
``launch_server``: ``kill -INT``, Ctrl-C with     uvicorn's handler stops the HTTP server;   the ``kill_process_tree`` wrapper:
the engine processes ignoring SIGINT (a           ``launch_server.py``'s ``finally:``        RPC over a socket bound at the
shell's background job), the end of serving       ``kill_process_tree(include_parent=False)``  server's ``rpc_ipc_name``
a child's failure (SIGQUIT to the main process)   ``kill_process_tree(os.getpid())``          the same
``launch_server``: ``kill -TERM``                 the tokenizer manager's handler sends       the schedulers' own exit; the
                                                  ``ShutdownReq``: the schedulers leave       wrapper finds none alive and
                                                  their loop and exit; then                  does not wait
                                                  ``kill_process_tree``
Ctrl-C to the whole process group                 as ``kill -INT`` (``Engine``: its          the schedulers' own exit
                                                  ``shutdown`` at interpreter exit)          (KeyboardInterrupt ends them):
                                                                                              each flushes, and rank 0 answers
                                                                                              the main process's request if it
                                                                                              came (:func:`answer_pending_flush`);
                                                                                              else the wait is for their end
SIGKILL from outside, ``kill_process_tree``       nothing runs                               none: what is lost is bounded by
from a supervisor                                                                            the export schedules
                                                                                              (:mod:`otel_swa.telemetry.export_schedule`)
================================================  =========================================  ==============================

The flush is SGLang's own RPC: ``RpcReqInput(method="otel_swa_flush")`` reaches rank 0's scheduler,
whose event loop hands it, between two batches, to ``Scheduler.handle_rpc_request`` (every rank
runs it; the answer comes back once all have), which calls the method the instrumentor added
(:func:`flush_rpc`). :func:`flush_schedulers` waits for that answer only while a scheduler of the
tree to be killed is alive, and never longer than the OTLP timeout
(:func:`otel_swa.config.otlp_timeout_s`): a scheduler that is already exiting flushes at its own
exit and answers from there, and one that is gone has nothing left to flush, so a stop never waits
for processes that cannot answer (``Engine.shutdown`` used to wait its whole 10 s for schedulers
that Ctrl-C had already ended).

Wrapped here (the instrumentor's ``more_wrapped``), in the main process:

``sglang.srt.utils.common.kill_process_tree(parent_pid, include_parent=True, ...)``
    flushes the schedulers among the processes it is about to kill, when the process runs an HTTP
    server (below) and they are auto-instrumented. The function is replaced in
    ``sglang.srt.utils.common`` right after that module's import, before ``sglang.srt.utils`` and the
    modules that import it by name (``launch_server.py``, ``engine.py``, the tokenizer manager) copy
    it, and in every ``sglang`` module already loaded that holds it.
``sglang.srt.entrypoints.http_server._setup_and_run_http_server(server_args, tokenizer_manager,
template_manager, port_args, ...)``
    remembers ``port_args.rpc_ipc_name`` of the server it runs. SGLang's HTTP server binds no socket
    there (only ``sglang.Engine`` does), so the flush binds one (a ZeroMQ DEALER, as ``Engine`` does)
    for the time of the flush. Without an HTTP server (an ``Engine``), the ``Engine.shutdown``
    wrapper is the one that flushes and ``kill_process_tree`` is left as it is.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

__all__ = [
    "alive",
    "WRAPPED",
    "wrappers",
    "FLUSH_RPC_METHOD",
    "flush_rpc",
    "scheduler_processes",
    "flush_schedulers",
    "flush_engine_schedulers",
    "flush_before_kill",
    "remember_scheduler",
    "answer_pending_flush",
    "note_children_instrumented",
]

_log = logging.getLogger("opentelemetry.instrumentation.swa_sglang")

#: The ``Scheduler`` method the instrumentor adds, which the main process calls on every scheduler
#: over SGLang's RPC (``RpcReqInput(method=...)``, ``Scheduler.handle_rpc_request``) before SGLang
#: kills them: it delivers the pending samples and exports the telemetry buffers.
FLUSH_RPC_METHOD = "otel_swa_flush"

#: SGLang's process title of its scheduler processes (``setproctitle``), as
#: ``sglang.srt.utils.cudacore_pyspy_dump_utils.collect_scheduler_processes`` finds them.
SCHEDULER_TITLE = "sglang::scheduler"

_KILL_MODULE = "sglang.srt.utils.common"
_HTTP_MODULE = "sglang.srt.entrypoints.http_server"

#: (module, class ("": the module itself), function, parameters relied on), as in sglang 0.5.23.
WRAPPED = (
    (_KILL_MODULE, "", "kill_process_tree", ("parent_pid", "include_parent")),
    (_HTTP_MODULE, "", "_setup_and_run_http_server", ("port_args",)),
)

#: The HTTP server this process runs: ``rpc_ipc_name`` of its schedulers (set by the wrapper of
#: ``_setup_and_run_http_server``), else ``None``.
_server: dict[str, Any] = {"rpc_ipc_name": None}
_flush_lock = threading.Lock()


# ---------------------------------------------------------------------- scheduler side
def flush_rpc(scheduler: Any) -> None:
    """Added to SGLang's ``Scheduler`` as :data:`FLUSH_RPC_METHOD`: deliver and export everything
    otel-swa holds in this scheduler process within the OTLP timeout (run by
    ``Scheduler.handle_rpc_request``, on the scheduler's thread, between two batches)."""
    from otel_swa import lifecycle

    result = lifecycle.flush_all()
    if result.failed:
        _log.warning("otel-swa flush before shutdown: %d telemetry provider(s) did not export in time", result.failed)


#: ``RpcReqOutput.message`` of the answer a scheduler gives at its own exit (below), with its pid.
EXIT_ANSWER = "otel-swa flushed at exit, pid "

_scheduler: dict[str, Any] = {"ref": None}


def remember_scheduler(scheduler: Any) -> None:
    """Called at the scheduler's first batch: at this process's exit, answer a flush request the main
    process has sent meanwhile (:func:`answer_pending_flush`)."""
    from otel_swa import lifecycle

    try:
        _scheduler["ref"] = weakref.ref(scheduler)
    except TypeError:
        return
    lifecycle.after_exit_flush(answer_pending_flush)


#: How long a scheduler that leaves its loop on its own (Ctrl-C, an error) waits at its exit for
#: the main process's flush request (seconds); SGLang's own shutdown (``ShutdownReq``) waits nothing.
EXIT_REQUEST_WAIT_S = 0.5


def answer_pending_flush(wait_s: float = EXIT_REQUEST_WAIT_S) -> "str | None":
    """At a scheduler's exit (KeyboardInterrupt on Ctrl-C, an error, the end of its loop), after
    otel-swa's flush of its reporters: if the main process's flush request is waiting on rank 0's
    RPC socket (sent while this scheduler was leaving its event loop, which never reads it now), or
    comes within ``wait_s`` while the main process lives, export the telemetry
    (:func:`otel_swa.lifecycle.flush_all`) and answer it. The main process then goes on with its
    stop at once instead of waiting for this process to end (the interpreter's own finalization
    takes seconds, and SGLang then SIGKILLs it anyway). After SGLang's own ``ShutdownReq``
    (``scheduler.gracefully_exit``) nothing is waited for: SGLang's main process waits for the exit
    itself. Without a request the SDK's own exit hooks export as usual. Returns what was done."""
    scheduler = _scheduler["ref"]() if _scheduler["ref"] is not None else None
    sock = getattr(getattr(scheduler, "ipc_channels", None), "recv_from_rpc", None)
    if sock is None:
        return None
    import zmq
    from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send

    from otel_swa import lifecycle

    if getattr(scheduler, "gracefully_exit", False):
        wait_s = 0.0
    deadline = time.monotonic() + wait_s
    parent = os.getppid()
    while not sock.poll(20, zmq.POLLIN):
        if time.monotonic() >= deadline or os.getppid() != parent:
            return None
    request = sock_recv(sock, zmq.NOBLOCK)  # an exiting scheduler answers no other request either
    if getattr(request, "method", None) != FLUSH_RPC_METHOD:
        return "dropped"
    result = lifecycle.flush_all()
    sock_send(sock, RpcReqOutput(success=result.failed == 0, message=f"{EXIT_ANSWER}{os.getpid()}"), zmq.NOBLOCK)
    return "answered"


# ---------------------------------------------------------------------- main process
#: Set by otel-swa's SGLang plugin when it instrumented this process (:func:`note_children_instrumented`).
_plugin = {"children": False}


def note_children_instrumented() -> None:
    """Called by otel-swa's SGLang plugin when it instruments this process: SGLang's processes
    started from here load the plugin too (``load_plugins()`` in every scheduler, with the same
    environment: the switch and ``SGLANG_PLUGINS``), so their schedulers have otel-swa's flush."""
    _plugin["children"] = True


def children_auto_instrumented() -> bool:
    """Whether processes started from here load the instrumentors too: ``opentelemetry-instrument``
    puts its ``sitecustomize`` directory on ``PYTHONPATH``, which SGLang's spawned schedulers
    inherit; or otel-swa's SGLang plugin instrumented this process (:func:`note_children_instrumented`)."""
    if _plugin["children"]:
        return True
    try:
        from opentelemetry.instrumentation import auto_instrumentation
    except ImportError:
        return False
    directory = os.path.dirname(os.path.abspath(auto_instrumentation.__file__))
    return directory in [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def alive(processes: list) -> list:
    """Those of ``processes`` (``psutil.Process``) still running and not zombies."""
    import psutil

    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.Error:
            pass
    return running


def scheduler_processes(root_pid: "int | None" = None, include_root: bool = False) -> list:
    """The live SGLang scheduler processes (``psutil.Process``) among the descendants of ``root_pid``
    (default: this process) and, with ``include_root``, ``root_pid`` itself: those titled
    :data:`SCHEDULER_TITLE` (sglang 0.5.23's scheduler sets it with ``setproctitle``, a dependency
    it imports unconditionally). A zombie (ended, not yet reaped) is not alive."""
    import psutil

    try:
        root = psutil.Process(root_pid if root_pid is not None else os.getpid())
        tree = ([root] if include_root else []) + root.children(recursive=True)
    except psutil.Error:
        return []
    schedulers = []
    for process in alive(tree):
        try:
            if " ".join(process.cmdline()).startswith(SCHEDULER_TITLE):
                schedulers.append(process)
        except psutil.Error:
            pass
    return schedulers


def flush_schedulers(sock: Any, schedulers: list, timeout_s: float) -> str:
    """Send :data:`FLUSH_RPC_METHOD` over ``sock`` (a ZeroMQ socket whose peer is rank 0's
    scheduler) and wait for the answer while one of ``schedulers`` is alive, at most ``timeout_s``
    seconds in all. Returns ``"flushed"``, ``"failed"`` (the answer says so), ``"exited"`` (every
    scheduler ended first: they flushed at their own exit, or cannot anymore) or ``"timeout"``."""
    import zmq
    from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

    deadline = time.monotonic() + timeout_s
    slice_ms = 50
    sent = False
    exit_answer: "bool | None" = None  # rank 0's answer from its exit, while the others still run
    while time.monotonic() < deadline:
        if not alive(schedulers):
            if exit_answer is None:
                return "exited"
            return "flushed at exit" if exit_answer else "failed"
        if not sent:
            # a bound socket has no peer until the scheduler's DEALER reconnects (about 100 ms)
            if sock.poll(slice_ms, zmq.POLLOUT):
                sock_send(sock, RpcReqInput(method=FLUSH_RPC_METHOD), flags=zmq.NOBLOCK)
                sent = True
            continue
        if sock.poll(slice_ms, zmq.POLLIN):
            reply = sock_recv(sock)
            message = str(getattr(reply, "message", "") or "")
            if message.startswith(EXIT_ANSWER):
                # rank 0 answered from its exit: its own flush is done; the other ranks flush at
                # their own exit, which is waited for
                answered = int(message[len(EXIT_ANSWER):])
                schedulers = [p for p in schedulers if p.pid != answered]
                exit_answer = bool(getattr(reply, "success", False))
                continue
            if getattr(reply, "success", False):
                return "flushed"
            _log.warning("otel-swa flush in SGLang's schedulers failed: %s", message or reply)
            return "failed"
    _log.warning("SGLang's schedulers did not confirm otel-swa's flush within %.1f s (the OTLP timeout); "
                 "stopping anyway", timeout_s)
    return "timeout"


def flush_engine_schedulers(engine: Any, timeout_s: "float | None" = None) -> "str | None":
    """Before ``Engine.shutdown`` SIGKILLs the scheduler processes, :func:`flush_schedulers` over the
    engine's own RPC socket (``engine.send_to_rpc``). Only when the engine owns its schedulers (not
    an attached engine), they are auto-instrumented (:func:`children_auto_instrumented`) and some
    are alive; returns the outcome, or ``None`` when nothing was asked."""
    from otel_swa import config

    sock = getattr(engine, "send_to_rpc", None)
    if sock is None or getattr(engine, "_attached", False) or not children_auto_instrumented():
        return None
    schedulers = scheduler_processes()
    if not schedulers:
        return None
    with _flush_lock:
        return flush_schedulers(sock, schedulers, config.otlp_timeout_s() if timeout_s is None else timeout_s)


def flush_before_kill(parent_pid: "int | None", include_parent: bool, timeout_s: "float | None" = None) -> "str | None":
    """What the ``kill_process_tree`` wrapper does first: in a process running SGLang's HTTP server,
    :func:`flush_schedulers` for the live schedulers among the processes about to be killed, over a
    DEALER socket bound at the server's ``rpc_ipc_name`` for the time of the flush. Returns the
    outcome, or ``None`` when nothing was asked (no HTTP server here, no live scheduler in that tree,
    schedulers not auto-instrumented)."""
    rpc_ipc_name = _server["rpc_ipc_name"]
    if rpc_ipc_name is None or not children_auto_instrumented():
        return None
    schedulers = scheduler_processes(parent_pid, include_root=include_parent)
    if not schedulers:
        return None
    import zmq
    from sglang.srt.utils.network import get_zmq_socket

    from otel_swa import config

    with _flush_lock:
        context = zmq.Context(1)
        try:
            sock = get_zmq_socket(context, zmq.DEALER, rpc_ipc_name, True)
            try:
                return flush_schedulers(sock, schedulers, config.otlp_timeout_s() if timeout_s is None else timeout_s)
            finally:
                sock.close(linger=0)
        finally:
            context.term()


# ---------------------------------------------------------------------- wrappers
def _wrap_kill_process_tree(original: Callable) -> Callable:
    @functools.wraps(original)
    def kill_process_tree(parent_pid, include_parent: bool = True, *args, **kwargs):
        try:
            pid = os.getpid() if parent_pid is None else parent_pid
            outcome = flush_before_kill(pid, include_parent if parent_pid is not None else False)
            if outcome is not None:
                _log.debug("otel-swa flush before kill_process_tree(%s): %s", parent_pid, outcome)
        except Exception:  # SGLang's kill always goes on
            _log.exception("asking SGLang's schedulers to flush otel-swa's telemetry failed")
        return original(parent_pid, include_parent, *args, **kwargs)

    return kill_process_tree


def _wrap_setup_and_run_http_server(original: Callable) -> Callable:
    @functools.wraps(original)
    def _setup_and_run_http_server(server_args, tokenizer_manager, template_manager, port_args, *args, **kwargs):
        try:
            _server["rpc_ipc_name"] = getattr(port_args, "rpc_ipc_name", None)
        except Exception:
            pass
        return original(server_args, tokenizer_manager, template_manager, port_args, *args, **kwargs)

    return _setup_and_run_http_server


def wrappers() -> tuple:
    """One function per entry of :data:`WRAPPED`: original -> wrapper."""
    return (_wrap_kill_process_tree, _wrap_setup_and_run_http_server)

