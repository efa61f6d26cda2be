"""Cost of the read check (``otel_swa.device.read_check``) on this machine's device.

Prints (median over interleaved rounds, spread min - max; torch on one thread):

1. one ``ReadCheck.check_layer`` call, microseconds, at three attention shapes: the SGLang engine
   suite's tiny Mellum model (4 requests, 4 query / 2 KV heads, head dim 16, window 8, float32),
   a GPT-OSS-like layer (8 queries, 64 / 8 heads, head dim 64, window 128) and a Gemma-3-like one
   (window 1024, 16 / 8 heads, head dim 256, bfloat16: the 16 MiB budget caps the queries);
2. a sampling forward step of the reference engine configured with the engine suite's model shapes
   (window 8, 2 heads of 16, 4 running requests, every step sampled): the step with the read check
   (``rotate``: its one sliding-window layer) against the same step with it ``off``, engines built
   alike and run in turn each round, and the ratio round by round; the check's own time per step
   from the reporter's perspective is the difference;
3. detection and false faults: 16 queries a shape and dtype, the engine's output made by
   ``torch.nn.functional.scaled_dot_product_attention`` (a correct kernel other than the check's
   own arithmetic) over the mapping's window, then over a window one and two positions long or
   short and with one key of the window read from another request's slot; the count of queries
   flagged of 16 (a correct read must show 0; sharper attention, scaling x 4, as trained models
   have, is shown apart).

Run: ``python benchmarks/bench_read_check.py [--rounds 7] [--steps 200] [--device cpu]``
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, ratios, timed  # noqa: E402

from otel_swa.device.read_check import ReadCheck, read_counts  # noqa: E402

SHAPES = (
    # name, batch, q heads, kv heads, head dim, window, dtype
    ("engine suite's Mellum (batch 4)", 4, 4, 2, 16, 8, torch.float32),
    ("GPT-OSS-like (8 queries)", 8, 64, 8, 64, 128, torch.float32),
    ("Gemma-3-like, bfloat16", 8, 16, 8, 256, 1024, torch.bfloat16),
)


def layer_call(batch, q_heads, kv_heads, dim, window, dtype, device):
    """A pool, a mapping and an engine output of the shape; returns the check call and its queries."""
    gen = torch.Generator().manual_seed(0)
    width = window + 16
    slots = batch * width + 1
    req_to_token = (torch.arange(batch * width, dtype=torch.int32) + 1).reshape(batch, width).to(device)
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots - 1, generator=gen) + 1]).to(device)
    k = torch.randn((slots, kv_heads, dim), generator=gen).to(device, dtype)
    v = torch.randn((slots, kv_heads, dim), generator=gen).to(device, dtype)
    q = torch.randn((batch, q_heads * dim), generator=gen).to(device, dtype)
    out = torch.randn((batch, q_heads * dim), generator=gen).to(device, dtype)
    rows = torch.arange(batch, device=device)
    lens = torch.full((batch,), width, device=device)
    check = ReadCheck(device, max_queries=8)

    def call():
        check.check_layer(layer_id=0, q=q, out=out, k_buffer=k, v_buffer=v, req_to_token=req_to_token,
                          full_to_swa_index_mapping=mapping, req_pool_indices=rows, seq_lens=lens, query_rows=None,
                          window=window, scaling=1 / math.sqrt(dim), num_q_heads=q_heads)
        check.take()

    return call, min(check.max_queries, batch)


#: Shapes of section 3: window, KV heads, query heads, head dim.
DETECTION_SHAPES = ((128, 8, 64, 64), (1024, 1, 8, 256), (4096, 8, 32, 128))


def flagged(dtype: torch.dtype, window: int, kv_heads: int, q_heads: int, dim: int, queries: int = 16) -> dict:
    """Queries the check flags, of ``queries``, for a correct read and for each misread (section 3)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(window + dim)
    width = window + 40
    slots = queries * width + 1
    req_to_token = (torch.arange(queries * width, dtype=torch.int32) + 1).reshape(queries, width)
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots - 1, generator=gen) + 1])
    k = torch.randn((slots, kv_heads, dim), generator=gen).to(dtype)
    v = torch.randn((slots, kv_heads, dim), generator=gen).to(dtype)
    q = torch.randn((queries, q_heads, dim), generator=gen).to(dtype)
    rows = torch.arange(queries)
    lens = torch.full((queries,), width)
    last = width - 1

    def kernel(scale: float, shift: int = 0, stray: bool = False) -> torch.Tensor:
        out = torch.empty_like(q)
        for i in range(queries):
            read = window + shift  # keys this kernel reads, its own included
            swa = mapping[req_to_token[i, max(0, last - read + 1):last + 1].long()]
            if stray:  # one key mid-window read from the next request's slot
                swa = swa.clone()
                swa[len(swa) // 2] = mapping[int(req_to_token[(i + 1) % queries, 5])]
            keys, values = k[swa].transpose(0, 1), v[swa].transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(q[i].unsqueeze(1), keys, values, scale=scale, enable_gqa=True)[:, 0]
        return out

    def count(out: torch.Tensor, scale: float) -> int:
        check = ReadCheck("cpu", max_queries=queries)
        check.check_layer(layer_id=0, q=q, out=out, k_buffer=k, v_buffer=v, req_to_token=req_to_token,
                          full_to_swa_index_mapping=mapping, req_pool_indices=rows, seq_lens=lens, query_rows=None,
                          window=window, scaling=scale, num_q_heads=q_heads)
        return read_counts(check.take().tolist())[1]

    scale = 1 / math.sqrt(dim)
    return {
        "correct": count(kernel(scale), scale),
        "window +1": count(kernel(scale, 1), scale),
        "window -1": count(kernel(scale, -1), scale),
        "window +2": count(kernel(scale, 2), scale),
        "1 stray key": count(kernel(scale, stray=True), scale),
        "correct, sharp": count(kernel(4 * scale), 4 * scale),
        "window -1, sharp": count(kernel(4 * scale, -1), 4 * scale),
    }


def engine_steps(read_check: str, steps: int, device: str):
    """A measurement: seconds per sampling step of a fresh reference engine (engine suite's shapes)."""
    from otel_swa.reference.engine import EngineConfig, ReferenceEngine
    from otel_swa.reference.trace import TraceRequest, load_trace
    from otel_swa.reporter import SwaDivergenceReporter

    def measure() -> float:
        reporter = SwaDivergenceReporter(1, device=device)
        config = EngineConfig(window=8, full_pool_size=4096, swa_pool_size=4096, max_running=4, token_budget=64,
                              max_context_len=2048, num_heads=2, head_dim=16, read_check=read_check)
        engine = ReferenceEngine(config, reporter=reporter, device=device)
        for request in load_trace("conv", limit=64):  # scaled down as the engine suite does (drive_engine.py)
            engine.submit(TraceRequest(0.0, 16 + min(max(request.context_tokens // 32, 4), 24),
                                       min(max(request.generated_tokens // 3, 16), 48)), arrival_s=0.0)
        for _ in range(20):  # warm: buffers made, prompts prefilled
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = (time.perf_counter() - start) / steps
        reporter.close()
        return elapsed

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    one_thread()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(machine_line())
    print()
    calls = {name: layer_call(*shape, device) for name, *shape in SHAPES}
    results = interleaved({name: timed(call, number=20, sync=sync) for name, (call, _) in calls.items()}, args.rounds)
    rows = [[name, str(calls[name][1]), str(window), fmt(results[name], 1e6)]
            for name, _, _, _, _, window, _ in SHAPES]
    print_table("1. one check_layer call (and take), us", ["shape", "queries", "window", "us / call"], rows)

    steps = interleaved({mode: engine_steps(mode, args.steps, args.device) for mode in ("off", "rotate")}, args.rounds)
    ratio = ratios(steps["rotate"], steps["off"])
    added = [a - b for a, b in zip(steps["rotate"], steps["off"])]
    print_table(
        "2. reference engine, engine suite's shapes (window 8, 2 x 16 heads, 4 requests), every step sampled",
        ["read check", "ms / sampling step", "ratio to off", "added ms / step"],
        [["off", fmt(steps["off"], 1e3, 3), "1", "-"],
         ["rotate (8 queries max, 1 layer)", fmt(steps["rotate"], 1e3, 3), fmt(ratio, 1, 3), fmt(added, 1e3, 3)]],
    )

    rows, header = [], None
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for window, kv_heads, q_heads, dim in DETECTION_SHAPES:
            counts = flagged(dtype, window, kv_heads, q_heads, dim)
            header = header or list(counts)
            rows.append([str(dtype).removeprefix("torch."), f"{window} ({q_heads}/{kv_heads} x {dim})"]
                        + [str(n) for n in counts.values()])
    print_table("3. queries flagged of 16 (SDPA as the engine's kernel)", ["dtype", "window (heads x dim)"] + header, rows)


if __name__ == "__main__":
    main()
