"""The cost users pay inside a real SGLang engine: decode throughput with otel-swa on against off.

Needs the SGLang engine suite's environment (``.ci/sglang-tests.sh`` installs it in
``.venv-sglang``): run it with that environment's Python. Each run starts
``sglang_engine_driver.py`` under ``opentelemetry-instrument`` as a user does (otel-swa's
instrumentor loads in SGLang's spawned scheduler process), with the engine suite's tiny hybrid-SWA
model (``tests/engines/sglang_engine/build_model.py``, built once), 16 requests of 160 output tokens
decoded together (about 3,000 live tokens per forward step), and OpenTelemetry exporting OTLP to a
local ``rotel-agent`` (blackhole exporter) plus otel-swa's line (``OTEL_LOGS_EXPORTER=otlp,swa_logline``).

Variants: ``OTEL_SWA_DIVERGENCE_INTERVAL`` unset (off: nothing is wrapped), 20 and 1, 1 with the
read check off (``OTEL_SWA_READ_CHECK=off``: its attention wrapper not installed), and 20 and 1 with
the KV's provenance off (``OTEL_SWA_PROVENANCE=off``: no stamp, checksum, verification or write
check is installed), the same OpenTelemetry set-up in all. "interval 20" against "interval 20,
provenance off" is what the stamps and checksums written at every forward step cost (and one
verification in 20 steps); at interval 1, what they and a verification and write check at every step
cost. At interval 1 every forward step is a sampling step, so "interval
1" against "interval 1, read check off" is what the read check adds to a sampling step (its one
sliding-window layer of the step, up to 8 queries). Rounds interleave them (each round runs every variant once, the
order turning round by round); the figure per run is output tokens per second of the timed
``generate`` (the 16 short prefills included, the warm-up request not), and each ratio is taken
round by round; the CPU time each engine process spent in that ``generate`` is printed too (on a
machine with few cores another process's CPU is the engine's wall time). Then, with the timers of ``tests/engines/shims/sglang_cpu/sglang_step_profile.py``
in the scheduler process, one more run per interval gives the per-step cost of the instrumentor's
parts (not timed for the throughput: the timers cost a little themselves).

The CPU table also gives the main process's garbage collections in the timed ``generate``
(``gc.callbacks``), and the profiled runs (``off`` too) the scheduler's, by generation: a full
collection of a process holding SGLang and torch takes 0.4 s, and where one falls (inside the timed
window or not) moves with how many objects each process has made since its last one: in these
runs the main process's (SGLang's ``TokenizerManager``; otel-swa does nothing per request there)
falls inside the timed ``generate`` with otel-swa's instrumentor loaded and outside it without. ``--freeze-gc``
calls SGLang's ``Engine.freeze_gc()`` after the warm-up in every run, as SGLang's own long-collection
warning advises for serving: the objects of start-up leave the collector, and a full collection
costs little wherever it falls.

``--revision REV`` measures another revision of otel-swa instead of the working tree: it is
installed into this environment for the run (``pip install --no-deps -e`` of its ``git archive``)
and the working tree is installed back at the end.

Run: ``.venv-sglang/bin/python benchmarks/bench_sglang_engine.py [--rounds 5] [--freeze-gc] [--variants ...]
[--no-profile] [--revision REV]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _common import fmt, load_line, machine_line, print_table, ratios  # noqa: E402
from bench_replay import start_collector  # noqa: E402

#: Variant name -> otel-swa's variables for it (``None``: otel-swa off).
VARIANTS = {
    "off": None,
    "interval 20": {"OTEL_SWA_DIVERGENCE_INTERVAL": "20"},
    "interval 1": {"OTEL_SWA_DIVERGENCE_INTERVAL": "1"},
    "interval 1, read check off": {"OTEL_SWA_DIVERGENCE_INTERVAL": "1", "OTEL_SWA_READ_CHECK": "off"},
    "interval 20, provenance off": {"OTEL_SWA_DIVERGENCE_INTERVAL": "20", "OTEL_SWA_PROVENANCE": "off"},
    "interval 1, provenance off": {"OTEL_SWA_DIVERGENCE_INTERVAL": "1", "OTEL_SWA_PROVENANCE": "off"},
}
#: (variant, the same without provenance, what the difference is)
PROVENANCE_PAIRS = (
    ("interval 20", "interval 20, provenance off", "mostly the stamps and checksums written at every step"),
    ("interval 1", "interval 1, provenance off", "stamps and checksums + the verification and write check of every step"),
)
TOKENS_PER_STEP = 16  # the 16 requests decode together


def engine_env(endpoint: str, variables: "dict | None", profile_dir: "str | None" = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({
        "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "OTEL_SERVICE_NAME": "sglang-engine-bench", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "otlp,swa_logline", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true",
    })
    env.update(variables or {})
    if profile_dir is not None:
        env["OTEL_SWA_TEST_SGLANG_PROFILE"] = profile_dir
    return env


def _slug(name: str) -> str:
    return "".join(ch for ch in name if ch.isalnum())


def run_engine(model: Path, work: Path, env: dict, name: str, freeze_gc: bool = False) -> dict:
    """One engine run; its results (``tokens``, ``generate_s``, ``cpu_s``, ``gc_main``: see the driver)."""
    directory = work / name
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "config.json"
    config.write_text(json.dumps({"model": str(model), "out": str(directory / "results.json"), "freeze_gc": freeze_gc}))
    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    if launcher is None:
        raise SystemExit("opentelemetry-instrument is not beside this Python: run with .venv-sglang/bin/python")
    with open(directory / "engine.log", "w") as log:
        run = subprocess.run([launcher, sys.executable, str(HERE / "sglang_engine_driver.py"), str(config)], env=env,
                             stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if run.returncode != 0:
        tail = (directory / "engine.log").read_text()[-3000:]
        raise RuntimeError(f"the engine run {name} failed ({run.returncode}):\n{tail}")
    return json.loads((directory / "results.json").read_text())


@contextlib.contextmanager
def installed(revision: "str | None"):
    """The otel-swa of ``revision`` installed in this environment meanwhile (``None``: the working tree)."""
    if revision is None:
        yield
        return
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e"]
    with tempfile.TemporaryDirectory(prefix="otel-swa-revision-") as tmp:
        archive = subprocess.run(["git", "archive", revision], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        subprocess.run(pip + [tmp], check=True)
        try:
            yield
        finally:
            subprocess.run(pip + [str(REPO)], check=True)


def profile_table(profile_dir: Path) -> "tuple[int, list]":
    """The scheduler's profile: forward steps, and per part ``(part, calls per step, us per call
    wall / CPU, us per step)``."""
    found = [json.loads(p.read_text()) for p in profile_dir.glob("profile-*.json")]
    data = max(found, key=lambda d: d["steps"]) if found else {"steps": 0, "parts": {}}
    steps = max(data["steps"], 1)
    rows = []
    for part, (calls, wall, cpu) in data["parts"].items():
        rows.append((part, f"{calls / steps:.2f}", f"{wall / calls * 1e6:.1f} / {cpu / calls * 1e6:.1f}",
                     f"{wall / steps * 1e6:.1f}"))
    return data["steps"], rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--revision", help="measure this revision of otel-swa instead of the working tree")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled runs")
    parser.add_argument("--freeze-gc", action="store_true",
                        help="call SGLang's Engine.freeze_gc() after the warm-up request in every run")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the variants to run (off is always run)")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="otel-swa-sglang-bench-") as tmp:
        work = Path(tmp)
        model = work / "model"
        built = subprocess.run([sys.executable, str(REPO / "tests/engines/sglang_engine/build_model.py"), str(model)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"building the model failed:\n{built.stderr[-2000:]}")
        collector, endpoint = start_collector()
        print(f"{args.rounds} rounds, variants interleaved (order turning each round); 16 requests x 160 output tokens; "
              f"otel-swa {'at ' + args.revision if args.revision else 'of the working tree'}; OTLP to "
              f"{'a local rotel-agent (blackhole)' if collector else 'a closed port (rotel-agent not installed)'} + line"
              f"{'; Engine.freeze_gc() after the warm-up' if args.freeze_gc else ''}\n")
        try:
            with installed(args.revision):
                names = ["off"] + [name for name in args.variants if name != "off"]
                got: dict[str, list[float]] = {name: [] for name in names}
                cpu: dict[str, dict[str, list[float]]] = {}  # process -> variant -> CPU s of each timed generate
                gc_main: dict[str, list[float]] = {name: [] for name in names}  # main process GC s per generate
                for r in range(args.rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for name in order:
                        result = run_engine(model, work, engine_env(endpoint, VARIANTS[name]), f"r{r}-{_slug(name)}",
                                            args.freeze_gc)
                        got[name].append(result["tokens"] / result["generate_s"])
                        gc_main[name].append(sum(s for _, s in result.get("gc_main", {}).values()))
                        for process, seconds in result.get("cpu_s", {}).items():
                            cpu.setdefault(process, {}).setdefault(name, []).append(seconds)
                        print(f"  round {r + 1} {name:26s} {got[name][-1]:8.1f} tokens/s  ({load_line()})", flush=True)
                profiles = {}
                if not args.no_profile:
                    for name in [n for n in ("off", "interval 1", "interval 20", "interval 1, provenance off")
                                 if n in names]:
                        profile_dir = work / f"profile-{_slug(name)}"
                        profile_dir.mkdir()
                        run_engine(model, work, engine_env(endpoint, VARIANTS[name], str(profile_dir)), f"profiled-{_slug(name)}",
                                   args.freeze_gc)
                        profiles[name] = profile_table(profile_dir)
        finally:
            if collector is not None:
                collector.terminate()
                collector.wait(10)
    print()
    rows = []
    for name in names:
        step_ms = [TOKENS_PER_STEP / tps * 1e3 for tps in got[name]]
        rows.append((name, fmt(got[name], 1, 1), fmt(ratios(got[name], got["off"]), 1, 3),
                     fmt(step_ms, 1, 2), fmt([a - b for a, b in zip(step_ms, [TOKENS_PER_STEP / t * 1e3 for t in got["off"]])], 1, 2)))
    print_table("real sglang Engine, decode tokens/s (16 requests x 160 tokens, OTLP + line)",
                ("variant", "tokens/s", "on / off", "ms per step (16 tokens)", "ms per step added"), rows)
    if "interval 1" in names and "interval 1, read check off" in names:
        check_ms = [TOKENS_PER_STEP / a * 1e3 - TOKENS_PER_STEP / b * 1e3
                    for a, b in zip(got["interval 1"], got["interval 1, read check off"])]
        print_table("the read check in a sampling step (interval 1 against interval 1 with OTEL_SWA_READ_CHECK=off; "
                    "window 9 keys, up to 8 queries, 1 sliding-window layer a step)",
                    ("sampling step with / without the read check", "ms per step added"),
                    [(fmt(ratios(got["interval 1, read check off"], got["interval 1"]), 1, 3), fmt(check_ms, 1, 2))])
    pairs = [(on, off, what) for on, off, what in PROVENANCE_PAIRS if on in names and off in names]
    if pairs:
        rows = []
        for on, off, what in pairs:
            added = [TOKENS_PER_STEP / a * 1e3 - TOKENS_PER_STEP / b * 1e3 for a, b in zip(got[on], got[off])]
            rows.append((f"{on} ({what})", fmt(ratios(got[off], got[on]), 1, 3), fmt(added, 1, 2)))
        print_table("provenance (OTEL_SWA_PROVENANCE=on against off: its code not installed; the read check on in both)",
                    ("variant", "throughput without / with", "ms per step added"), rows)
    cpu_rows = [[process] + [fmt(cpu[process].get(name, [0.0]), 1, 2) for name in names]
                for process in sorted(cpu) if max(max(v) for v in cpu[process].values()) >= 0.05]
    cpu_rows.append(["main: in garbage collection"] + [fmt(gc_main[name], 1, 2) for name in names])
    print_table("CPU time of each engine process during the timed generate, s (user + system, psutil; "
                "the main process's collections by gc.callbacks, wall)", ["process"] + names, cpu_rows)
    for name, (steps, table) in profiles.items():
        title = ("the instrumentor's parts" if name != "off" else "otel-swa off") + f" at {name}" * (name != "off")
        print_table(f"{title}, in the scheduler process ({steps} forward steps; wall / thread CPU)",
                    ("part", "calls / step", "us / call", "us / step (wall)"), table)
    print(f"load average after: {load_line()}")


if __name__ == "__main__":
    main()
