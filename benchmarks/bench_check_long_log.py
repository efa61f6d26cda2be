"""``otel-swa check`` on a long log beside a plain parse of the same log: time and peak memory.

Writes a log of one run (``--records``, default 200,000 records) as otel-swa's line sink writes it:
a run start marker, then for every record SGLang's line, its audit line and its provenance line,
each after an SGLang log prefix (``[time TP0] otel_swa[verify=attention] ...``), values that grow
and change as a replay's do and pass every rule. Then, each in a child process of its own:

* ``plain parse``: a Python loop that reads the file line by line and ``json.loads`` the object
  after each line's ``={`` once: the least any reader of these lines does;
* ``otel-swa check``: the command, judging the log (the exit status must be 0);
* ``otel-swa records``: the command, its output discarded.

Prints, for each, the wall time, the CPU time (user + system: on a machine shared with other
work, the wall time also counts the waits for a core), the peak resident memory of the child
(``ru_maxrss``) and the ratios to the plain parse: with ``--rounds N``, the three are run in turn N
times (interleaved) and each figure is the median (min - max) over the rounds, each ratio taken
within its round. Run: ``python benchmarks/bench_check_long_log.py [--records 200000] [--rounds 3]
[--keep run.log]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_line, print_table  # noqa: E402

PREFIX = "[2026-12-07 04:32:52 TP0] otel_swa[verify=attention] "
PLAIN = (
    "import json, sys\n"
    "n = 0\n"
    "with open(sys.argv[1], encoding='utf-8') as log:\n"
    "    for line in log:\n"
    "        at = line.find('={')\n"
    "        if at >= 0:\n"
    "            json.loads(line[at + 1:])\n"
    "            n += 1\n"
    "print(n)\n"
)


def write_log(path: Path, records: int) -> int:
    """Write the log; return its size in bytes."""
    full = swa = 0
    with open(path, "w", encoding="utf-8") as out:
        out.write(PREFIX + 'otel_swa_run_start={"pid":4242}\n')
        for i in range(records):
            ct = 20 * (i + 1)
            live = 2000 + (i * 37) % 5000
            full += live * 4
            swa += min(live, 1024) * 4
            divergent, out_of_window = 1 + (i * 13) % 700, 1 + (i * 29) % 9000
            out.write(PREFIX + "kv_canary_swa_divergence=" + json.dumps(
                {"forward_ct": ct, "verify_full": full, "verify_swa": swa, "swa_full_idx_divergence": divergent,
                 "swa_out_of_window_tokens": out_of_window}, separators=(",", ":")) + "\n")
            out.write(PREFIX + "otel_swa_audit=" + json.dumps(
                {"forward_ct": ct, "swa_leaked_slots": 0, "swa_stale_tokens": 0, "swa_shared_slots": 0,
                 "swa_pages_in_use": live, "swa_pages_referenced": live, "swa_premature_evictions": 0,
                 "swa_late_held_slots": 0, "swa_read_checks": 8, "swa_read_mismatches": 0, "swa_read_unchecked": 0},
                separators=(",", ":")) + "\n")
            out.write(PREFIX + "otel_swa_provenance=" + json.dumps(
                {"forward_ct": ct, "kv_write_checks": 16, "kv_write_mismatches": 0, "kv_write_unchecked": 0,
                 "kv_stamp_checks": live, "kv_foreign_tokens": 0, "kv_stamp_unchecked": 0,
                 "kv_checksum_checks": live, "kv_corrupt_tokens": 0}, separators=(",", ":")) + "\n")
    return path.stat().st_size


def measure(argv: list[str], env: "dict[str, str] | None" = None, cwd: "str | None" = None) -> tuple[float, float, float, int]:
    """Run ``argv`` in a child (environment ``env`` and folder ``cwd``: this process's by default);
    its wall time (s), its CPU time (user + system, s), its peak resident memory (MiB) and exit status."""
    script = ("import resource, subprocess, sys, time\n"
              "t = time.perf_counter()\n"
              "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
              "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
              "print(time.perf_counter() - t, u.ru_utime + u.ru_stime, u.ru_maxrss, rc)\n")
    out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, check=True,
                         env=env, cwd=cwd).stdout
    wall, cpu, rss_kib, rc = out.split()
    return float(wall), float(cpu), int(rss_kib) / 1024, int(rc)


_UNITS = ("{:.1f}", "{:.2f}x", "{:.1f}", "{:.2f}x", "{:.0f}", "{:.1f}x")


def _spread(values: "tuple[float, ...]", unit: str) -> str:
    """The median of ``values``, and their range when there are several."""
    ordered = sorted(values)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    if len(ordered) == 1:
        return unit.format(median)
    return f"{unit.format(median)} ({unit.format(ordered[0])} - {unit.format(ordered[-1])})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000, help="records in the log (default 200000)")
    parser.add_argument("--keep", type=Path, default=None, help="write the log here and keep it")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    args = parser.parse_args()
    print(load_line())
    measured = subprocess.run([sys.executable, "-c", "import otel_swa; print(otel_swa.__file__)"],
                              capture_output=True, text=True, check=True).stdout.strip()
    print(f"otel_swa measured: {measured} (python -m puts the working directory first on sys.path)")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "run.log"
        started = time.perf_counter()
        size = write_log(path, args.records)
        print(f"log: {args.records} records, {3 * args.records + 1} lines, {size / 2**20:.0f} MiB "
              f"(written in {time.perf_counter() - started:.1f} s)\n")
        cli = [sys.executable, "-m", "otel_swa.cli"]
        runs = {"plain parse": [sys.executable, "-c", PLAIN, str(path)],
                "otel-swa check": cli + ["check", str(path)],
                "otel-swa records": cli + ["records", str(path)]}
        figures: dict = {name: [] for name in runs}  # per round: (wall, cpu, rss, rc) and the ratios
        for _ in range(max(1, args.rounds)):
            base = None
            for name, argv in runs.items():
                wall, cpu, rss, rc = measure(argv)
                base = base or (wall, cpu, rss)
                figures[name].append((wall, wall / base[0], cpu, cpu / base[1], rss, rss / base[2], rc))
        rows = []
        for name, rounds in figures.items():
            columns = list(zip(*rounds))
            rows.append((name, *(_spread(column, unit) for column, unit in zip(columns[:6], _UNITS)),
                         ",".join(sorted({str(rc) for rc in columns[6]}))))
        print_table("time and peak memory (one child process each; CPU time is user + system, the figure to "
                    "compare on a machine shared with other work)",
                    ("reader", "wall s", "vs plain", "CPU s", "vs plain", "peak RSS MiB", "vs plain", "exit"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
