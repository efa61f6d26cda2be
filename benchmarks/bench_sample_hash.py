"""The hash of a sample's verification on the CPU, side by side with other revisions: the content
checksums of every layer's K and V rows at the slots a sample verifies
(``otel_swa.device.checksum.RowHasher.of_rows``: one gather per buffer, then the hash), at the
engine suite's shapes and at a 7B-like model's.

Shapes (slots verified: the budget's bound, 4,096 a pool):

* the engine suite's Mellum: 3 sliding-window layers, 2 KV heads x 16, float32 (64 words a row);
* a 7B-like model: 32 layers, 8 KV heads x 128, bfloat16 (2,048 words a row, K and V), a pool of
  16,384 slots (2 GiB of KV), the 4,096 slots in random order.

Each revision (``--revisions``, default 8eaea99 and the working tree) runs in a child process of
its own (``_revisions.py``), torch on one thread; the child takes the CPU time (``process_time``)
of each call, variants interleaved, and every revision's hashes are compared with the first's:
the same values or the benchmark fails.

Run: ``python benchmarks/bench_sample_hash.py [--rounds 7] [--revisions REV ...]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = {
    "engine suite: 3 layers x 64 words (fp32), 4,096 slots": (3, 2, 16, "float32", 20_000, 4096),
    "7B-like: 32 layers x 2,048 words (bf16), 4,096 slots": (32, 8, 128, "bfloat16", 16_384, 4096),
}


def child(rounds: int) -> None:
    import time

    import torch

    from otel_swa.device.checksum import RowHasher

    torch.set_num_threads(1)
    out = {}
    for name, (layers, heads, dim, dtype, pool, slots_n) in SHAPES.items():
        gen = torch.Generator().manual_seed(7)
        buffers = [(torch.randn((pool, heads, dim), generator=gen).to(getattr(torch, dtype)),
                    torch.randn((pool, heads, dim), generator=gen).to(getattr(torch, dtype))) for _ in range(layers)]
        slots = torch.randperm(pool, generator=gen)[:slots_n]
        hasher = RowHasher(*buffers[0], None)
        words = [hasher.word_rows(b, k) for pair in buffers for k, b in zip((True, False), pair)]
        got = hasher.of_rows(buffers, slots, words=words)
        times = []
        for _ in range(rounds):
            start = time.process_time()
            hasher.of_rows(buffers, slots, words=words)
            times.append(time.process_time() - start)
        out[name] = {"s": times, "digest": hashlib.sha256(got.numpy().tobytes()).hexdigest()}
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--revisions", nargs="+", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.rounds)
        return
    sys.path.insert(0, HERE)
    from _common import fmt, machine_line, print_table, ratios
    from _revisions import WORKTREE, label, run_child, unpacked

    revisions = args.revisions or ["8eaea99", WORKTREE]
    print(machine_line())
    results = {rev: {} for rev in revisions}
    with unpacked(revisions) as roots:
        for r in range(args.rounds):  # interleaved: every revision once a round, in turn
            for rev in revisions[r % len(revisions):] + revisions[:r % len(revisions)]:
                got = run_child(roots[rev], [os.path.abspath(__file__), "--child", "--rounds", "3"])
                for name, found in got.items():
                    entry = results[rev].setdefault(name, {"s": [], "digest": found["digest"]})
                    entry["s"].append(min(found["s"]))
                    if entry["digest"] != found["digest"] or found["digest"] != results[revisions[0]].get(
                            name, found)["digest"]:
                        raise SystemExit(f"{label(rev)} hashed {name} to other values")
    base = revisions[0]
    rows = []
    for name in SHAPES:
        row = [name] + [fmt(results[rev][name]["s"], 1e3, 2) for rev in revisions]
        row += [fmt(ratios(results[rev][name]["s"], results[base][name]["s"]), 1, 2) for rev in revisions[1:]]
        rows.append(row)
    print_table(f"the hash of a sample's rows on the CPU (RowHasher.of_rows), ms of CPU time (the best of 3 calls a "
                f"round, {args.rounds} rounds); the same values in every revision",
                ["shape"] + [label(rev) for rev in revisions] + [f"{label(rev)} / {label(base)}" for rev in revisions[1:]],
                rows)


if __name__ == "__main__":
    main()
