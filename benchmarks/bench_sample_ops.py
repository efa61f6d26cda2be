"""The device operations of one sample on the SGLang path, side by side with other revisions.

One sampling step of a reporter at the engine suite's shapes (16 requests of 190 tokens: 3,040 live
tokens, a sliding window of 8 (9 keys read per query), a decode batch, FULL pool 20,000 slots, SWA
pool 16,000 slots, page size 1, the free SWA pages listed, every request's row a holder): the
sample's counts, the sliding-window check and the SWA slot audit, as the SGLang instrumentation
gives them (``SwaBatch`` with ``sliding_window``, ``extend_lens_cpu``, ``swa_eviction_allowance``,
``req_pool_indices_cpu``, ``swa_audit``). The aten operations the reporter's ``step`` dispatches on
the calling thread are counted (``TorchDispatchMode``; views left out: they launch nothing), at a
sampled step (interval 1, after three warm-up samples) and at a step that is not sampled (interval
20). The provenance verification, new since the sample's first count, is not in it
(``benchmarks/bench_provenance.py`` counts it, table 1a).

Each revision (``--revisions``, default 0399fbd and the working tree) runs in a child process of its
own (``_revisions.py``) and uses only the public API both have.

Run: ``python benchmarks/bench_sample_ops.py [--revisions REV ...]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

#: Operations that only describe memory (no kernel on a GPU, no pass over data).
_VIEWS = {"slice", "select", "view", "unsqueeze", "alias", "as_strided", "lift_fresh", "detach", "_reshape_alias",
          "expand", "t", "transpose", "reshape", "_unsafe_view"}


def child() -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views.base import SwaAuditInputs, SwaBatch

    torch.set_num_threads(1)

    class KernelOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in _VIEWS:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    requests, length, window, full_slots, swa_slots = 16, 190, 8, 20_000, 16_000
    req_to_token = torch.zeros((requests + 1, 256), dtype=torch.int32)
    mapping = torch.zeros(full_slots + 1, dtype=torch.int64)
    for r in range(1, requests + 1):
        full = torch.arange(length, dtype=torch.int32) + 1 + (r - 1) * 256
        req_to_token[r, :length] = full
        # the last `window + 1` positions of each request keep an SWA slot (the rest evicted)
        mapping[full[-(window + 1):].long()] = torch.arange(window + 1) + 1 + (r - 1) * 16
    used = mapping[mapping.gt(0)]
    free = torch.ones(swa_slots + 1, dtype=torch.bool)
    free[0] = False
    free[used] = False
    rows = list(range(1, requests + 1))
    view = SwaBatch(
        req_to_token, mapping, torch.tensor(rows), torch.full((requests,), length), [length] * requests,
        swa_audit=SwaAuditInputs(free.nonzero().reshape(-1), swa_slots, 1, req_to_token[1:].reshape(-1)),
        req_pool_indices_cpu=rows, sliding_window=window, swa_eviction_allowance=0, extend_lens_cpu=[1] * requests,
        request_ids=[f"req-{r}" for r in rows],
    )
    out = {}
    for interval, label in ((1, "sampled"), (20, "not sampled")):
        reporter = SwaDivergenceReporter(interval)
        for _ in range(3 * interval):
            reporter.step(view)
        with KernelOps() as counted:
            reporter.step(view)
        reporter.flush()
        stats = reporter.stats
        out[label] = {"ops": sum(counted.ops.values()), "by_name": dict(counted.ops.most_common()),
                      "samples": stats.samples_delivered, "invalid": stats.invalid_samples}
        reporter.close()
    print(json.dumps(out))


def main() -> None:
    sys.path.insert(0, HERE)
    from _common import machine_line
    from _revisions import WORKTREE, label, run_child, unpacked

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revisions", nargs="+", default=["0399fbd", WORKTREE])
    args = parser.parse_args()
    print(machine_line())
    got = {}
    with unpacked(args.revisions) as roots:
        for rev, root in roots.items():
            got[rev] = run_child(root, [os.path.abspath(__file__), "--child"])
    print("\ndevice operations of one reporter step on the SGLang path (counts, window check, SWA audit), "
          "16 requests x 190 tokens, window 8")
    print(f"{'revision':<10} {'sampled step':>13} {'not sampled':>12}  samples delivered / invalid")
    for rev in args.revisions:
        g = got[rev]
        print(f"{label(rev):<10} {g['sampled']['ops']:>13} {g['not sampled']['ops']:>12}  "
              f"{g['sampled']['samples']} / {g['sampled']['invalid']}")
    for rev in args.revisions:
        print(f"\n{label(rev)}, sampled step, by operation: "
              + ", ".join(f"{name} {n}" for name, n in got[rev]["sampled"]["by_name"].items()))
    first, last = got[args.revisions[0]]["sampled"]["ops"], got[args.revisions[-1]]["sampled"]["ops"]
    if first:
        print(f"\n{label(args.revisions[-1])} / {label(args.revisions[0])}: {last / first:.2f}x the operations")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child()
    else:
        main()
