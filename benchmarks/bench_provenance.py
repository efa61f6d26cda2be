"""Cost of provenance (``otel_swa.device.provenance``): the stamps' and checksums' write path at every
step, the checks per call and per sampled step, memory per slot.

Prints (median over interleaved rounds, spread min - max; torch on one thread):

1. the write path every forward step pays (stamps of a decode batch, the checksum of one layer's K/V:
   every layer pays it with the default ``OTEL_SWA_PROVENANCE=all``), microseconds per call and device
   operations, at the engine suite's shapes
   (16 requests; 2 KV heads of 16, float32) and at batch 256; and the write path of a whole decode
   step (stamps + every layer's checksum) against that step (``_decode_model.py``'s decode step
   of the engine suite's Mellum, eager, and the real sglang Engine's decode step measured in
   BENCHMARKS.md section 8);
2. the checks, per call: the write check of one layer (8 tokens), the verification of a sample
   (both pools, at the engine suite's batch and at the budget's bound: 4096 slots a pool), its host
   part (the expected stamps: cache warm and cold), and the device operations of each;
3. a decode step of the engine suite's Mellum with every check on: not sampled (stamps and checksums
   only) and sampled (plus the write check, the read check and the sample's verification), against
   the step without otel-swa;
4. the reference engine at the engine suite's shapes with provenance on (its default) against off (interval 1 and
   20, every forward step timed: the whole engine step);
5. device memory per slot: the tables against the KV bytes a slot holds, at three model shapes;
6. the chain's collisions: pairs of random 64-token prefixes (vocabulary 512) whose last stamps agree
   while their tokens differ, against the 2**-20 per pair of uniform chains; a prefix against itself
   with two tokens swapped, and with a change that keeps the token sum (each should never agree).

Run: ``python benchmarks/bench_provenance.py [--rounds 7] [--quick]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, ratios, timed  # noqa: E402
from _decode_model import SHAPES, DecodeModel  # noqa: E402
from bench_sample import kernel_ops  # noqa: E402

from otel_swa.device.gate import SamplingGate  # noqa: E402
from otel_swa.device.provenance import PROVENANCE_WIDTH, KvProvenance  # noqa: E402
from otel_swa.device.write_check import LayerStore, WriteCheck  # noqa: E402
from otel_swa.views import SwaBatch  # noqa: E402

#: The real sglang Engine's decode step of the engine suite's model with otel-swa off (BENCHMARKS.md
#: section 8: 23.90 ms per step of 16 tokens, Intel Xeon, 2 cores), the denominator of the budget.
SGLANG_DECODE_STEP_MS = 23.90


class Cache:
    """A hybrid cache of ``batch`` requests of ``context`` tokens, stamped and hashed: FULL slot
    ``row * width + position + 1``, SWA slots a permutation, K/V ``[slots, kv_heads, dim]``."""

    def __init__(self, batch: int, context: int, kv_heads: int = 2, dim: int = 16, dtype=torch.float32,
                 budget: int = 4096, window: int = 9) -> None:
        gen = torch.Generator().manual_seed(0)
        self.batch, self.context, self.window = batch, context, window
        width = context + 8
        slots = batch * width + 1
        self.r2t = (torch.arange(batch * width, dtype=torch.int32) + 1).reshape(batch, width)
        self.mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots - 1, generator=gen) + 1])
        self.k = torch.randn((slots, kv_heads, dim), generator=gen).to(dtype)
        self.v = torch.randn((slots, kv_heads, dim), generator=gen).to(dtype)
        self.gate = SamplingGate("cpu")
        self.prov = KvProvenance("cpu", self.gate, full_slots=slots, swa_slots=slots, budget=budget)
        self.rows = torch.arange(batch)
        self.tokens = torch.randint(0, 50000, (batch, width), generator=gen)
        lens = torch.full((batch,), context)
        # every prefix stamped and hashed (one extend step)
        ids = self.tokens[:, :context].reshape(-1)
        positions = torch.arange(context).repeat(batch)
        loc = self.r2t[:, :context].reshape(-1).long()
        starts = torch.arange(batch) * context
        self.prov.stamp(input_ids=ids, positions=positions, out_cache_loc=loc, req_pool_indices=self.rows,
                        req_to_token=self.r2t, full_to_swa_index_mapping=self.mapping, extend_start_loc=starts)
        for swa in (False, True):
            self.prov.after_layer(layer_id=int(swa), swa=swa, k=self.k[loc] if not swa else self.k[self.mapping[loc]],
                                  v=self.v[loc] if not swa else self.v[self.mapping[loc]], k_buffer=self.k,
                                  v_buffer=self.v, out_cache_loc=loc, full_to_swa_index_mapping=self.mapping)
        # the decode step's inputs
        self.positions = lens.clone()
        self.loc = self.r2t[self.rows, self.positions].long()
        self.ids = self.tokens[self.rows, self.positions]
        self.new_k = torch.randn((batch, kv_heads * dim), generator=gen).to(dtype)
        self.new_v = torch.randn((batch, kv_heads * dim), generator=gen).to(dtype)
        self.lens = (lens + 1).tolist()
        self.view = SwaBatch(self.r2t, self.mapping, self.rows, lens + 1, seq_lens_cpu=self.lens,
                             sliding_window=window, request_ids=list(range(batch)),
                             token_ids=[self.tokens[i].numpy() for i in range(batch)])

    def stamp(self) -> None:
        self.prov.stamp(input_ids=self.ids, positions=self.positions, out_cache_loc=self.loc, req_pool_indices=self.rows,
                        req_to_token=self.r2t, full_to_swa_index_mapping=self.mapping)

    def checksum(self, swa: bool) -> None:
        self.prov.after_layer(layer_id=int(swa), swa=swa, k=self.new_k, v=self.new_v, k_buffer=self.k,
                              v_buffer=self.v, out_cache_loc=self.loc, full_to_swa_index_mapping=self.mapping)

    def verify(self, out: torch.Tensor) -> None:
        self.prov.stage(out, self.view)


def section_write_path(rounds: int, quick: bool) -> None:
    rows = []
    for batch in ((16, 64) if quick else (16, 256)):
        cache = Cache(batch, 160)
        calls = {"stamps": cache.stamp, "checksum, one layer": lambda c=cache: c.checksum(False)}
        got = interleaved({name: timed(fn, 200) for name, fn in calls.items()}, rounds)
        for name, fn in calls.items():
            rows.append((f"{name}, decode batch {batch}", str(kernel_ops(fn)), fmt(got[name], 1e6, 1)))
    print_table("1. the write path at every forward step (us per call)", ("call", "device ops", "us / call"), rows)
    print_table("1a. device operations of each in-forward check, per call, on the path a CUDA graph holds "
                "(engine suite's Mellum, 16 requests)", ("check", "device ops", "runs at"), recorded_ops())

    shape = SHAPES[0]
    plain, with_writes = DecodeModel(shape, "cpu", checks=False), DecodeModel(shape, "cpu", checks=True)
    got = interleaved({"plain": timed(plain.forward, 30), "writes": timed(with_writes.forward, 30)}, rounds)
    added = [a - b for a, b in zip(got["writes"], got["plain"])]
    rows = [
        ("decode step, no otel-swa", fmt(got["plain"], 1e3, 3), "-", "-"),
        ("decode step, stamps + checksums (not sampled)", fmt(got["writes"], 1e3, 3),
         fmt(ratios(got["writes"], got["plain"]), 1, 3, "x"), fmt(added, 1e6, 0, " us")),
    ]
    print_table(f"1b. a decode step of the {shape.name} (4 layers, 16 requests x 160 tokens, eager), ms", (
        "step", "ms / step", "ratio", "added"), rows)
    share = [a / (SGLANG_DECODE_STEP_MS * 1e-3) for a in added]
    print(f"the write path against the real sglang Engine's decode step of that model ({SGLANG_DECODE_STEP_MS} ms, "
          f"BENCHMARKS.md section 8): {fmt(share, 100, 2, ' %')} (budget 2 %)\n")


def warm_ops(fn) -> int:
    """Device operations of ``fn``'s second call (the first makes what is kept: constants, offsets)."""
    fn()
    return kernel_ops(fn)


def recorded_ops() -> list:
    """Device operations of each in-forward check on its recorded path (flag unset: what a replay of
    a step not sampled runs under ``graph_mode="masked"``)."""
    model = DecodeModel(SHAPES[0], "cpu", checks=True)
    gate, prov, s = model.reporter.gate, model.provenance, model.shape
    gate.force_recorded = True
    k_buf, v_buf = model.kv[0]
    k = torch.zeros((s.batch, s.kv_heads * s.head_dim))
    q = torch.zeros((s.batch, s.q_heads * s.head_dim))
    stamp = warm_ops(lambda: prov.stamp(input_ids=model.input_ids, positions=model.positions, out_cache_loc=model.loc,
                                          req_pool_indices=model.rows, req_to_token=model.req_to_token,
                                          full_to_swa_index_mapping=model.mapping))
    write = prov.write_check
    store = LayerStore(layer_id=0, swa=True, k=k, v=k, k_buffer=k_buf, v_buffer=v_buf, out_cache_loc=model.loc,
                       full_to_swa_index_mapping=model.mapping, positions=model.positions)
    write_check = warm_ops(lambda: write.check_layer(store))
    read_check = warm_ops(lambda: model.read_check.check_layer(
        layer_id=0, q=q, out=q, k_buffer=k_buf, v_buffer=v_buf, req_to_token=model.req_to_token,
        full_to_swa_index_mapping=model.mapping, req_pool_indices=model.rows, seq_lens=model.seq_lens,
        query_rows=None, window=s.window, scaling=1.0, num_q_heads=s.q_heads))
    plain = warm_ops(lambda: model.forward(False))
    gate.force_recorded = False
    gate.set(False)
    writes = warm_ops(lambda: model.forward(True)) - plain  # eager, not sampled: the stamps and every layer's fold
    layers = len(s.layers)
    return [
        ("the decode step itself (4 layers), for scale", str(plain), "every step"),
        ("stamps (both pools)", str(stamp), "every step (in a graph: every replay)"),
        (f"checksums of the {layers} layers (all: every layer; in the layers' order one copy each into the step "
         "buffer, 10 more at the step's last; prefix: one layer per pool)", str(writes - stamp),
         "every step (every replay)"),
        (f"the every-step write path of the decode step ({layers} layers: stamps + checksums)", str(writes),
         "every step (every replay)"),
        ("write check, one layer (x 2: one of each pool)", str(write_check),
         "eager: sampled steps; masked graph: every replay; conditional: sampled replays"),
        ("read check, one sliding-window layer (x 1)", str(read_check), "the same"),
    ]


def section_checks(rounds: int, quick: bool) -> None:
    rows = []
    cache = Cache(16, 160)
    gate = SamplingGate("cpu")
    gate.set(True)
    check = WriteCheck("cpu", gate)
    cache.k[cache.mapping[cache.loc]] = cache.new_k.view(-1, 2, 16)
    cache.v[cache.mapping[cache.loc]] = cache.new_v.view(-1, 2, 16)

    def write_check():
        check.check_layer(LayerStore(layer_id=1, swa=True, k=cache.new_k, v=cache.new_v, k_buffer=cache.k,
                                     v_buffer=cache.v, out_cache_loc=cache.loc, full_to_swa_index_mapping=cache.mapping,
                                     positions=cache.positions))
        check.take()

    out = torch.zeros(PROVENANCE_WIDTH, dtype=torch.int64)
    big = Cache(16 if quick else 64, 512 if quick else 2048)
    calls = {
        "write check, one layer (8 tokens)": write_check,
        "verification, 16 x 161 tokens (2,576 FULL + 144 SWA slots)": lambda: cache.verify(out),
        f"verification, {big.batch} x {big.context + 1} tokens (budget: 4,096 + 4,096 slots)": lambda: big.verify(out),
    }
    got = interleaved({name: timed(fn, 20) for name, fn in calls.items()}, rounds)
    for name, fn in calls.items():
        rows.append((name, str(kernel_ops(fn)), fmt(got[name], 1e6, 1)))

    # the host part alone: the expected stamps of 4096 positions of a 2048-token request
    tokens = big.tokens[0].numpy()
    warm = big.prov.chains
    cold = {"n": 0}

    lo = max(0, big.context - 2000)

    def host(cache_warm: bool):
        if cache_warm:
            warm.expected(0, tokens, lo, big.context + 1)
        else:
            cold["n"] += 1
            warm.expected(("cold", cold["n"]), tokens, lo, big.context + 1)

    got = interleaved({"warm": timed(lambda: host(True), 50), "cold": timed(lambda: host(False), 50)}, rounds)
    rows += [(f"host: expected stamps of {big.context + 1 - lo:,} positions, chain cache warm", "0", fmt(got["warm"], 1e6, 1)),
             (f"host: the same, cold (from position 0 of {big.context + 1})", "0", fmt(got["cold"], 1e6, 1))]
    print_table("2. the checks, per call (us)", ("call", "device ops", "us / call"), rows)


def sampled_decode_step(sampled: DecodeModel):
    """A sampled decode step of ``sampled`` (its gate set): the forward with every check, then the
    provenance verification of the batch's live slots and the checks' cells cleared."""
    shape = sampled.shape
    sampled.reporter.gate.set(True)
    out = torch.zeros(PROVENANCE_WIDTH, dtype=torch.int64)
    view = SwaBatch(sampled.req_to_token, sampled.mapping, sampled.rows, sampled.seq_lens,
                    seq_lens_cpu=sampled.seq_lens.tolist(), sliding_window=shape.window,
                    request_ids=list(range(shape.batch)),
                    token_ids=[np.zeros(shape.context + 1, dtype=np.int64)] * shape.batch)

    def sampled_step():
        sampled.forward()
        sampled.provenance.stage(out, view)
        sampled.take()

    return sampled_step


def section_sampled_step(rounds: int) -> None:
    shape = SHAPES[0]
    plain = DecodeModel(shape, "cpu", checks=False)
    quiet = DecodeModel(shape, "cpu", checks=True)
    sampled_step = sampled_decode_step(DecodeModel(shape, "cpu", checks=True))
    got = interleaved({"plain": timed(plain.forward, 20), "quiet": timed(quiet.forward, 20),
                       "sampled": timed(sampled_step, 20)}, rounds)
    rows = [("no otel-swa", fmt(got["plain"], 1e3, 3), "-", "-")]
    for name, label in (("quiet", "checks on, step not sampled (stamps, checksums)"),
                        ("sampled", "checks on, sampled step (+ write check, read check, verification)")):
        rows.append((label, fmt(got[name], 1e3, 3), fmt(ratios(got[name], got["plain"]), 1, 3, "x"),
                     fmt([a - b for a, b in zip(got[name], got["plain"])], 1e3, 3)))
    print_table(f"3. a decode step of the {shape.name}, eager, ms", ("step", "ms / step", "ratio to none",
                                                                      "ms added"), rows)
    added = [a - b for a, b in zip(got["sampled"], got["quiet"])]
    print(f"the sampled step's checks against the real sglang Engine's sampling step of that model "
          f"(about {SGLANG_DECODE_STEP_MS + 10:.0f} ms at interval 1, BENCHMARKS.md section 8): "
          f"{fmt([a / ((SGLANG_DECODE_STEP_MS + 10) * 1e-3) for a in added], 100, 1, ' %')} (budget 25 %)\n")


def section_engine(rounds: int, steps: int) -> None:
    from otel_swa.reference.engine import EngineConfig, ReferenceEngine
    from otel_swa.reference.trace import load_trace
    from otel_swa.reporter import SwaDivergenceReporter
    import time

    def run(interval: int, provenance: bool):
        def measure() -> float:
            reporter = SwaDivergenceReporter(interval)
            engine = ReferenceEngine(EngineConfig(window=9, num_heads=2, head_dim=16, max_running=16,
                                                  full_pool_size=16384, swa_pool_size=4096, token_budget=512,
                                                  max_context_len=4096, **({} if provenance else {"provenance": "off"})),
                                     reporter=reporter)
            for request in load_trace("conv", limit=16):
                engine.submit(request, arrival_s=0.0)
            for _ in range(10):
                engine.step()
            start = time.perf_counter()
            for _ in range(steps):
                if engine.step() is None:
                    break
            elapsed = (time.perf_counter() - start) / steps
            reporter.close()
            return elapsed
        return measure

    variants = {f"{i},{p}": run(i, p) for i in (1, 20) for p in (False, True)}
    got = interleaved(variants, rounds, warmup=0)
    rows = []
    for interval in (1, 20):
        off, on = got[f"{interval},False"], got[f"{interval},True"]
        rows.append((f"interval {interval}", fmt(off, 1e3, 3), fmt(on, 1e3, 3), fmt(ratios(on, off), 1, 3, "x")))
    print_table(f"4. reference engine, engine suite's shapes (window 9, 2 x 16 heads, 16 requests), {steps} steps "
                "after 10, ms per step", ("interval", "provenance off", "provenance on", "on / off"), rows)


def section_memory() -> None:
    rows = []
    for shape in SHAPES:
        size = torch.tensor([], dtype=shape.dtype).element_size()
        per_layer = 2 * shape.kv_heads * shape.head_dim * size
        for pool, layers in (("FULL", shape.layers.count(False)), ("SWA", shape.layers.count(True))):
            kv = layers * per_layer
            rows.append((shape.name, pool, str(layers), str(kv), "24", f"{100 * 24 / kv:.3f} %"))
    print_table("5. device memory per slot (bytes): stamps 8 + the checksum's two folds 16, against the slot's KV", (
        "model", "pool", "layers", "KV bytes / slot", "tables", "tables / KV"), rows)


def section_collisions(n: int) -> None:
    from otel_swa.device.stamps import CHAIN_MASK, mix_numpy

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (n, 64))
    positions = np.arange(64)

    def chains(t: np.ndarray) -> np.ndarray:
        return mix_numpy(t, positions).sum(axis=1) & CHAIN_MASK

    base = chains(tokens)
    swapped = tokens.copy()
    swapped[:, [3, 17]] = swapped[:, [17, 3]]
    differ = tokens[:, 3] != tokens[:, 17]
    shifted = tokens.copy()
    shifted[:, 5] += 1
    shifted[:, 9] -= 1
    pairs = n * (n - 1) // 2
    _, counts = np.unique(base, return_counts=True)
    collided = int((counts * (counts - 1) // 2).sum())
    rows = [(f"{n:,} random prefixes: pairs with the same chain", f"{collided:,} of {pairs:,}",
             f"{pairs / (1 << 20):,.1f} expected of uniform 20-bit chains"),
            ("a prefix against itself, two tokens swapped", f"{int((chains(swapped) == base)[differ].sum())} of "
             f"{int(differ.sum()):,}", "0 expected"),
            ("a prefix against itself, token sum kept", f"{int((chains(shifted) == base).sum())} of {n:,}",
             "0 expected")]
    print_table("6. the chain's collisions (64 tokens, vocabulary 512)", ("case", "collisions", "note"), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 rounds (a dry run)")
    parser.add_argument("--sections", default="1,2,3,4,5,6")
    args = parser.parse_args()
    one_thread()
    rounds = 3 if args.quick else args.rounds
    sections = set(args.sections.split(","))
    print(machine_line())
    print(f"{rounds} rounds interleaved, median (min - max)\n")
    if "1" in sections:
        section_write_path(rounds, args.quick)
    if "2" in sections:
        section_checks(rounds, args.quick)
    if "3" in sections:
        section_sampled_step(rounds)
    if "4" in sections:
        section_engine(rounds, 20 if args.quick else args.steps)
    if "5" in sections:
        section_memory()
    if "6" in sections:
        section_collisions(1 << 11 if args.quick else 1 << 14)


if __name__ == "__main__":
    main()
