"""The sample, hot-path and CUDA graph capture figures in one table (what ``benchmarks/gpu.sh`` prints).

Rows (median over interleaved rounds, spread min - max):

* hot path: ``observe(pool, 0-dim device tensor)``, ``observe(pool, int)``, a non-sampling ``step``;
* sample: one sampling step at 1M live tokens (batch 256, fill 1/8), ns per live token, the device
  operations it launched; SGLang's two-pass dense gather over it (batch 256 x 32K, fill 10 %); the
  audit's added cost at 56K holders in a 1M-slot FULL pool;
* read check: one sliding-window layer's check (``benchmarks/bench_read_check.py``'s GPT-OSS-like
  and Gemma-3-like shapes), microseconds per call;
* capture: the replay of a CUDA graph holding one forward (a matmul standing for the model) with the
  reporter's in-graph calls (device-count ``observe`` x 2) against the same graph without them, and
  whether the totals after the replays are exact (the reporter's ``step`` runs after each replay);
* captured checks: a decode step at three model shapes (``_decode_model.py``: the engine suite's
  Mellum, GPT-OSS-like, Gemma-3-like) captured without otel-swa's in-forward checks and with them
  (stamps, checksums, the write check, the read check), replayed with the sampling flag unset (a
  step not sampled: what every replay pays) and set (a sampled step), in the ``masked`` and the
  ``conditional`` graph modes: microseconds per replay and the ratio to the step without checks.
  Without CUDA the same steps run eagerly.

``--gpu-tests "N passed, M failed"`` adds the GPU test result as the first row. ``--quick`` makes
every shape small (a dry run on the CPU: it checks that the figures can be taken, not their values).

Run: ``python benchmarks/gpu_figures.py [--device cuda] [--rounds 7] [--quick] [--gpu-tests TEXT]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, ratios, timed  # noqa: E402
from bench_sample import healthy_swa_pool, kernel_ops, make_batch, per_token_sample, sglang_two_pass, view_of  # noqa: E402

from otel_swa.reporter import KVPool, SwaDivergenceReporter  # noqa: E402
from otel_swa.views import SwaAuditInputs  # noqa: E402


def capture_rows(device, rounds, quick, sync):
    """Graph replay with and without the reporter inside; exactness of the totals."""
    size = 256 if quick else 4096
    x = torch.randn(size, size, device=device)
    seq_lens = torch.randint(1, 4096, (64,), device=device)
    reporter = SwaDivergenceReporter(64, device=device, ring_size=8)
    r2t, mapping, rows, lens, _ = make_batch(8, 512, 256, 8 * 512 + 2, device)
    view = view_of(r2t, mapping, rows, lens, device)
    cuda = device.type == "cuda"

    def forward(with_reporter):
        y = x @ x
        if with_reporter:
            reporter.observe(KVPool.FULL, seq_lens.sum())
            reporter.observe(KVPool.SWA, seq_lens.clamp(max=1024).sum())
            reporter.step(view)  # ignored inside capture
        return y

    if not cuda:  # no graphs without CUDA: time the eager forward the same way
        plain = lambda: forward(False)  # noqa: E731
        inside = lambda: forward(True)  # noqa: E731
    else:
        graphs = {}
        for name, flag in (("plain", False), ("inside", True)):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(flag)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward(flag)
            graphs[name] = graph
        plain = graphs["plain"].replay

        def inside():
            graphs["inside"].replay()
            reporter.step(view)

    before = reporter.totals.tolist()
    got = interleaved({"plain": timed(plain, 20, sync), "inside": timed(inside, 20, sync)}, rounds)
    replays = 20 * (rounds + 1)
    reporter.close()
    sync()
    expected = int(seq_lens.sum()) * replays, int(seq_lens.clamp(max=1024).sum()) * replays
    after = reporter.totals.tolist()
    exact = (after[0] - before[0], after[1] - before[1]) == expected
    label = "captured graph replay" if cuda else "eager forward (no CUDA: no graph)"
    return [
        (f"capture: {label}, reporter inside / without", fmt(ratios(got["inside"], got["plain"]), 1, 3, "x"),
         f"{fmt(got['plain'], 1e6, 1)} us without"),
        ("capture: totals after the replays exact", "yes" if exact else "NO", f"{replays} replays, step() after each"),
    ]


def checks_rows(device, rounds, quick, sync):
    """The captured checks' cost per decode step at three model shapes (module docstring)."""
    from _decode_model import SHAPES, DecodeModel

    rows = []
    cuda = device.type == "cuda"
    conditional_ok = cuda
    for full_shape in SHAPES:
        shape = full_shape.small() if quick else full_shape
        model = DecodeModel(shape, device, checks=True)
        gate = model.reporter.gate
        label = f"captured checks, {full_shape.name}{' (small)' if quick else ''}"
        variants = {}
        if not cuda:
            def eager(flag, checks=True):
                def run():
                    gate.set(flag)
                    model.forward(checks)
                return run
            variants = {"plain": eager(False, False), "checks on, not sampled": eager(False),
                        "checks on, sampled": eager(True)}
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: every kernel once, eagerly (the checks masked)
                gate.force_recorded = True
                model.forward(False)
                model.forward(True)
                gate.force_recorded = False
            torch.cuda.current_stream().wait_stream(side)
            graphs = {}
            for name, mode, checks in (("plain", "masked", False), ("masked", "masked", True),
                                       ("conditional", "conditional", True)):
                if name == "conditional" and not conditional_ok:
                    continue
                gate.graph_mode = mode
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        model.forward(checks)
                    graphs[name] = graph
                except Exception as exc:  # conditional nodes need CUDA 12.4+ and torch's support
                    conditional_ok = False
                    rows.append((f"{label}: {name} graph", "not captured", f"{type(exc).__name__}: {str(exc)[:60]}"))
                    try:
                        torch.cuda.synchronize()
                    except Exception:
                        pass

            def replay(name, flag):
                def run():
                    gate.set(flag)
                    graphs[name].replay()
                return run

            variants["plain"] = replay("plain", False)
            for name in ("masked", "conditional"):
                if name in graphs:
                    variants[f"{name}, not sampled"] = replay(name, False)
                    variants[f"{name}, sampled"] = replay(name, True)
        got = interleaved({name: timed(fn, 20, sync) for name, fn in variants.items()}, rounds)
        step = "replay" if cuda else "eager step"
        rows.append((f"{label}: decode {step} without checks", fmt(got["plain"], 1e6, 1, " us"),
                     f"{len(shape.layers)} layers, batch {shape.batch}, context {shape.context}"))
        for name in variants:
            if name == "plain":
                continue
            added = [a - b for a, b in zip(got[name], got["plain"])]
            rows.append((f"{label}: {name} / without", fmt(ratios(got[name], got["plain"]), 1, 3, "x"),
                         f"{fmt(added, 1e6, 1)} us added per step"))
        del model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu-tests", default=None)
    args = parser.parse_args()
    one_thread()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds = 3 if args.quick else args.rounds
    rows = []
    if args.gpu_tests is not None:
        rows.append(("GPU tests (pytest -m gpu)", args.gpu_tests, ""))

    # hot path
    reporter = SwaDivergenceReporter(10**9, device=device)
    one = torch.tensor(1, device=device)
    got = interleaved({
        "tensor": timed(lambda: reporter.observe(KVPool.SWA, one), 2000, sync),
        "int": timed(lambda: reporter.observe(KVPool.FULL, 3), 2000, sync),
        "step": timed(lambda: reporter.step(None), 2000, sync),
    }, rounds)
    rows += [
        ("hot path: observe(pool, 0-dim device tensor)", fmt(got["tensor"], 1e6, 2, " us"), ""),
        ("hot path: observe(pool, int)", fmt(got["int"], 1e6, 2, " us"), "host add, no device op"),
        ("hot path: step, non-sampling", fmt(got["step"], 1e6, 2, " us"), ""),
    ]

    # the sample at 1M live tokens
    live = (1 << 16) if args.quick else (1 << 20)
    sample, live = per_token_sample(live, device)
    got = interleaved({"sample": timed(sample, 3, sync)}, rounds)
    ops = kernel_ops(sample)
    rows += [
        (f"sample: one sampling step, {live >> 10}K live tokens", fmt(got["sample"], 1e3, 3, " ms"),
         f"{fmt(got['sample'], 1e9 / live, 2)} ns / live token"),
        ("sample: device operations launched", str(ops), "tests/core/test_sample.py contract (+1 upload on CUDA)"),
    ]
    del sample  # the batch's tensors with it

    # against SGLang's two-pass dense gather, B256 x 32K at 10 %
    width = 4096 if args.quick else 32768
    batch = 256
    sampler = SwaDivergenceReporter(1, device=device, ring_size=8)
    r2t, mapping, req_rows, lens, _ = make_batch(batch, width, width // 10, batch * width // 5, device)
    view = view_of(r2t, mapping, req_rows, lens, device)
    seq_lens, rows_t = torch.tensor(lens, device=device), torch.tensor(req_rows, device=device)
    totals = torch.zeros(2, dtype=torch.int64, device=device)
    got = interleaved({"ours": timed(lambda: (sampler.step(view), sampler.flush()), 3, sync),
                       "sglang": timed(lambda: sglang_two_pass(r2t, mapping, rows_t, seq_lens, totals), 1, sync)}, rounds)
    rows.append((f"sample: SGLang's two-pass dense gather / otel-swa (B256 x {width >> 10}K, 10 %)",
                 fmt(ratios(got["sglang"], got["ours"]), 1, 1, "x"), f"{fmt(got['ours'], 1e3, 3)} ms otel-swa"))
    del r2t, mapping, view

    # audit added at 56K holders, 1M-slot FULL pool
    pool = (1 << 16) if args.quick else (1 << 20)
    r2t, mapping, req_rows, lens, holders = make_batch(56, 4096, 100 if args.quick else 1000, pool, device)
    free = healthy_swa_pool(mapping, holders, 8192, min(8000, holders.numel()))
    v_audit = view_of(r2t, mapping, req_rows, lens, device, SwaAuditInputs(free, 8192, 1, holders))
    v_plain = view_of(r2t, mapping, req_rows, lens, device)
    a, b = SwaDivergenceReporter(1, device=device, ring_size=8), SwaDivergenceReporter(1, device=device, ring_size=8)
    got = interleaved({"audit": timed(lambda: (a.step(v_audit), a.flush()), 3, sync),
                       "plain": timed(lambda: (b.step(v_plain), b.flush()), 3, sync)}, rounds)
    rows.append((f"sample: audit / no audit ({sum(lens) >> 10}K holders, FULL pool {pool:,})",
                 fmt(ratios(got["audit"], got["plain"]), 1, 2, "x"), f"{fmt(got['audit'], 1e3, 3)} ms with audit"))
    del r2t, mapping

    # the read check: one sliding-window layer's queries recomputed from the pool (eager; the GPU
    # test captures it in a graph)
    from bench_read_check import SHAPES, layer_call

    for name, batch_size, q_heads, kv_heads, dim, window, dtype in SHAPES[1:]:
        if args.quick:
            window = min(window, 64)
        call, queries = layer_call(batch_size, q_heads, kv_heads, dim, window, dtype, device)
        got = interleaved({"check": timed(call, 10, sync)}, rounds)
        rows.append((f"read check: one layer, {name}, {queries} queries, window {window}", fmt(got["check"], 1e6, 1, " us"),
                     "at sampled steps only (benchmarks/bench_read_check.py)"))

    rows += capture_rows(device, rounds, args.quick, sync)
    rows += checks_rows(device, rounds, args.quick, sync)
    print(machine_line())
    print(f"device {device}, {rounds} rounds interleaved, median (min - max){' [quick: small shapes]' if args.quick else ''}\n")
    print_table("otel-swa on one device", ("figure", "value", "note"), rows)


if __name__ == "__main__":
    main()
