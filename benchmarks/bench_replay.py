"""Whole-process CPU time of ``otel-swa replay`` with the reporter against without, side by side.

Each figure is a ratio of CPU time (user + system, the operating system's accounting of the
finished child, ``os.wait4``) of two ``otel-swa replay`` runs of the default trace (the first 200
requests of the Azure conversation trace), A over B, taken pair by pair in interleaved rounds (A B
A B ...), printed as median (min - max) with the medians of A and B; the ratio of user time alone
beside it (the system time of these runs, page faults mostly, varies by a second from run to run
on a small virtual machine):

* model, interval 20 / reporter off (``OTEL_SWA_DIVERGENCE_INTERVAL=0``: no reporter work at all);
* model, interval 1 / off;
* no model (``--no-model``: KV cache bookkeeping only), interval 20 / off;
* model, interval 20, OTLP + line / line only: ``--exporter otlp,logline`` sending to a real local
  collector (``rotel-agent`` with a blackhole exporter, from the ``collector`` extra; a closed port
  when it is not installed, said in the output) over the plain line sink.

The interval comes from ``OTEL_SWA_DIVERGENCE_INTERVAL`` (not ``--interval``), so that the
forward-step spans of the OTLP run follow it (``OTEL_SWA_FORWARD_SPANS=sampled``, the default).
Output goes to ``/dev/null``; each run is a fresh process (start-up included, as a user sees it),
torch on one thread in every child (``OMP_NUM_THREADS=1``).

``--revisions REV ...`` runs each pair for each revision in turn (``_revisions.py``: the revision's
``otel_swa`` first on ``PYTHONPATH``; ``worktree`` is this working tree), a row per pair and revision.

Run: ``python benchmarks/bench_replay.py [--rounds 5] [--requests 200] [--only NAME] [--revisions REV ...]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, machine_line, one_thread, print_table, ratios  # noqa: E402
from _revisions import label, unpacked  # noqa: E402

REPLAY = [sys.executable, "-m", "otel_swa.cli", "replay", "--no-progress"]


def cpu_seconds(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """``(user, user + system)`` seconds of one child process running ``argv``."""
    with open(os.devnull, "wb") as devnull:
        child = subprocess.Popen(argv, env=env, stdout=devnull, stderr=devnull)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {child.returncode}")
    return usage.ru_utime, usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector() -> "tuple[subprocess.Popen | None, str]":
    """A local rotel-agent (blackhole exporter) and its gRPC endpoint, or ``None`` and a closed port."""
    agent = shutil.which("rotel-agent")
    if agent is None:
        try:
            import rotel

            agent = str(Path(rotel.__file__).with_name("rotel-agent"))
        except ImportError:
            agent = ""
    grpc, http = free_port(), free_port()
    if not agent or not Path(agent).exists():
        return None, f"http://127.0.0.1:{grpc}"
    process = subprocess.Popen(
        [agent, "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc}", "--otlp-http-endpoint", f"127.0.0.1:{http}",
         "--exporter", "blackhole"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", grpc)) == 0:
                return process, f"http://127.0.0.1:{grpc}"
        time.sleep(0.1)
    process.kill()
    return None, f"http://127.0.0.1:{grpc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--only", help="run only the pairs whose name contains this text")
    parser.add_argument("--revisions", nargs="+", help="run each pair for these revisions of otel-swa (each one's "
                        "otel_swa unpacked from git and put first on PYTHONPATH; worktree: this working tree), in turn")
    args = parser.parse_args()
    one_thread()
    print(machine_line())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_KV_CANARY"))}
    base["PYTHONUNBUFFERED"] = "1"
    base["OMP_NUM_THREADS"] = "1"  # torch in the children on one thread too (both sides of every pair)
    collector, endpoint = start_collector()
    print(f"{args.rounds} rounds, pairs interleaved; {args.requests} requests; OTLP to "
          f"{'a local rotel-agent (blackhole)' if collector else 'a closed port (rotel-agent not installed)'}\n")
    requests = ["--requests", str(args.requests)]

    def env(**extra: str) -> dict[str, str]:
        return {**base, **extra}

    pairs = {
        "model, interval 20 / off": (
            (REPLAY + requests, env(OTEL_SWA_DIVERGENCE_INTERVAL="20")),
            (REPLAY + requests, env(OTEL_SWA_DIVERGENCE_INTERVAL="0")),
        ),
        "model, interval 1 / off": (
            (REPLAY + requests, env(OTEL_SWA_DIVERGENCE_INTERVAL="1")),
            (REPLAY + requests, env(OTEL_SWA_DIVERGENCE_INTERVAL="0")),
        ),
        "no model, interval 20 / off": (
            (REPLAY + requests + ["--no-model"], env(OTEL_SWA_DIVERGENCE_INTERVAL="20")),
            (REPLAY + requests + ["--no-model"], env(OTEL_SWA_DIVERGENCE_INTERVAL="0")),
        ),
        "model, interval 20, OTLP + line / line only": (
            (REPLAY + requests + ["--exporter", "otlp,logline"],
             env(OTEL_SWA_DIVERGENCE_INTERVAL="20", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_INSECURE="true")),
            (REPLAY + requests + ["--exporter", "logline"], env(OTEL_SWA_DIVERGENCE_INTERVAL="20")),
        ),
    }
    rows = []
    revisions = args.revisions or [None]
    with contextlib.ExitStack() as stack:
        roots = stack.enter_context(unpacked(args.revisions)) if args.revisions else {None: None}
        try:
            for name, (a, b) in pairs.items():
                if args.only and args.only not in name:
                    continue

                def at(rev, run):  # the run with the revision's otel_swa first on the path
                    argv, environment = run
                    return (argv, environment if roots[rev] is None else {**environment, "PYTHONPATH": roots[rev]})

                for rev in revisions:  # warm-up (file cache, byte code)
                    cpu_seconds(*at(rev, a))
                    cpu_seconds(*at(rev, b))
                runs = {rev: ([], []) for rev in revisions}
                for _ in range(args.rounds):
                    for rev in revisions:
                        runs[rev][0].append(cpu_seconds(*at(rev, a)))
                        runs[rev][1].append(cpu_seconds(*at(rev, b)))
                for rev in revisions:
                    user_a, cpu_a = zip(*runs[rev][0])
                    user_b, cpu_b = zip(*runs[rev][1])
                    shown = name if rev is None else f"{name} ({label(rev)})"
                    rows.append((shown, fmt(ratios(cpu_a, cpu_b), 1, 3), fmt(ratios(user_a, user_b), 1, 3),
                                 f"{statistics.median(cpu_a):.2f}", f"{statistics.median(cpu_b):.2f}"))
                    print(f"  {shown}: cpu {rows[-1][1]}, user {rows[-1][2]}", flush=True)
        finally:
            if collector is not None:
                collector.kill()
                collector.wait()
    print()
    print_table("replay CPU time, A / B (whole process; cpu = user + system)",
                ("pair A / B", "cpu A / B", "user A / B", "A cpu s", "B cpu s"), rows)


if __name__ == "__main__":
    main()
