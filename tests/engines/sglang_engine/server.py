"""Run SGLang's HTTP server the way docs/engines.md tells a user to, send it requests, stop it one
way, and collect what it left: the server log, the scheduler-process probe's recount, the HTTP
responses and what a real collector received.

``run_server(...)`` starts ``opentelemetry-instrument python -m sglang.launch_server --model-path
...`` (or, ``launcher=False``, plain ``python -m sglang.launch_server``: otel-swa's SGLang plugin
loads through SGLang's own ``load_plugins()``) with the variables of docs/engines.md's block (``OTEL_SWA_DIVERGENCE_INTERVAL``,
``OTEL_{TRACES,METRICS}_EXPORTER=otlp``, ``OTEL_LOGS_EXPORTER=otlp,swa_logline``,
``OTEL_EXPORTER_OTLP_ENDPOINT``) pointing at a ``rotel-agent`` collector, plus the CPU engine's
(``SGLANG_USE_CPU_ENGINE=1`` and the arguments of :data:`CPU_ARGS`). When ``/health`` answers, it
sends requests from the Azure LLM inference trace 2023 (``drive_engine.traffic``), half to
``/generate`` (token ids) and half to ``/v1/completions`` (OpenAI's token-array prompt), every other
one with a W3C ``traceparent`` header, all at once so that SGLang batches them, then a few again
(prefix cache hits). Then it stops the server one of the ways of :data:`STOPS` and waits for every
process of the server to end.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from collector_support import RotelCollector, free_port

from engine_support import process_tree, wait_for_tree
from opentelemetry.instrumentation.swa_sglang.stop_paths import alive
from sglang_engine.harness import EngineRun, prepare_run, read_probe

#: How a run ends: name -> what a user (or their supervisor) does.
STOPS = {
    "sigterm": "kill -TERM <server pid> (a supervisor, a container runtime)",
    "sigint_group": "Ctrl-C in the terminal: SIGINT to the server's process group",
    "sigint_main": "kill -INT <server pid>",
    "sigint_children_ignore": "Ctrl-C to the process group of a server a script started in the background: SIGINT "
                              "ignored from the start (a shell's background job), so only the main process's HTTP "
                              "server handles it and the spawned engine processes keep ignoring it",
    "kill_process_tree": "sglang.srt.utils.kill_process_tree(<server pid>) from a supervisor (SIGKILL of every process)",
}

#: ``sglang.launch_server`` arguments of the CPU engine the suite runs (the tiny model of
#: ``build_model.py``: an 8-token window, a 160-token pool, at most 4 running requests).
CPU_ARGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--dtype", "float32", "--max-total-tokens", "160", "--mem-fraction-static", "0.05",
    "--max-running-requests", "4", "--chunked-prefill-size", "-1", "--page-size", "1", "--random-seed", "0",
)


@dataclass
class ServerRun(EngineRun):
    """What one server run left behind (``results``: the requests sent and their answers)."""

    stop: str = ""
    stop_s: float = 0.0  #: from the stop to the end of the server's last process
    returncode: "int | None" = None
    leftover: list = field(default_factory=list)  #: server processes still alive after the stop

    def sent(self) -> list[dict]:
        return self.results["requests"]


def _http(url: str, body: "dict | None" = None, headers: "dict | None" = None, timeout: float = 300.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, (json.loads(text) if text.strip().startswith(("{", "[")) else {"text": text})
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until ``GET /health`` answers 200 (SGLang answers it once its warm-up request is done)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if _http(base + "/health", timeout=5)[0] == 200:
                return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout_s} s")


def send_traffic(base: str, requests: int, repeat: int) -> list[dict]:
    """The requests (module docstring), concurrently; returns one dict per request with its endpoint,
    its ``traceparent`` (or ``None``), the tokens asked for and the tokens SGLang reports."""
    from sglang_engine.drive_engine import traffic

    prompts, outputs = traffic(requests)
    plan = [(i, wave) for wave, count in ((0, requests), (1, repeat)) for i in range(count)]
    sent: list[dict] = [{} for _ in plan]

    def one(slot: int, index: int, wave: int) -> None:
        prompt, tokens = prompts[index], outputs[index]
        traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01" if slot % 2 == 0 else None
        headers = {"traceparent": traceparent} if traceparent else {}
        if index % 2 == 0:
            endpoint = "/generate"
            body = {"input_ids": prompt,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}}
        else:
            endpoint = "/v1/completions"
            body = {"model": "default", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        try:
            status, answer = _http(base + endpoint, body, headers)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:  # the server was stopped meanwhile
            status, answer = 0, {"error": repr(exc)}
        if endpoint == "/generate":
            completion = answer.get("meta_info", {}).get("completion_tokens")
        else:
            completion = answer.get("usage", {}).get("completion_tokens")
        sent[slot] = {"endpoint": endpoint, "wave": wave, "traceparent": traceparent, "status": status,
                      "max_new_tokens": tokens, "completion_tokens": completion,
                      "error": answer.get("error") if status != 200 else None}

    for wave in (0, 1):
        threads = [threading.Thread(target=one, args=(slot, i, w)) for slot, (i, w) in enumerate(plan) if w == wave]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return sent


def stop_server(proc: subprocess.Popen, stop: str, timeout_s: float) -> tuple[float, float, list]:
    """Stop the server ``stop``'s way (:data:`STOPS`); returns the wall-clock time of the stop
    (``time.time()``), the seconds until every process of its tree had ended and those still alive
    then (killed afterwards)."""
    if stop == "kill_process_tree":
        from sglang.srt.utils import kill_process_tree  # imported before the clock starts (seconds)
    tree = process_tree(proc.pid)
    stop_time, start = time.time(), time.monotonic()
    if stop == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif stop in ("sigint_group", "sigint_children_ignore"):
        os.killpg(proc.pid, signal.SIGINT)
    elif stop == "sigint_main":
        proc.send_signal(signal.SIGINT)
    elif stop == "kill_process_tree":
        kill_process_tree(proc.pid, include_parent=True, wait_timeout=timeout_s)
    else:
        raise ValueError(f"stop={stop!r}; expected one of {sorted(STOPS)}")
    seconds, leftover = wait_for_tree(proc, tree, start, timeout_s)
    return stop_time, seconds, leftover


def _ignore_sigint() -> None:
    # what a non-interactive shell does for a command it starts with `&`
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def run_server(
    directory: Path,
    model: Path,
    agent: str,
    *,
    stop: str,
    env: dict,
    args: tuple = (),
    requests: int = 12,
    repeat: int = 4,
    idle_before_stop_s: float = 0.0,
    stop_during_traffic_s: "float | None" = None,
    ready_timeout_s: float = 300.0,
    stop_timeout_s: float = 90.0,
    launcher: bool = True,
) -> ServerRun:
    """One server run stopped ``stop``'s way. ``env``: variables on top of a clean environment (no
    inherited ``OTEL_*`` / ``SGLANG_*``) and of the docs' block; ``args``: more ``launch_server``
    arguments (``{otlp_grpc}`` is replaced by the collector's gRPC ``host:port``);
    ``idle_before_stop_s``: how long the server stays idle between the last answer and the stop;
    ``stop_during_traffic_s``: stop that many seconds after the requests were sent instead, while
    they are served (their answers then go missing: ``status`` 0). ``results["stop_time"]`` is the
    wall-clock time (``time.time()``) of the stop; ``launcher``: under ``opentelemetry-instrument``
    (default) or plain ``python``."""
    probe_dir, python = prepare_run(directory, launcher)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with RotelCollector(agent, directory, settle_s=1.0) as collector:
        grpc = f"127.0.0.1:{collector.grpc_port}"
        run_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
        run_env.update({
            # docs/engines.md, "Switch it on"
            "OTEL_SWA_DIVERGENCE_INTERVAL": "20",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_LOGS_EXPORTER": "otlp,swa_logline",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint("grpc"),
            # the CPU engine and the suite's probe
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            "OTEL_SWA_TEST_SGLANG_PROBE": str(probe_dir),
            "PYTHONUNBUFFERED": "1",
        })
        run_env.update(env)
        command = [*python, "-m", "sglang.launch_server", "--model-path", str(model),
                   "--host", "127.0.0.1", "--port", str(port), *CPU_ARGS,
                   *(a.replace("{otlp_grpc}", grpc) for a in args)]
        (directory / "command.json").write_text(json.dumps({"command": command, "env": {
            k: v for k, v in run_env.items() if k.startswith(("OTEL_", "SGLANG_"))}}, indent=1))
        log_path = directory / "server.log"
        start = time.monotonic()
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(command, env=run_env, stdout=log_file, stderr=subprocess.STDOUT, cwd=directory,
                                    start_new_session=True,
                                    preexec_fn=_ignore_sigint if stop == "sigint_children_ignore" else None)
            try:
                ready_s = wait_ready(base, proc, ready_timeout_s)
                if stop_during_traffic_s is None:
                    sent = send_traffic(base, requests, repeat)
                    served_s = time.monotonic() - start
                    time.sleep(idle_before_stop_s)
                else:
                    holder: dict = {}
                    client = threading.Thread(target=lambda: holder.update(sent=send_traffic(base, requests, repeat)),
                                              daemon=True)
                    client.start()
                    time.sleep(stop_during_traffic_s)
                    served_s = time.monotonic() - start
                stop_time, stop_s, leftover = stop_server(proc, stop, stop_timeout_s)
                if stop_during_traffic_s is not None:
                    client.join(timeout=60)
                    sent = holder.get("sent", [])
            except BaseException:
                for process in alive(process_tree(proc.pid)):
                    process.kill()
                proc.wait(timeout=30)
                raise
        seconds = time.monotonic() - start
    log = log_path.read_text()
    probe = read_probe(probe_dir, "probe")
    results = {"requests": sent, "ready_s": round(ready_s, 2), "served_s": round(served_s, 2), "stop_time": stop_time}
    run = ServerRun(log=log, results=results, probe=probe, seen=collector.seen(), seconds=seconds,
                    processes=read_probe(probe_dir, "process"), stop=stop, stop_s=stop_s, returncode=proc.returncode,
                    leftover=leftover)
    run.pools = read_probe(probe_dir, "pools")
    return run
