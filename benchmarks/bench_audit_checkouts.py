"""The SWA slot audit's cost, audit / no audit, of several checkouts of otel-swa side by side.

Each revision given is unpacked (``git archive``) into a temporary folder; then, round by round and
in turn, one child process per revision imports that revision's ``otel_swa`` and times one
sampling ``step`` + ``flush`` of the reporter with the audit against without it (7 interleaved
pairs per FULL pool size, their median ratio), by the CPU time of the thread (``time.thread_time``:
on a machine shared with other work, wall time also counts the time the thread waited for a CPU). The inputs use the public API only, the same in
every revision since the audit came in (``SwaBatch``, ``SwaAuditInputs(free, pages, page_size,
holders)``, ``SwaDivergenceReporter``): 56 requests of 1,000 live tokens each in rows of 4,096
slots, their FULL slots drawn at random from the FULL pool, every one of them a holder (listed),
8,000 of them mapped to distinct slots of an SWA pool of 8,192 slots (page size 1), the rest to 0,
and the SWA free list the 192 slots left: a healthy pool, the inputs of ``bench_sample.py``'s
table 1 built the same way.

Printed: per FULL pool size (65,536 / 1,048,576 / 4,194,304 slots) and revision, the median and
spread over the rounds of each child's medians: the step with the audit, without, their difference
(the audit's own cost) and their ratio.

With ``--sglang-sized`` the SWA pool is sized as SGLang sizes it (``swa_full_tokens_ratio`` 0.8 of the
FULL pool: 52K / 839K / 3.36M slots) with every slot no holder maps to on the free list (44K / 831K /
3.35M ids), and a fourth shape: an SWA pool of 131,072 slots, 57K holders of which 54K in the
window; a revision whose audit runs in passes (``SwaAuditSweep``) is timed over whole passes (the
mean step), one without over 5 steps (every step does the whole audit).

``--full-pools`` keeps the shapes of those FULL pool sizes only (e.g. ``163840`` with ``--sglang-sized``:
the 128K SWA pool alone).

Run: ``python benchmarks/bench_audit_checkouts.py [--rounds 3] [--sglang-sized] [--full-pools N ...] [REV ...]``
from the repository (default revisions: ``43e5981``, the audit over the whole FULL pool, and ``HEAD``;
``worktree`` names the working tree as it is, uncommitted changes included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POOLS = (65536, 1 << 20, 1 << 22)
PAIRS = 7


#: ``--sglang-sized``: (FULL pool, SWA pool slots, requests, holders in the window): the SWA pool 0.8 of
#: the FULL pool (SGLang's ``swa_full_tokens_ratio`` default), and a 128K SWA pool with 57K holders.
SGLANG_SIZED = tuple((pool, int(0.8 * pool), 56, 8000) for pool in POOLS) + ((163840, 131072, 57, 54 * 1024),)


def shapes_of(sglang_sized: bool, full_pools: "list[int] | None") -> tuple:
    """The shapes measured: ``(FULL pool, SWA pool slots, requests, holders in the window)``."""
    shapes = SGLANG_SIZED if sglang_sized else tuple((pool, 8192, 56, 8000) for pool in POOLS)
    return tuple(shape for shape in shapes if not full_pools or shape[0] in full_pools)


def child(sglang_sized: bool = False, full_pools: "list[int] | None" = None) -> None:
    """Time one revision (the ``otel_swa`` on ``sys.path``); print per shape ``[with, without, ratio]``
    medians as JSON."""
    import torch

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views import SwaAuditInputs, SwaBatch

    torch.set_num_threads(1)
    width, per_request = 4096, 1000
    shapes = shapes_of(sglang_sized, full_pools)
    medians = []
    for pool, swa_slots, batch, in_window in shapes:
        gen = torch.Generator().manual_seed(0)
        live = batch * per_request
        held = (torch.randperm(pool - 1, generator=gen)[:live] + 1).to(torch.int32)
        req_to_token = torch.zeros(batch + 1, width, dtype=torch.int32)
        req_to_token[1:, :per_request] = held.view(batch, per_request)
        mapping = torch.zeros(pool + 2, dtype=torch.int64)
        mapped = torch.randperm(swa_slots, generator=gen)[:in_window] + 1
        mapping[held.long()[torch.randperm(live, generator=gen)[:in_window]]] = mapped
        free = torch.ones(swa_slots + 1, dtype=torch.bool)
        free[0] = False
        free[mapped] = False
        audit = SwaAuditInputs(torch.nonzero(free).reshape(-1), swa_slots, 1, held.long())
        rows, lens = list(range(1, batch + 1)), [per_request] * batch

        def view(swa_audit):
            return SwaBatch(req_to_token, mapping, torch.tensor(rows), torch.tensor(lens), lens, swa_audit=swa_audit)

        runs = {}
        steps = 5
        for name, v in (("audit", view(audit)), ("plain", view(None))):
            reporter = SwaDivergenceReporter(1, device="cpu", ring_size=8)
            sweep = getattr(reporter, "_audit_sweep", None)
            if name == "audit" and sweep is not None:  # an audit in passes: time whole passes
                reporter.step(v)
                reporter.flush()
                while sweep.in_progress:
                    reporter.step(v)
                    reporter.flush()
                steps = sweep.last_pass_samples * max(1, -(-5 // sweep.last_pass_samples))

            def run(reporter=reporter, v=v, n=None):
                n = n or steps
                start = time.thread_time()
                for _ in range(n):
                    reporter.step(v)
                    reporter.flush()
                return time.thread_time() - start

            runs[name] = run
        for _ in range(3):  # warm-up: the allocator and the caches
            runs["audit"](), runs["plain"]()
        pairs = [(runs["audit"]() / steps, runs["plain"]() / steps) for _ in range(PAIRS)]
        medians.append([statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
                        statistics.median(a / b for a, b in pairs)])
    print(json.dumps(medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="*", default=["43e5981", "HEAD"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sglang-sized", action="store_true",
                        help="SWA pools sized as SGLang sizes them (0.8 of the FULL pool, mostly free) and a 128K SWA pool")
    parser.add_argument("--full-pools", type=int, nargs="+", help="only the shapes of these FULL pool sizes")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from _common import fmt, machine_line, one_thread, print_table
    from _revisions import label, unpacked

    one_thread()  # as in the children (the machine line says so)
    print(machine_line())
    print(f"{args.rounds} rounds, one child process per revision in turn; each child: the median of {PAIRS} "
          "audited / plain pairs; median (min - max) over the rounds\n")
    pools = [str(pool) for pool in args.full_pools or ()]
    with unpacked(args.revisions) as roots:
        got: dict[str, list[list[float]]] = {rev: [] for rev in roots}
        for _ in range(args.rounds):
            for rev, root in roots.items():
                env = dict(os.environ, PYTHONPATH=root)
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"]
                                     + ["--sglang-sized"] * args.sglang_sized + pools, env=env, check=True,
                                     capture_output=True, text=True).stdout
                got[rev].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    shapes = shapes_of(args.sglang_sized, args.full_pools)
    for i, (pool, swa_slots, batch, _) in enumerate(shapes):
        for rev, rounds in got.items():
            audited, plain = [r[i][0] for r in rounds], [r[i][1] for r in rounds]
            shape_label = f"{pool:,}" + (f" / SWA {swa_slots:,}" if args.sglang_sized else "")
            rows.append((shape_label, label(rev), fmt(audited, 1e3, 3), fmt(plain, 1e3, 3),
                         fmt([a - b for a, b in zip(audited, plain)], 1e3, 3), fmt([r[i][2] for r in rounds], 1, 2, "x")))
    print_table("SWA slot audit / no audit, " + ("SWA pools as SGLang sizes them, holders listed (mean sampling step, ms)"
                if args.sglang_sized else "56K holders listed (one sampling step, ms)"),
                ("FULL pool" + (" / SWA pool" if args.sglang_sized else ""), "revision", "with audit", "without", "the audit's own", "with / without"), rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child("--sglang-sized" in sys.argv[2:], [int(a) for a in sys.argv[2:] if a.isdigit()])
    else:
        main()
