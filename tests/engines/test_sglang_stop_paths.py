"""The stop paths of sglang 0.5.23 and the flush otel-swa asks for before them, without an engine
(marker ``sglang``): where the instrumentor wraps them, which processes it waits for, and what it
does when a scheduler answers, is already exiting, or hangs. The whole server, stopped every way,
is in ``test_sglang_server.py``.

The flush is SGLang's own RPC (``RpcReqInput`` / ``RpcReqOutput`` through ``sock_send`` /
``sock_recv``) over real ZeroMQ sockets; the "schedulers" are real child processes, titled as
SGLang titles its own (``setproctitle``), whose liveness is what the wait watches.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

pytestmark = pytest.mark.sglang


def _child(title: str, seconds: float = 60.0) -> subprocess.Popen:
    code = f"import setproctitle, time; setproctitle.setproctitle({title!r}); print('up', flush=True); time.sleep({seconds})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


@pytest.fixture
def children():
    made: list[subprocess.Popen] = []

    def start(title: str, seconds: float = 60.0) -> subprocess.Popen:
        made.append(_child(title, seconds))
        return made[-1]

    yield start
    for proc in made:
        proc.kill()
        proc.wait()


def test_only_live_scheduler_processes_are_waited_for(sglang_modules, children):
    from opentelemetry.instrumentation.swa_sglang.stop_paths import scheduler_processes

    scheduler = children("sglang::scheduler_TP0")
    children("sglang::detokenizer")
    assert [p.pid for p in scheduler_processes()] == [scheduler.pid]
    scheduler.kill()
    scheduler.wait()  # reaped: gone
    assert scheduler_processes() == []


def _answering_peer(endpoint: str, success: bool = True) -> threading.Thread:
    """rank 0's side of SGLang's RPC: a DEALER that connects (as the scheduler's does), reads one
    ``RpcReqInput`` and answers it."""
    import zmq
    from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send

    def serve():
        context = zmq.Context(1)
        sock = context.socket(zmq.DEALER)
        sock.connect(endpoint)
        request = sock_recv(sock)
        sock_send(sock, RpcReqOutput(success=success and request.method == "otel_swa_flush", message=""))
        sock.close(linger=1000)
        context.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _bound(endpoint: str):
    import zmq

    context = zmq.Context(1)
    sock = context.socket(zmq.DEALER)
    sock.bind(endpoint)
    return context, sock


@pytest.mark.parametrize("answer", ["flushed", "failed"])
def test_a_scheduler_that_answers_ends_the_wait(sglang_modules, children, answer):
    import psutil

    from opentelemetry.instrumentation.swa_sglang.stop_paths import flush_schedulers

    endpoint = f"ipc://{tempfile.mktemp(prefix='otel-swa-rpc-')}"
    context, sock = _bound(endpoint)
    try:
        peer = _answering_peer(endpoint, success=answer == "flushed")
        scheduler = psutil.Process(children("sglang::scheduler_TP0").pid)
        assert flush_schedulers(sock, [scheduler], timeout_s=30.0) == answer
        peer.join(5)
    finally:
        sock.close(linger=0)
        context.term()


def test_a_scheduler_that_exits_instead_of_answering_ends_the_wait_and_a_hung_one_the_timeout(sglang_modules, children):
    import psutil

    from opentelemetry.instrumentation.swa_sglang.stop_paths import flush_schedulers

    endpoint = f"ipc://{tempfile.mktemp(prefix='otel-swa-rpc-')}"
    context, sock = _bound(endpoint)
    import zmq

    silent = zmq.Context(1)
    peer = silent.socket(zmq.DEALER)
    peer.connect(endpoint)  # connected, reads nothing: a scheduler that left its event loop
    try:
        exiting = children("sglang::scheduler_TP0", seconds=0.5)
        assert flush_schedulers(sock, [psutil.Process(exiting.pid)], timeout_s=60.0) == "exited"
        hung = children("sglang::scheduler_TP0")
        assert flush_schedulers(sock, [psutil.Process(hung.pid)], timeout_s=0.3) == "timeout"
    finally:
        peer.close(linger=0)
        silent.term()
        sock.close(linger=0)
        context.term()


def test_the_kill_wrapper_binds_the_servers_rpc_address_and_reaches_a_scheduler_that_connected_first(
        sglang_modules, children, monkeypatch):
    from opentelemetry.instrumentation.swa_sglang import stop_paths

    endpoint = f"ipc://{tempfile.mktemp(prefix='otel-swa-rpc-')}"
    peer = _answering_peer(endpoint)  # the scheduler connects at start-up; nothing is bound yet
    scheduler = children("sglang::scheduler_TP0")
    monkeypatch.setitem(stop_paths._server, "rpc_ipc_name", endpoint)
    monkeypatch.setattr(stop_paths, "children_auto_instrumented", lambda: True)
    assert stop_paths.flush_before_kill(os.getpid(), include_parent=False, timeout_s=30.0) == "flushed"
    peer.join(5)
    assert not peer.is_alive() and scheduler.poll() is None  # killing is SGLang's part, after this
    # no HTTP server in this process: nothing is asked
    monkeypatch.setitem(stop_paths._server, "rpc_ipc_name", None)
    assert stop_paths.flush_before_kill(os.getpid(), include_parent=False) is None


CHECK_WRAPPERS = textwrap.dedent(
    """
    import json, sys
    import sglang.launch_server  # as `python -m sglang.launch_server` imports it, after sitecustomize
    from sglang.srt import utils
    from sglang.srt.entrypoints import engine, http_server
    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.utils import common
    from opentelemetry.instrumentation.swa_sglang import SwaSglangInstrumentor

    holders = {"sglang.srt.utils.common": common, "sglang.srt.utils": utils, "sglang.launch_server": sglang.launch_server,
               "sglang.srt.entrypoints.engine": engine, "sglang.srt.entrypoints.http_server": http_server,
               "sglang.srt.managers.tokenizer_manager": tokenizer_manager}
    original = common.kill_process_tree.__wrapped__
    wrapped = {name: module.kill_process_tree is not original and module.kill_process_tree.__wrapped__ is original
               for name, module in holders.items()}
    server_wrapped = hasattr(http_server._setup_and_run_http_server, "__wrapped__")
    SwaSglangInstrumentor().uninstrument()  # the loader's instance (BaseInstrumentor is a singleton)
    restored = {name: module.kill_process_tree is original for name, module in holders.items()}
    print(json.dumps({"wrapped": wrapped, "server_wrapped": server_wrapped, "restored": restored,
                      "restored_server": not hasattr(http_server._setup_and_run_http_server, "__wrapped__")}))
    """
)


def test_under_opentelemetry_instrument_every_caller_of_kill_process_tree_gets_the_wrapper(sglang_modules, tmp_path):
    import json

    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    if launcher is None:
        pytest.skip("opentelemetry-instrument is not installed here")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({"OTEL_SWA_DIVERGENCE_INTERVAL": "20", "SGLANG_USE_CPU_ENGINE": "1", "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"})
    script = tmp_path / "check.py"
    script.write_text(CHECK_WRAPPERS)
    run = subprocess.run([launcher, sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(found["wrapped"].values()) and found["server_wrapped"], found
    assert all(found["restored"].values()) and found["restored_server"], found


def test_an_absent_vllm_is_a_debug_message_where_sglang_is_instrumented(sglang_modules, monkeypatch, caplog):
    import importlib.util

    from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "20")
    instrumentor = SwaVllmInstrumentor()
    try:
        with caplog.at_level(logging.DEBUG, logger="opentelemetry.instrumentation.swa_vllm"):
            instrumentor.instrument(skip_dep_check=True)  # what opentelemetry-instrument calls
    finally:
        instrumentor.uninstrument()
    ours = [r for r in caplog.records if r.name == "opentelemetry.instrumentation.swa_vllm"]
    assert [r.levelno for r in ours] == [logging.DEBUG]
    assert "vllm is not installed" in ours[0].getMessage() and "swa_sglang is" in ours[0].getMessage()
    assert "OTEL_SWA_WARNED" not in os.environ or "swa_vllm" not in os.environ["OTEL_SWA_WARNED"]


def _rpc_pair():
    """The main process's bound DEALER and rank 0's connected one, as SGLang makes them."""
    import zmq

    endpoint = f"ipc://{tempfile.mktemp(prefix='otel-swa-rpc-')}"
    context = zmq.Context(1)
    main = context.socket(zmq.DEALER)
    main.bind(endpoint)
    scheduler = context.socket(zmq.DEALER)
    scheduler.connect(endpoint)
    return context, main, scheduler


@pytest.mark.parametrize("request_sent", [True, False])
def test_a_scheduler_answers_a_flush_request_left_pending_at_its_exit(sglang_modules, monkeypatch, request_sent):
    from types import SimpleNamespace

    import zmq
    from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

    from opentelemetry.instrumentation.swa_sglang import stop_paths

    context, main, scheduler_sock = _rpc_pair()
    scheduler = SimpleNamespace(ipc_channels=SimpleNamespace(recv_from_rpc=scheduler_sock), gracefully_exit=False)
    monkeypatch.setitem(stop_paths._scheduler, "ref", lambda: scheduler)
    try:
        if request_sent:  # the main process asked while the scheduler was leaving its loop
            sock_send(main, RpcReqInput(method="otel_swa_flush"))
            assert stop_paths.answer_pending_flush(wait_s=30.0) == "answered"
            assert main.poll(5000, zmq.POLLIN)
            reply = sock_recv(main)
            assert reply.success and reply.message == f"{stop_paths.EXIT_ANSWER}{os.getpid()}"
        else:  # nobody asks: the exit goes on after the wait
            assert stop_paths.answer_pending_flush(wait_s=0.2) is None
            scheduler.gracefully_exit = True  # after SGLang's ShutdownReq: no wait at all
            assert stop_paths.answer_pending_flush(wait_s=3600.0) is None
    finally:
        main.close(linger=0)
        scheduler_sock.close(linger=0)
        context.term()


def test_an_answer_from_rank_0s_exit_still_waits_for_the_other_ranks(sglang_modules, children):
    import psutil
    from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send

    from opentelemetry.instrumentation.swa_sglang import stop_paths

    context, main, scheduler_sock = _rpc_pair()
    rank0 = psutil.Process(children("sglang::scheduler_TP0").pid)
    rank1_proc = children("sglang::scheduler_TP1", seconds=1.0)
    rank1 = psutil.Process(rank1_proc.pid)

    def rank0_exits():
        sock_recv(scheduler_sock)
        sock_send(scheduler_sock, RpcReqOutput(success=True, message=f"{stop_paths.EXIT_ANSWER}{rank0.pid}"))

    thread = threading.Thread(target=rank0_exits, daemon=True)
    thread.start()
    try:
        # rank 1 flushes at its own exit, a second later: the wait goes on until it has ended
        assert stop_paths.flush_schedulers(main, [rank0, rank1], timeout_s=60.0) == "flushed at exit"
        assert rank1_proc.poll() is not None
    finally:
        thread.join(5)
        main.close(linger=0)
        scheduler_sock.close(linger=0)
        context.term()
