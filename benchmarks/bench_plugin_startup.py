"""What otel-swa's SGLang plugin costs an engine's start-up: a real ``sglang.Engine`` started with otel-swa
installed and its switch unset, against the same engine without otel-swa's entry points.

Needs the SGLang engine suite's environment (``.ci/sglang-tests.sh`` installs it in
``.venv-sglang``): run it with that environment's Python. Each run is a process of its own,
``sglang_startup_driver.py`` under plain ``python`` (no ``opentelemetry-instrument``, no ``OTEL_*``
variable), starting a ``sglang.Engine`` on CPU with the engine suite's tiny hybrid-SWA model
(``tests/engines/sglang_engine/build_model.py``, built once), answering one 24-token request and
shutting down. The figure is the start-up: seconds from the driver's first line to the ``Engine``
being ready (the ``import sglang`` included; SGLang loads its plugins in the ``Engine``'s own
process, in the scheduler and in the detokenizer, all before the engine is ready).

Variants:

* ``absent``: otel-swa's entry points hidden from ``importlib.metadata`` in every process of the
  engine (``OTEL_SWA_BENCH_HIDE_PLUGINS=1``, see the driver): SGLang starts as without otel-swa;
* ``installed, switch unset``: what every SGLang user with otel-swa installed pays;
* ``installed, SGLang's variable 20``: ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL=20`` and
  nothing else (the plain script of docs/engines.md): the plugin sets OpenTelemetry up with
  otel-swa's line exporter and instruments each process (informative: the price of switching it on).

A second table times what otel-swa's entry points change in each of the engine's processes, on
its own: SGLang's ``load_plugins()`` (``sglang/srt/plugins/__init__.py``: find the entry points,
load and call each plugin, apply the hooks), called once in a fresh process that has imported
``sglang.srt.plugins``, as each SGLang process calls it once, for the same variants
(``--load-plugins-rounds``, default 10; milliseconds, in-process, so far less noisy than a whole
start-up on a shared machine).

Rounds interleave them (each round runs every variant once, in turn, after one warm-up round that
is not counted); each figure is the median over the rounds with the spread (min - max), and each
ratio is taken round by round against ``absent``. The test environment's CPU shims
(``tests/engines/shims/install.py``: a ``.pth`` file importing ``otel_swa.import_hooks`` in every
process) are there in every variant.

Run: ``.venv-sglang/bin/python benchmarks/bench_plugin_startup.py [--rounds 5] [--load-plugins-rounds 10]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _common import fmt, load_line, machine_line, print_table, ratios  # noqa: E402

#: Variant name -> the variables it sets on top of a clean environment.
VARIANTS = {
    "absent": {"OTEL_SWA_BENCH_HIDE_PLUGINS": "1"},
    "installed, switch unset": {},
    "installed, SGLang's variable 20": {"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "20"},
}


def run_engine(model: Path, work: Path, name: str, variables: dict) -> dict:
    """One start-up; the driver's results (``startup_s``, ``import_s``, ``engine_s``, ``plugin_loaded``)."""
    directory = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    config = directory / "config.json"
    config.write_text(json.dumps({"model": str(model), "out": str(directory / "results.json")}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **variables})
    with open(directory / "engine.log", "w") as log:
        run = subprocess.run([sys.executable, str(HERE / "sglang_startup_driver.py"), str(config)], env=env,
                             stdout=log, stderr=subprocess.STDOUT, timeout=900)
    text = (directory / "engine.log").read_text()
    if run.returncode != 0:
        raise RuntimeError(f"the engine run {name} failed ({run.returncode}):\n{text[-3000:]}")
    results = json.loads((directory / "results.json").read_text())
    results["lines"] = text.count("kv_canary_swa_divergence=")
    return results


#: One ``load_plugins()`` in a fresh process (the driver's module installs the entry-point filter).
LOAD_PLUGINS = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import sglang_startup_driver  # noqa: F401  (OTEL_SWA_BENCH_HIDE_PLUGINS)
import sglang.srt.plugins as plugins
start = time.perf_counter()
plugins.load_plugins()
print((time.perf_counter() - start) * 1e3)
"""


def load_plugins_ms(variables: dict) -> float:
    """Milliseconds of SGLang's ``load_plugins()`` in a fresh process with ``variables`` set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", **variables})
    run = subprocess.run([sys.executable, "-c", LOAD_PLUGINS, str(HERE)], env=env, capture_output=True, text=True,
                         timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"load_plugins() failed:\n{run.stderr[-3000:]}")
    return float(run.stdout.strip().splitlines()[-1])


def startup_table(rounds: int) -> None:
    """The start-up table (module docstring): ``rounds`` interleaved rounds after one warm-up round."""
    with tempfile.TemporaryDirectory(prefix="otel-swa-startup-") as tmp:
        work = Path(tmp)
        model = work / "model"
        build = subprocess.run([sys.executable, str(REPO / "tests" / "engines" / "sglang_engine" / "build_model.py"),
                                str(model)], capture_output=True, text=True, timeout=600)
        if build.returncode != 0:
            raise SystemExit(f"building the model failed:\n{build.stderr[-3000:]}")
        runs: dict = {name: [] for name in VARIANTS}
        for round_index in range(1 + rounds):
            order = list(VARIANTS)
            order = order[round_index % len(order):] + order[:round_index % len(order)]
            for name in order:
                results = run_engine(model, work, name, VARIANTS[name])
                if round_index:
                    runs[name].append(results)
            print(f"round {round_index}{' (warm-up)' if not round_index else ''}: " + ", ".join(
                f"{name} {runs[name][-1]['startup_s']:.2f} s" if round_index else name for name in order), flush=True)
    for name, results in runs.items():
        loaded = {r["plugin_loaded"] for r in results}
        expected = name != "absent"
        if loaded != {expected}:
            raise SystemExit(f"{name}: otel-swa's plugin module loaded in the Engine's process: {loaded}, expected {expected}")
    base = [r["startup_s"] for r in runs["absent"]]
    rows = []
    for name, results in runs.items():
        startup = [r["startup_s"] for r in results]
        rows.append((name, fmt(startup, unit=" s"), fmt([r["import_s"] for r in results], unit=" s"),
                     fmt([r["engine_s"] for r in results], unit=" s"), fmt(ratios(startup, base), digits=3),
                     str(sorted({r["lines"] for r in results}))))
    print()
    print_table(f"sglang.Engine start-up, {rounds} interleaved rounds (median (min - max))",
                ("variant", "start-up", "import sglang", "Engine(...)", "start-up / absent", "otel-swa lines"), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="start-up rounds (0: only the load_plugins() table)")
    parser.add_argument("--load-plugins-rounds", type=int, default=10)
    args = parser.parse_args()
    print(machine_line())
    if args.rounds > 0:
        startup_table(args.rounds)
    print(load_line())
    print()
    timed: dict = {name: [] for name in VARIANTS}
    for round_index in range(1 + args.load_plugins_rounds):
        order = list(VARIANTS)
        for name in order[round_index % len(order):] + order[:round_index % len(order)]:
            value = load_plugins_ms(VARIANTS[name])
            if round_index:
                timed[name].append(value)
    base_ms = timed["absent"]
    print_table(f"SGLang's load_plugins() in a fresh process, {args.load_plugins_rounds} interleaved rounds, ms",
                ("variant", "load_plugins()", "minus absent (round by round)"),
                [(name, fmt(values, digits=1), fmt([v - b for v, b in zip(values, base_ms)], digits=1))
                 for name, values in timed.items()])
    print(load_line() + " (at the end)")


if __name__ == "__main__":
    main()
