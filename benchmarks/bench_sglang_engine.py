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

Besides tokens/s, each variant's cost is given as the scheduler process's CPU time per decoded
token, off over on (the timed ``generate`` decodes the same tokens in every run, so this is the
ratio of the scheduler's CPU times; higher is better, as tokens/s on / off): on a machine shared
with other work it moves less than wall time.

``--revisions REV ...`` measures several revisions of otel-swa side by side (``worktree``: the
working tree as it is): each is unpacked once (``git archive``), and before its runs it is installed
into this environment (``pip install --no-deps -e``); rounds interleave the revisions as they
interleave the variants; the working tree is installed back at the end.

Run: ``.venv-sglang/bin/python benchmarks/bench_sglang_engine.py [--rounds 5] [--freeze-gc] [--variants ...]
[--no-profile] [--revisions REV ...]``
"""

from __future__ import annotations

import argparse
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
import _pyprofile  # noqa: E402
from _common import fmt, load_line, machine_line, print_table, ratios  # noqa: E402
from _revisions import WORKTREE, label  # noqa: E402
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
SCHEDULER = "sglang::scheduler"  # SGLang's name for its scheduler process (psutil)


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
        # run in the run's own folder: opentelemetry-instrument puts its working directory first on
        # PYTHONPATH, and a checkout's would have every revision import that checkout's otel_swa
        run = subprocess.run([launcher, sys.executable, str(HERE / "sglang_engine_driver.py"), str(config)], env=env,
                             stdout=log, stderr=subprocess.STDOUT, timeout=1800, cwd=directory)
    if run.returncode != 0:
        tail = (directory / "engine.log").read_text()[-3000:]
        raise RuntimeError(f"the engine run {name} failed ({run.returncode}):\n{tail}")
    return json.loads((directory / "results.json").read_text())


class Installed:
    """The otel-swa revision installed in this environment (``pip install --no-deps -e``); each
    revision unpacked once (``git archive``); the working tree installed back at :meth:`close`."""

    def __init__(self, revisions: "list[str]") -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="otel-swa-revision-")
        self._roots = {}
        for revision in revisions:
            if revision == WORKTREE:
                self._roots[revision] = str(REPO)
                continue
            root = os.path.join(self._tmp.name, revision.replace("/", "_"))
            os.makedirs(root)
            archive = subprocess.run(["git", "archive", revision], cwd=REPO, check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
            self._roots[revision] = root
        self._current = WORKTREE  # what the environment has before the benchmark (its own install)

    def use(self, revision: str) -> None:
        if revision != self._current:
            self._install(self._roots[revision])
            self._current = revision

    def check(self, result: dict) -> dict:
        """``result`` of a run, after making sure its engine imported the installed revision's
        ``otel_swa``.

        Raises:
            RuntimeError: it imported another one (the run would be another revision's figure)."""
        expected = str(Path(self._roots[self._current]).resolve())
        if result.get("otel_swa") != expected:
            raise RuntimeError(f"the engine imported otel_swa from {result.get('otel_swa')!r}, not from {expected!r} "
                               f"(revision {self._current})")
        return result

    def _install(self, root: str) -> None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", root],
                       check=True)

    def close(self) -> None:
        try:
            if self._current != WORKTREE:
                self._install(str(REPO))
                self._current = WORKTREE
        finally:
            self._tmp.cleanup()


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
    marks = data.get("threads") or []
    if len(marks) >= 2:  # each thread's CPU between the first and the last write (whole clock ticks)
        (first, before), (last, after) = marks[0], marks[-1]
        spent = {thread: after[thread] - before.get(thread, 0.0) for thread in after}
        for thread in sorted((t for t in spent if spent[t] > 0), key=lambda t: -spent[t]):
            rows.append((f"thread {thread!r}: CPU (user + system) per step, steps {first} - {last}", "", "",
                         f"{spent[thread] / max(1, last - first) * 1e6:.1f} (CPU)"))
        idle = sorted(t for t in spent if spent[t] <= 0)
        if idle:
            rows.append((f"{len(idle)} other threads (OpenTelemetry's, gRPC's, otel-swa's delivery...): under one "
                         f"clock tick", "", "", "0"))
    return data["steps"], rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--revisions", nargs="+", default=[WORKTREE],
                        help="otel-swa revisions to measure side by side (worktree: the working tree)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled runs")
    parser.add_argument("--pyprofile", action="store_true",
                        help="after the rounds, one run per revision and variant with the scheduler's thread under "
                             "cProfile (its CPU time): otel-swa's cost per step to the function and operation")
    parser.add_argument("--freeze-gc", action="store_true",
                        help="call SGLang's Engine.freeze_gc() after the warm-up request in every run")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the variants to run (off is always run)")
    args = parser.parse_args()
    print(machine_line())
    revisions = list(dict.fromkeys(args.revisions))
    shown = {rev: label(rev) for rev in revisions}
    names = ["off"] + [name for name in args.variants if name != "off"]
    # per revision: variant -> tokens/s of each round; process -> variant -> CPU s; main process GC s
    got = {rev: {name: [] for name in names} for rev in revisions}
    cpu: dict = {rev: {} for rev in revisions}
    gc_main = {rev: {name: [] for name in names} for rev in revisions}
    profiles: dict = {rev: {} for rev in revisions}
    pyprofiles: dict = {rev: {} for rev in revisions}
    with tempfile.TemporaryDirectory(prefix="otel-swa-sglang-bench-") as tmp:
        work = Path(tmp)
        model = work / "model"
        built = subprocess.run([sys.executable, str(REPO / "tests/engines/sglang_engine/build_model.py"), str(model)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"building the model failed:\n{built.stderr[-2000:]}")
        collector, endpoint = start_collector()
        print(f"{args.rounds} rounds, variants interleaved (order turning each round); 16 requests x 160 output tokens; "
              f"otel-swa {', '.join(shown.values())}{' (revisions in turn each round)' if len(revisions) > 1 else ''}; OTLP to "
              f"{'a local rotel-agent (blackhole)' if collector else 'a closed port (rotel-agent not installed)'} + line"
              f"{'; Engine.freeze_gc() after the warm-up' if args.freeze_gc else ''}\n")
        installed = Installed(revisions)
        try:
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for rev in revisions[r % len(revisions):] + revisions[:r % len(revisions)]:
                    installed.use(rev)
                    for name in order:
                        result = installed.check(run_engine(model, work, engine_env(endpoint, VARIANTS[name]),
                                                            f"r{r}-{_slug(shown[rev])}-{_slug(name)}", args.freeze_gc))
                        got[rev][name].append(result["tokens"] / result["generate_s"])
                        gc_main[rev][name].append(sum(sec for _, sec in result.get("gc_main", {}).values()))
                        for process, seconds in result.get("cpu_s", {}).items():
                            cpu[rev].setdefault(process, {}).setdefault(name, []).append(seconds)
                        print(f"  round {r + 1} {shown[rev]:9s} {name:26s} {got[rev][name][-1]:8.1f} tokens/s, scheduler "
                              f"{cpu[rev].get(SCHEDULER, {}).get(name, [float('nan')])[-1]:.2f} s CPU  ({load_line()})",
                              flush=True)
            if not args.no_profile:
                for rev in revisions:
                    installed.use(rev)
                    for name in [n for n in ("off", "interval 1", "interval 20", "interval 1, provenance off") if n in names]:
                        profile_dir = work / f"profile-{_slug(shown[rev])}-{_slug(name)}"
                        profile_dir.mkdir()
                        installed.check(run_engine(model, work, engine_env(endpoint, VARIANTS[name], str(profile_dir)),
                                                   f"profiled-{_slug(shown[rev])}-{_slug(name)}", args.freeze_gc))
                        profiles[rev][name] = profile_table(profile_dir)
            if args.pyprofile:
                for rev in revisions:
                    installed.use(rev)
                    for name in [n for n in ("off", "interval 20", "interval 1") if n in names]:
                        profile_dir = work / f"pyprofile-{_slug(shown[rev])}-{_slug(name)}"
                        profile_dir.mkdir()
                        env = engine_env(endpoint, VARIANTS[name], str(profile_dir))
                        env["OTEL_SWA_TEST_SGLANG_PYPROFILE"] = "1"
                        installed.check(run_engine(model, work, env, f"pyprofiled-{_slug(shown[rev])}-{_slug(name)}",
                                                   args.freeze_gc))
                        pyprofiles[rev][name] = read_pyprofile(profile_dir)
        finally:
            installed.close()
            if collector is not None:
                collector.terminate()
                collector.wait(10)
    print()
    summary = []
    for name in names[1:]:
        row = [name]
        for rev in revisions:
            sched = cpu[rev].get(SCHEDULER, {})
            row += [fmt(ratios(got[rev][name], got[rev]["off"]), 1, 3),
                    fmt(ratios(sched.get("off", []), sched.get(name, [])), 1, 3)]
        summary.append(row)
    print_table("real sglang Engine, on / off: decode tokens/s, and the scheduler process's CPU time per decoded "
                "token (off / on), round by round",
                ["variant"] + [f"{shown[rev]}: {what}" for rev in revisions for what in ("tokens/s on / off",
                                                                                          "scheduler CPU off / on")],
                summary)
    for rev in revisions:
        title = f" ({shown[rev]})" if len(revisions) > 1 else ""
        rows = []
        for name in names:
            step_ms = [TOKENS_PER_STEP / tps * 1e3 for tps in got[rev][name]]
            off_ms = [TOKENS_PER_STEP / t * 1e3 for t in got[rev]["off"]]
            rows.append((name, fmt(got[rev][name], 1, 1), fmt(ratios(got[rev][name], got[rev]["off"]), 1, 3),
                         fmt(step_ms, 1, 2), fmt([a - b for a, b in zip(step_ms, off_ms)], 1, 2)))
        print_table(f"real sglang Engine, decode tokens/s (16 requests x 160 tokens, OTLP + line){title}",
                    ("variant", "tokens/s", "on / off", "ms per step (16 tokens)", "ms per step added"), rows)
        if "interval 1" in names and "interval 1, read check off" in names:
            check_ms = [TOKENS_PER_STEP / a * 1e3 - TOKENS_PER_STEP / b * 1e3
                        for a, b in zip(got[rev]["interval 1"], got[rev]["interval 1, read check off"])]
            print_table(f"the read check in a sampling step (interval 1 against interval 1 with OTEL_SWA_READ_CHECK=off; "
                        f"window 9 keys, up to 8 queries, 1 sliding-window layer a step){title}",
                        ("sampling step with / without the read check", "ms per step added"),
                        [(fmt(ratios(got[rev]["interval 1, read check off"], got[rev]["interval 1"]), 1, 3),
                          fmt(check_ms, 1, 2))])
        pairs = [(on, off, what) for on, off, what in PROVENANCE_PAIRS if on in names and off in names]
        if pairs:
            prov_rows = []
            for on, off, what in pairs:
                added = [TOKENS_PER_STEP / a * 1e3 - TOKENS_PER_STEP / b * 1e3 for a, b in zip(got[rev][on], got[rev][off])]
                prov_rows.append((f"{on} ({what})", fmt(ratios(got[rev][off], got[rev][on]), 1, 3), fmt(added, 1, 2)))
            print_table(f"provenance (OTEL_SWA_PROVENANCE at its default against off: its code not installed; the read "
                        f"check on in both){title}", ("variant", "throughput without / with", "ms per step added"), prov_rows)
        cpu_rows = [[process] + [fmt(cpu[rev][process].get(name, [0.0]), 1, 2) for name in names]
                    for process in sorted(cpu[rev]) if max(max(v) for v in cpu[rev][process].values()) >= 0.05]
        cpu_rows.append(["main: in garbage collection"] + [fmt(gc_main[rev][name], 1, 2) for name in names])
        print_table(f"CPU time of each engine process during the timed generate, s (user + system, psutil; "
                    f"the main process's collections by gc.callbacks, wall){title}", ["process"] + names, cpu_rows)
        for name, (steps, table) in profiles[rev].items():
            what = ("the instrumentor's parts" if name != "off" else "otel-swa off") + f" at {name}" * (name != "off")
            print_table(f"{what}, in the scheduler process ({steps} forward steps; wall / thread CPU){title}",
                        ("part", "calls / step", "us / call", "us / step (wall)"), table)
        for name, found in pyprofiles[rev].items():
            if name != "off" and "off" in pyprofiles[rev]:
                print_table(f"the scheduler's thread under cProfile at {name} against off, us per forward step "
                            f"({found['steps']} and {pyprofiles[rev]['off']['steps']} steps; thread CPU, the "
                            f"profiler's overhead in every row){title}", ("part", "us / step"),
                            _pyprofile.rows(pyprofiles[rev]["off"], found))
    print(f"load average after: {load_line()}")


def read_pyprofile(profile_dir: Path) -> dict:
    """The whole-thread profile of the scheduler process in ``profile_dir`` (the one with the
    most forward steps), per step (:func:`_pyprofile.read`)."""
    found = []
    for stats in profile_dir.glob("pyprofile-*.prof"):
        totals = profile_dir / f"profile-{stats.stem.rpartition('-')[2]}.json"
        if totals.exists():
            found.append((json.loads(totals.read_text())["steps"], stats))
    if not found:
        raise RuntimeError(f"no scheduler profile in {profile_dir}")
    steps, stats = max(found)
    return _pyprofile.read(stats, steps)


if __name__ == "__main__":
    main()
