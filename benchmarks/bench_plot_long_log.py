"""``otel-swa plot`` on long logs, side by side with other revisions: time and peak memory.

Writes the logs of :mod:`bench_check_long_log` (one run of otel-swa's line sink: a record, its audit
line and its provenance line each after an SGLang log prefix), one per ``--records`` count (default
20,000, 200,000 and 400,000 records), and for each, in a child process of its own: the ``plain
parse`` of that benchmark (every line read and its JSON parsed once: the least any reader does),
then ``otel-swa plot LOG -o IMAGE.png`` of each revision (``--revisions``, default 847f93f, the last
commit whose ``plot`` read the whole log, and the working tree), each revision's ``otel_swa``
unpacked with ``git archive`` (:mod:`_revisions`) and run from a temporary folder so that it is the
one imported. torch is not imported by ``plot``.

Prints, per log and reader, the wall time, the CPU time (user + system: the figure to compare on a
machine shared with other work), the ratio of the CPU time to the plain parse's, and the peak
resident memory of the child (``ru_maxrss``): with ``--rounds N`` every reader runs once per round,
in turn (the revisions' order alternating), and each figure is the median (min - max) over the
rounds, each ratio taken within its round. Run: ``python benchmarks/bench_plot_long_log.py
[--records 20000 200000 400000] [--rounds 3] [--revisions 847f93f worktree]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_line, print_table  # noqa: E402
from _revisions import WORKTREE, label, unpacked  # noqa: E402
from bench_check_long_log import PLAIN, _spread, measure, write_log  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[20_000, 200_000, 400_000],
                        help="records of each log (default 20000 200000 400000)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--revisions", nargs="+", default=["847f93f", WORKTREE],
                        help="revisions whose otel-swa plot runs (default 847f93f worktree)")
    args = parser.parse_args()
    print(load_line())
    with tempfile.TemporaryDirectory() as tmp, unpacked(args.revisions) as roots:
        logs = {}
        for count in args.records:
            started = time.perf_counter()
            logs[count] = Path(tmp) / f"{count}.log"
            size = write_log(logs[count], count)
            print(f"log: {count} records, {3 * count + 1} lines, {size / 2**20:.0f} MiB "
                  f"(written in {time.perf_counter() - started:.1f} s)")
        envs = {rev: dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1") for rev, root in roots.items()}
        figures: dict = {}  # (records, reader) -> per round: (wall, cpu, cpu ratio, rss, rc)
        for round_no in range(max(1, args.rounds)):
            order = args.revisions if round_no % 2 == 0 else args.revisions[::-1]
            for count, path in logs.items():
                wall, cpu, rss, rc = measure([sys.executable, "-c", PLAIN, str(path)], cwd=tmp)
                base = cpu
                figures.setdefault((count, "plain parse"), []).append((wall, cpu, 1.0, rss, rc))
                for rev in order:
                    image = str(Path(tmp) / f"{count}-{rev}.png")
                    wall, cpu, rss, rc = measure([sys.executable, "-m", "otel_swa.cli", "plot", str(path), "-o", image],
                                                 env=envs[rev], cwd=tmp)
                    figures.setdefault((count, f"otel-swa plot, {label(rev)}"), []).append((wall, cpu, cpu / base, rss, rc))
        rows = []
        for (count, reader), rounds in figures.items():
            columns = list(zip(*rounds))
            rows.append((f"{count:,}", reader, *(_spread(column, unit) for column, unit in
                                                 zip(columns[:4], ("{:.1f}", "{:.1f}", "{:.2f}x", "{:.0f}"))),
                         ",".join(sorted({str(rc) for rc in columns[4]}))))
        print()
        print_table("time and peak memory (one child process each; CPU time is user + system)",
                    ("records", "reader", "wall s", "CPU s", "CPU vs plain", "peak RSS MiB", "exit"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
