"""The every-step KV write path (stamps, every layer's checksum folds) on the torch path and on the
Triton kernels (``otel_swa.device.triton_kv``), per decode step, at the shapes of ``_decode_model.py``.

Each path's step, alone (no model around it): the stamp call, then every layer's ``after_layer``
with the K/V a QKV projection's split gives (non-contiguous rows, as in the engines), the write
check off. On CUDA both are captured in a CUDA graph and the replays timed (median over interleaved
rounds, spread min - max); on CPU (``--quick``, a dry run) the kernels run under Triton's interpreter,
eagerly, and the times say nothing. Device operations: the torch operations dispatched per step
(views not counted) and, on the kernel path, the Triton launches (1 + layers, by design).

A third row: a sample's whole provenance verification (``KvProvenance.stage``, both pools, up to
4,096 slots a pool, the upload included), torch path and kernels (2 a pool). A second row per shape: a sample's recomputed folds of the FULL pool (the SWA pool where the shape
has no full layer; ``PoolFolds.verify`` and the verify kernel, eager as a sample runs them) for up to
4,096 slots (64 on CPU).

Also checks, at each shape, that the two paths leave the same stamps and folds and verify alike
(else it exits 1).

Run: ``python benchmarks/bench_write_kernels.py [--device cuda] [--rounds 7] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, ratios, timed  # noqa: E402
from _decode_model import SHAPES  # noqa: E402
from bench_sample import kernel_ops  # noqa: E402

from otel_swa.device.provenance import PROVENANCE_WIDTH  # noqa: E402


def write_step(shape, device, kernels):
    """A KvProvenance of ``shape``'s pools and a function running one decode step's write path."""
    from otel_swa.device.gate import SamplingGate
    from otel_swa.device.provenance import KvProvenance

    s = shape
    gen = torch.Generator().manual_seed(0)
    width = s.context + 8
    slots = s.batch * width + 1
    r2t = (torch.arange(s.batch * width, dtype=torch.int32) + 1).reshape(s.batch, width).to(device)
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots - 1, generator=gen) + 1]).to(device)
    rows = torch.arange(s.batch, device=device)
    positions = torch.full((s.batch,), s.context, dtype=torch.int64, device=device)
    loc = r2t[rows, positions].long()
    ids = torch.randint(0, 1000, (s.batch,), generator=gen).to(device)
    # the layers of one kind share one pair of buffers (the capacity of one layer), as _decode_model's
    pools = {kind: tuple(torch.zeros((slots, s.kv_heads, s.head_dim), device=device, dtype=s.dtype) for _ in range(2))
             for kind in set(s.layers)}
    qkv = torch.randn((len(s.layers), s.batch, (s.q_heads + 2 * s.kv_heads) * s.head_dim), generator=gen)
    qkv = qkv.to(device=device, dtype=s.dtype)
    given = [row.split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=1)[1:]
             for row in qkv]
    order = {"full": tuple(i for i, sliding in enumerate(s.layers) if not sliding),
             "swa": tuple(i for i, sliding in enumerate(s.layers) if sliding)}
    prov = KvProvenance(device, SamplingGate(device), full_slots=slots, swa_slots=slots, write_check=False,
                        checksum_order={k: v for k, v in order.items() if v})
    prov.kernels = kernels

    def step():
        prov.stamp(input_ids=ids, positions=positions, out_cache_loc=loc, req_pool_indices=rows,
                   req_to_token=r2t, full_to_swa_index_mapping=mapping)
        for layer, (sliding, (k, v)) in enumerate(zip(s.layers, given)):
            k_buf, v_buf = pools[sliding]
            prov.after_layer(layer_id=layer, swa=sliding, k=k, v=v, k_buffer=k_buf, v_buffer=v_buf,
                             out_cache_loc=loc, full_to_swa_index_mapping=mapping)

    from otel_swa.views import SwaBatch

    lens = [s.context + 1] * s.batch
    view = SwaBatch(r2t, mapping, rows, positions + 1, seq_lens_cpu=lens, sliding_window=s.window)
    out = torch.zeros(PROVENANCE_WIDTH, dtype=torch.int64, device=device)
    step.sample = lambda: prov.stage(out, view)  # a sample's verification of both pools
    step.out = out
    return prov, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small shapes (a dry run)")
    args = parser.parse_args()
    one_thread()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels' module is imported, and at each launch
    try:
        from otel_swa.device import triton_kv
    except ImportError as exc:
        print(f"bench_write_kernels: skipped, triton does not import ({exc})")
        return
    print(machine_line())
    rows, same = [], True
    for full_shape in SHAPES:
        shape = full_shape.small() if args.quick or not cuda else full_shape
        (torch_prov, torch_step), (kernel_prov, kernel_step) = (write_step(shape, device, k) for k in (None, triton_kv))
        # the interpreter runs the kernels through torch and numpy on CPU: its operations are no launches
        ops = {"torch": kernel_ops(torch_step), "triton": f"{kernel_ops(kernel_step)} + {1 + len(shape.layers)}"
               if cuda else "n/a"}
        if cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: the kernels compiled, the constants made
                torch_step()
                kernel_step()
            torch.cuda.current_stream().wait_stream(side)
            graphs = {}
            for name, fn in (("torch", torch_step), ("triton", kernel_step)):
                graphs[name] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[name]):
                    fn()
            variants = {name: graph.replay for name, graph in graphs.items()}
            sync = torch.cuda.synchronize
        else:
            variants, sync = {"torch": torch_step, "triton": kernel_step}, (lambda: None)
        got = interleaved({name: timed(fn, 20 if cuda else 1, sync) for name, fn in variants.items()},
                          args.rounds if cuda else 1)
        # a sample's recomputed folds of a pool (eager, as a sample runs): the torch path and the kernel
        pool = 0 if kernel_prov.folds[0].layers else 1
        folds = kernel_prov.folds[pool]
        taken = torch.arange(1, min(4096 if cuda else 64, folds.table.shape[0]), device=device)
        checks = {"torch": lambda: folds.verify(taken), "triton": lambda: triton_kv.verify_folds(folds, taken)}
        sampled = interleaved({name: timed(fn, 5 if cuda else 1, sync if cuda else (lambda: None))
                               for name, fn in checks.items()}, args.rounds if cuda else 1)
        same = same and all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(checks["torch"](), checks["triton"]()))
        # a sample's whole verification (KvProvenance.stage, both pools, up to 4,096 slots a pool)
        stages = {"torch": torch_step.sample, "triton": kernel_step.sample}
        staged = interleaved({name: timed(fn, 5 if cuda else 1, sync if cuda else (lambda: None))
                              for name, fn in stages.items()}, args.rounds if cuda else 1)
        same = same and torch.equal(torch_step.out.cpu(), kernel_step.out.cpu())
        for a, b in zip(kernel_prov.stamps + tuple(f.table for f in kernel_prov.folds),
                        torch_prov.stamps + tuple(f.table for f in torch_prov.folds)):
            same = same and torch.equal(a.cpu(), b.cpu())
        label = f"{full_shape.name}{' (small)' if shape is not full_shape else ''}"
        layers = len(shape.layers)
        rows.append((label, f"{layers} layers, batch {shape.batch}", fmt(got["torch"], 1e6, 1, " us"),
                     fmt(got["triton"], 1e6, 1, " us"), fmt(ratios(got["triton"], got["torch"]), 1, 3, "x"),
                     f"{ops['torch']} / {ops['triton']}"))
        rows.append((label, f"verify {taken.shape[0]} {('FULL', 'SWA')[pool]} slots", fmt(sampled["torch"], 1e6, 1, " us"),
                     fmt(sampled["triton"], 1e6, 1, " us"), fmt(ratios(sampled["triton"], sampled["torch"]), 1, 3, "x"),
                     f"{kernel_ops(checks['torch'])} / 1"))
        rows.append((label, f"sample: stage, {min(4096, shape.batch * (shape.context + 1))} slots a pool",
                     fmt(staged["torch"], 1e6, 1, " us"), fmt(staged["triton"], 1e6, 1, " us"),
                     fmt(ratios(staged["triton"], staged["torch"]), 1, 3, "x"),
                     f"{kernel_ops(stages['torch'])} / " + (f"{kernel_ops(stages['triton'])} + 4" if cuda else "n/a")))
    step = "graph replay" if cuda else "eager step under the interpreter (not a timing)"
    print_table(f"write path per decode step, {device.type} ({step})",
                ("shape", "step", "torch path", "triton kernels", "triton / torch", "device ops torch / triton"), rows)
    print(f"same stamps, folds and verification on both paths: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
