"""How long a stop takes, and what a kill from outside loses, with otel-swa in the process.

Three measurements, each printed as median (min - max) over interleaved rounds:

``ctrl-c``
    A script using ``sglang.Engine`` (the suite's tiny hybrid-SWA model on CPU) under
    ``opentelemetry-instrument``, exporting to a real collector: it serves 8 requests, then waits;
    SIGINT goes to its process group (Ctrl-C in a terminal) and the time until its last process has
    ended is measured, with otel-swa on (``OTEL_SWA_DIVERGENCE_INTERVAL=20``) and off (``0``: nothing
    wrapped), one of each per round. Needs the SGLang suite's environment (``.ci/sglang-tests.sh``).
``replay-sigterm``
    ``otel-swa replay --exporter otlp,logline`` against a collector that is down (a closed port) or
    never answers (accepts TCP, says nothing), SIGTERM once it has logged its second sample, the
    time until the process has ended, at ``OTEL_EXPORTER_OTLP_TIMEOUT`` 10 (the default) and 2.
``sigkill``
    SGLang's HTTP server as docs/engines.md starts it (``sglang_engine/server.py``), SIGKILL of
    every process (``kill_process_tree`` from a supervisor) while it serves, at a moment drawn per
    round; then, at the collector, how old the newest metric point, sample event and forward-step
    span were at the kill (what the kill lost is at most that window), with the default schedules
    (metrics every ``OTEL_SWA_METRIC_EXPORT_INTERVAL`` 5 s, spans ``OTEL_BSP_SCHEDULE_DELAY`` 5 s,
    events ``OTEL_BLRP_SCHEDULE_DELAY`` 1 s), and the samples / spans the probe counted but the
    collector never got.

Run: ``.venv-sglang/bin/python benchmarks/bench_stop_paths.py ctrl-c [--rounds 3]``,
``.venv/bin/python benchmarks/bench_stop_paths.py replay-sigterm [--rounds 3]``,
``.venv-sglang/bin/python benchmarks/bench_stop_paths.py sigkill [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "engines")]

from _common import fmt, machine_line, print_table  # noqa: E402

ENGINE_SCRIPT = r"""
import sys, time
import sglang as sgl

if __name__ == "__main__":  # SGLang spawns its processes: they import this file again
    engine = sgl.Engine(model_path=sys.argv[1], device="cpu", attention_backend="torch_native",
                        sampling_backend="pytorch", disable_cuda_graph=True, dtype="float32", max_total_tokens=160,
                        mem_fraction_static=0.05, max_running_requests=4, chunked_prefill_size=-1, page_size=1,
                        random_seed=0)
    prompts = [[5 + i, 17, 33, 41, 9, 12, 60, 71] for i in range(8)]
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True})
    print("served", flush=True)
    while True:
        time.sleep(1)
"""


def _tree_gone(pids: list[int]) -> bool:
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def _clean_env(**more: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update(more)
    return env


# ---------------------------------------------------------------------- ctrl-c
def _ctrl_c_once(model: Path, collector, interval: int, log_dir: Path) -> float:
    import psutil

    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    env = _clean_env(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", OTEL_SWA_DIVERGENCE_INTERVAL=str(interval),
                     OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="otlp", OTEL_LOGS_EXPORTER="otlp,swa_logline",
                     OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint("grpc"))
    script = log_dir / "engine_script.py"
    script.write_text(ENGINE_SCRIPT)
    log = open(log_dir / f"ctrl-c-{interval}-{time.monotonic_ns()}.log", "w")
    proc = subprocess.Popen([launcher, sys.executable, str(script), str(model)], env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.strip() == "served":
                break
        else:
            raise SystemExit(f"the engine script ended before serving (see {log.name})")
        time.sleep(1.0)
        pids = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        while not _tree_gone(pids) and time.monotonic() - start < 120:
            proc.poll()
            time.sleep(0.02)
        return time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def ctrl_c(rounds: int) -> None:
    from collector_support import RotelCollector, rotel_agent
    from sglang_engine.harness import build_model

    work = Path(tempfile.mkdtemp(prefix="bench-stop-"))
    model = build_model(work / "model")
    results: dict[str, list[float]] = {"otel-swa off": [], "otel-swa on": []}
    with RotelCollector(rotel_agent(), work, settle_s=0.0) as collector:
        for _ in range(rounds):
            results["otel-swa off"].append(_ctrl_c_once(model, collector, 0, work))
            results["otel-swa on"].append(_ctrl_c_once(model, collector, 20, work))
    differences = [on - off for on, off in zip(results["otel-swa on"], results["otel-swa off"])]
    print(machine_line())
    print_table(f"Ctrl-C on an sglang.Engine script, SIGINT to the group until its last process ended ({rounds} rounds)",
                ["case", "exit after Ctrl-C, s"],
                [[name, fmt(values)] for name, values in results.items()] + [["on - off (round by round)", fmt(differences)]])


# ---------------------------------------------------------------------- replay-sigterm
def _replay_sigterm_once(endpoint: str, timeout: "float | None") -> float:
    env = _clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_INSECURE="true")
    if timeout is not None:
        env["OTEL_EXPORTER_OTLP_TIMEOUT"] = str(timeout)
    proc = subprocess.Popen([sys.executable, "-m", "otel_swa.cli", "replay", "--exporter", "otlp,logline", "--no-progress",
                             "--requests", "5000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:  # the replay's second sample line: its reporter and exporters are running
        if '"forward_ct":40,' in line:
            break
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    if proc.poll() is not None:
        raise SystemExit("the replay ended before the signal: give it more requests")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return time.monotonic() - start


def replay_sigterm(rounds: int) -> None:
    from bench_collector_faults import Blackhole, _free_port

    blackhole = Blackhole()
    collectors = {"closed port": f"http://127.0.0.1:{_free_port()}", "never answers": f"http://127.0.0.1:{blackhole.port}"}
    rows = []
    for timeout in (None, 2.0):
        results: dict[str, list[float]] = {name: [] for name in collectors}
        for _ in range(rounds):
            for name, endpoint in collectors.items():
                results[name].append(_replay_sigterm_once(endpoint, timeout))
        label = "10 (default)" if timeout is None else f"{timeout:g}"
        rows += [[label, name, fmt(values)] for name, values in results.items()]
    print(machine_line())
    print_table(f"otel-swa replay, SIGTERM at its second sample, until the process ended ({rounds} rounds)",
                ["OTEL_EXPORTER_OTLP_TIMEOUT, s", "collector", "exit after SIGTERM, s"], rows)


# ---------------------------------------------------------------------- sigkill
def _newest(values: list[int]) -> "int | None":
    return max(values) if values else None


def sigkill(rounds: int, seed: int) -> None:
    from collector_support import rotel_agent
    from sglang_engine.harness import build_model
    from sglang_engine.server import run_server

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="bench-sigkill-"))
    model = build_model(work / "model")
    ages: dict[str, list[float]] = {"metric points": [], "sample events": [], "forward-step spans": []}
    lost: dict[str, list[float]] = {"samples": [], "spans": []}
    for index in range(rounds):
        after = rng.uniform(3.0, 8.0)
        run = run_server(work / f"kill{index}", model, rotel_agent(), stop="kill_process_tree",
                         env={"OTEL_SWA_FORWARD_SPANS": "all"}, requests=16, repeat=8, stop_during_traffic_s=after)
        stop_ns = int(run.results["stop_time"] * 1e9)
        metrics = [p["time_unix_nano"] for m in run.seen["metrics"] if m.get("name", "").startswith("kv_cache.")
                   for p in m["points"]]
        events = [e["time_unix_nano"] for e in run.events()]
        spans = [s["end_unix_nano"] for s in run.spans("forward step")]
        for name, times in (("metric points", metrics), ("sample events", events), ("forward-step spans", spans)):
            newest = _newest(times)
            ages[name].append((stop_ns - newest) / 1e9 if newest else float("nan"))
        steps = run.forward_steps
        lost["samples"].append(steps // 20 - len(run.events()))
        lost["spans"].append(steps - len(run.spans("forward step")))
        print(f"round {index + 1}: killed {after:.1f} s into the traffic, {steps} forward steps", flush=True)
    print(machine_line())
    print_table(f"SIGKILL of every server process while it serves, defaults ({rounds} rounds)",
                ["at the collector", "newest was this old at the kill, s"], [[k, fmt(v)] for k, v in ages.items()])
    print_table("taken but never received", ["what", "count"], [[k, fmt(v, digits=0)] for k, v in lost.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ctrl-c", "replay-sigterm", "sigkill"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.what == "ctrl-c":
        ctrl_c(args.rounds)
    elif args.what == "replay-sigterm":
        replay_sigterm(args.rounds)
    else:
        sigkill(args.rounds, args.seed)


if __name__ == "__main__":
    main()
