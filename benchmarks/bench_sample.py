"""The sample's cost side by side: audit, live vs dense, against SGLang's gather, per live token, ops.

Prints six tables (each figure the median over interleaved rounds, spread min - max; torch on one
thread):

1. **audit / no audit**: sampling ``reporter.step`` calls with the SWA slot audit over its inputs
   against the same steps without, 56K live tokens (56 requests x 1000) that are also the holders,
   8000 of them in the window (each on its own SWA slot), the SWA pool sized as SGLang sizes it
   (``swa_full_tokens_ratio`` 0.8 of the FULL pool, page size 1: 52K / 839K / 3.36M slots at FULL
   pools of 65K / 1M / 4M, the free list every slot no holder maps to: 44K / 831K / 3.35M ids),
   and an SWA pool of 128K slots with 57K holders of which 54K in the window (74K free); with the
   holders listed (the audit gathers each one's SWA slot, as for SGLang's view) and with the
   batch's tokens as the holders (``holders_include_batch``, as for the reference engine). Each
   measurement is the mean step over whole passes of the audit (``SwaAuditSweep``: a pass's first
   sample reads the holders, the others a budget of the free list and the page cells), at least 5
   steps; the audit's ``samples / pass`` is printed beside it;
2. **gather vs dense** at 100 % fill: the sample as chosen per sample (auto), and the live gather
   forced, each over the project's own dense (whole-row) gather of the same batch;
3. **vs SGLang**: the dense gather SGLang's reporter does (``req_to_token[req_pool_indices]``, then
   the mapping, masked, once for the divergence and once more for the out-of-window count, a fresh
   host buffer and a blocking read) over otel-swa's sample, batch 256 x 32K at 10 % fill;
4. **per live token**: ns per live token of one sample at 1M live tokens (and, with ``--large``, 7M
   and 30M), batch 256, fill 1/8, FULL slots drawn at random from a pool twice the live tokens, and
   the device operations per sample (the contract of ``tests/core/test_sample.py``);
5. **window check / none**: one sampling ``reporter.step`` whose view gives its ``sliding_window``
   and per-request ``extend_lens_cpu`` (premature evictions and late-held SWA slots counted, :mod:`otel_swa.device.window`) against
   the same view without one, on the live gather (1M live tokens, batch 256, fill 1/8), the dense
   gather (fill 0.97) and the dense gather without host lengths, with the device operations of each;
6. **the floor**: table 4's 1M-token sample against the two reads any sample must make, each one
   ``index_select``: the live tokens' FULL slots from ``req_to_token`` (rows read in order), and
   their SWA slots from the mapping at those FULL slots (read at random: the costly one); the two
   together (with the int32 -> int64 widening between them) are the floor.

Run: ``python benchmarks/bench_sample.py [--rounds 7] [--device cpu] [--large] [--quick] [--sections 1,...]``;
``PYTHONPATH=<an older revision's root> python benchmarks/bench_sample.py --sections 3,6`` times that
revision's reporter the same way (tables 3, 4 and 6 use only its public API).
(``--quick``: small shapes and 3 rounds, to check that it runs.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, ratios, timed  # noqa: E402

from otel_swa.device import STAGE_WIDTH, stage_sample  # noqa: E402

try:
    from otel_swa.device import DENSE_FILL_RATIO, Workspace
except ImportError:  # a revision before them, on PYTHONPATH: tables 3, 4 and 6 (the reporter's public API) only
    DENSE_FILL_RATIO = Workspace = None
from otel_swa.reporter import SwaDivergenceReporter  # noqa: E402
from otel_swa.views import SwaAuditInputs, SwaBatch  # noqa: E402


def make_batch(batch: int, width: int, live_per_request: int, pool: int, device, seed: int = 0, swa_slots: int | None = None):
    """``req_to_token`` int32 ``[batch + 1, width]`` whose live positions hold distinct FULL slots drawn
    from ``1 .. pool - 1``, a mapping int64 ``[pool + 2]`` (a third 0, a third identity, a third
    remapped into ``1 .. swa_slots``), rows ``1 .. batch`` and their lengths."""
    gen = torch.Generator().manual_seed(seed)
    live = batch * live_per_request
    slots = torch.randperm(pool - 1, generator=gen)[:live].to(torch.int32) + 1
    req_to_token = torch.zeros(batch + 1, width, dtype=torch.int32)
    req_to_token[1:, :live_per_request] = slots.view(batch, live_per_request)
    swa_slots = swa_slots or pool
    kind = torch.randint(0, 3, (pool + 2,), generator=gen)
    mapping = torch.where(kind == 0, 0, torch.where(kind == 1, torch.arange(pool + 2), torch.randint(1, swa_slots, (pool + 2,), generator=gen)))
    mapping[0] = 0
    if swa_slots < pool:
        mapping = mapping.clamp(max=swa_slots - 1)
    rows = list(range(1, batch + 1))
    lens = [live_per_request] * batch
    return (req_to_token.to(device), mapping.to(device), rows, lens, slots.long().to(device))


#: Table 1's shapes: (label, FULL pool, SWA pool slots, requests x live tokens, holders in the window).
AUDIT_SHAPES = (
    ("SGLang-sized, FULL 65,536", 65536, int(0.8 * 65536), (56, 1000), 8000),
    ("SGLang-sized, FULL 1,048,576", 1 << 20, int(0.8 * (1 << 20)), (56, 1000), 8000),
    ("SGLang-sized, FULL 4,194,304", 1 << 22, int(0.8 * (1 << 22)), (56, 1000), 8000),
    ("SWA pool 131,072, 57K holders", 163840, 131072, (57, 1000), 54 * 1024),
)


def audit_case(full_pool: int, swa_pages: int, shape, in_window: int, device, quick: bool = False):
    """Table 1's inputs (also ``bench_audit_checkouts.py``'s): ``(req_to_token, mapping, rows, lens,
    holders, free)`` of a healthy pool (:func:`healthy_swa_pool`)."""
    batch, per_request = shape
    if quick:
        per_request, in_window = per_request // 10, in_window // 10
        full_pool, swa_pages = max(full_pool // 16, 4 * batch * per_request), swa_pages // 16
    r2t, mapping, rows, lens, holders = make_batch(batch, 4096, per_request, full_pool, device)
    free = healthy_swa_pool(mapping, holders, swa_pages, min(in_window, holders.numel()))
    return r2t, mapping, rows, lens, holders, free


def healthy_swa_pool(mapping, holders, swa_pages: int, in_window: int, seed: int = 1):
    """Make ``mapping`` (in place) a healthy SWA state for the audit: ``in_window`` of the holders
    map to distinct SWA slots ``1 .. swa_pages`` (page size 1), every other FULL slot to 0 (out of the
    window). Returns the SWA free list (the slots no holder maps to), ``int64`` on the device."""
    gen = torch.Generator().manual_seed(seed)
    mapping.zero_()
    chosen = holders[torch.randperm(holders.numel(), generator=gen)[:in_window].to(holders.device)]
    slots = torch.randperm(swa_pages, generator=gen)[:in_window] + 1
    mapping[chosen] = slots.to(mapping.device)
    free = torch.ones(swa_pages + 1, dtype=torch.bool)
    free[0] = False
    free[slots] = False
    return torch.nonzero(free).reshape(-1).to(mapping.device)


def view_of(req_to_token, mapping, rows, lens, device, audit=None, host=True) -> SwaBatch:
    # (an older revision's SwaBatch may lack the host rows: they are left out there)
    rows_cpu = {"req_pool_indices_cpu": rows if host else None} if "req_pool_indices_cpu" in SwaBatch.__dataclass_fields__ else {}
    return SwaBatch(
        req_to_token, mapping, torch.tensor(rows, device=device), torch.tensor(lens, device=device),
        lens if host else None, swa_audit=audit, **rows_cpu,
    )


def per_token_sample(live: int, device, batch: int = 256):
    """The per-live-token case (table 4, and ``gpu_figures.py``): about ``live`` live tokens over
    ``batch`` requests at fill 1/8, rows and lengths on the host, FULL slots drawn from a pool twice
    the live tokens. Returns one sampling ``step`` and its ``flush`` as a function, and the live
    tokens each sample counts."""
    per_request = live // batch
    r2t, mapping, rows, lens, _ = make_batch(batch, per_request * 8, per_request, 2 * live, device)
    view = view_of(r2t, mapping, rows, lens, device)
    reporter = SwaDivergenceReporter(1, device=device, ring_size=8)

    def one():
        reporter.step(view)
        reporter.flush()

    return one, batch * per_request


def sglang_two_pass(req_to_token, mapping, rows, seq_lens, totals):
    """SGLang's per-sample work, written the way its reporter gathers: the dense rows and their
    mapping once per count, then a fresh host tensor and a blocking read."""
    def gathered():
        dense = req_to_token[rows]
        positions = torch.arange(dense.shape[1], device=dense.device)
        mask = positions[None, :] < seq_lens[:, None]
        return dense, mapping[dense], mask

    dense, swa, mask = gathered()
    out_of_window = ((swa == 0) & mask).sum()
    dense, swa, mask = gathered()
    divergence = ((swa != dense) & mask & (swa != 0)).sum()
    staged = torch.stack([totals[0], totals[1], divergence, out_of_window])
    pinned = staged.device.type == "cuda"
    host = torch.empty(4, dtype=torch.int64, pin_memory=pinned)
    host.copy_(staged, non_blocking=pinned)
    if pinned:
        torch.cuda.synchronize()
    return host.tolist()


def kernel_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"slice", "select", "view", "unsqueeze", "alias", "as_strided", "lift_fresh", "detach", "_reshape_alias", "expand"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in views:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--large", action="store_true", help="also 7M and 30M live tokens, and batch 256 x 131K")
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 rounds (a dry run)")
    parser.add_argument("--sections", default="1,2,3,4,5,6", help="which tables to print (default all: 1,2,3,4,5,6)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    one_thread()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds = 3 if args.quick else args.rounds
    print(machine_line())
    print(f"device {device}, {rounds} rounds, interleaved; median (min - max)\n")

    ws = Workspace(device) if Workspace is not None else None
    out = torch.zeros(STAGE_WIDTH, dtype=torch.int64, device=device)
    totals = torch.zeros(2, dtype=torch.int64, device=device)

    if "1" in sections:
        # 1. audit / no audit: the holders listed (every one gathered by the audit, as the SGLang
        # view gives them), or the batch's tokens as holders through the sample's own gathers
        # (holders_include_batch, as the reference engine gives them; none listed)
        rows_out = []
        for label, full_pool, swa_pages, shape, in_window in AUDIT_SHAPES:
            r2t, mapping, rows, lens, holders, free = audit_case(full_pool, swa_pages, shape, in_window, device, args.quick)
            pages = swa_pages // 16 if args.quick else swa_pages
            listed = SwaAuditInputs(free, pages, 1, holders)
            batch_held = SwaAuditInputs(free, pages, 1, holders[:0], holders_include_batch=True)
            reporters = {name: SwaDivergenceReporter(1, device=device, ring_size=8) for name in ("listed", "batch", "plain")}
            views = {"listed": view_of(r2t, mapping, rows, lens, device, listed),
                     "batch": view_of(r2t, mapping, rows, lens, device, batch_held),
                     "plain": view_of(r2t, mapping, rows, lens, device)}

            def step(reporter, view):
                reporter.step(view)
                reporter.flush()

            step(reporters["listed"], views["listed"])
            while reporters["listed"]._audit_sweep.in_progress:  # one whole pass: its length
                step(reporters["listed"], views["listed"])
            per_pass = reporters["listed"]._audit_sweep.last_pass_samples
            steps = per_pass * max(1, -(-5 // per_pass))  # whole passes, at least 5 steps
            got = interleaved({
                name: timed(lambda name=name: step(reporters[name], views[name]), steps, sync) for name in views
            }, rounds, warmup=2)  # the first shape of a process runs slow for a few rounds (allocator, caches)
            rows_out.append((label, f"{sum(lens) // 1000}K / {free.numel() / 1000:.0f}K", str(per_pass),
                             fmt(got["listed"], 1e3, 3), fmt(got["batch"], 1e3, 3), fmt(got["plain"], 1e3, 3),
                             fmt(ratios(got["listed"], got["plain"]), 1, 2, "x"), fmt(ratios(got["batch"], got["plain"]), 1, 2, "x")))
            del r2t, mapping, views, reporters
        print_table("1. SWA slot audit / no audit (mean sampling step over whole passes of the audit, ms; holders listed, or the batch's tokens through the sample's gathers)",
                    ("pool", "holders / free", "samples / pass", "audit, listed", "audit, batch", "without", "listed / none",
                     "batch / none"), rows_out)

    if "2" in sections:
        # 2. gather vs dense at 100 % fill
        shapes = [(1, 32768), (256, 32768)] + ([(256, 131072)] if args.large else [])
        if args.quick:
            shapes = [(1, 4096), (64, 4096)]
        rows_out = []
        for batch, width in shapes:
            r2t, mapping, rows, lens, _ = make_batch(batch, width, width, batch * width + 2, device)
            seq_lens = torch.tensor(lens, device=device)
            req_rows = torch.tensor(rows, device=device)

            def sample(ratio):
                return lambda: stage_sample(out, totals, r2t, mapping, req_rows, seq_lens, lens, req_pool_indices_cpu=rows,
                                            workspace=ws, dense_fill_ratio=ratio)

            got = interleaved({
                "auto": timed(sample(DENSE_FILL_RATIO), 1, sync), "live": timed(sample(float("inf")), 1, sync), "dense": timed(sample(0.0), 1, sync),
            }, rounds)
            rows_out.append((f"B{batch} x {width // 1024}K", fmt(got["dense"], 1e3, 2), fmt(ratios(got["dense"], got["auto"]), 1, 2, "x"),
                             fmt(ratios(got["dense"], got["live"]), 1, 2, "x")))
            del r2t, mapping
        print_table("2. at 100 % fill: the project's dense gather over the sample as chosen, and over the live gather forced",
                    ("shape", "dense ms", "dense / chosen", "dense / live forced"), rows_out)

        # 2b. where the two cross: dense over live by fill ratio, and which one the sample takes
        rows_out = []
        for batch, width in ([(16, 2048)] if args.quick else [(256, 8192), (16, 32768)]):
            for fill in (0.5, 0.75, 0.85, 0.9, 0.95):
                live = int(width * fill)
                r2t, mapping, rows, lens, _ = make_batch(batch, width, live, batch * width + 2, device)
                seq_lens, req_rows = torch.tensor(lens, device=device), torch.tensor(rows, device=device)

                def forced(ratio):
                    return lambda: stage_sample(out, totals, r2t, mapping, req_rows, seq_lens, lens, req_pool_indices_cpu=rows,
                                                workspace=ws, dense_fill_ratio=ratio)

                got = interleaved({"live": timed(forced(float("inf")), 1, sync), "dense": timed(forced(0.0), 1, sync)}, rounds)
                chosen = "dense" if live >= DENSE_FILL_RATIO * width else "live"
                rows_out.append((f"B{batch} x {width // 1024}K", f"{fill:.2f}", fmt(ratios(got["dense"], got["live"]), 1, 2, "x"), chosen))
                del r2t, mapping
        print_table(f"2b. dense / live by fill ratio (the sample gathers the whole rows from {DENSE_FILL_RATIO:.2f} on)",
                    ("shape", "fill", "dense / live", "chosen"), rows_out)

    if "3" in sections:
        # 3. against SGLang's two-pass dense gather, B256 x 32K, 10 % fill
        batch, width = (64, 4096) if args.quick else (256, 32768)
        r2t, mapping, rows, lens, _ = make_batch(batch, width, width // 10, batch * width // 10 * 2, device)
        seq_lens, req_rows = torch.tensor(lens, device=device), torch.tensor(rows, device=device)
        reporter = SwaDivergenceReporter(1, device=device, ring_size=8)
        view = view_of(r2t, mapping, rows, lens, device)

        def ours():
            reporter.step(view)
            reporter.flush()

        got = interleaved({"ours": timed(ours, 3, sync), "sglang": timed(lambda: sglang_two_pass(r2t, mapping, req_rows, seq_lens, totals), 1, sync)}, rounds)
        print_table(f"3. SGLang's two-pass dense gather over otel-swa's sample (B{batch} x {width // 1024}K, 10 % fill; ms)",
                    ("SGLang", "otel-swa", "SGLang / otel-swa"),
                    [(fmt(got["sglang"], 1e3, 2), fmt(got["ours"], 1e3, 3), fmt(ratios(got["sglang"], got["ours"]), 1, 1, "x"))])
        del r2t, mapping

    if "4" in sections:
        # 4. per live token, and device operations per sample
        sizes = [1 << 20] + ([7 << 20, 30 << 20] if args.large else [])
        if args.quick:
            sizes = [1 << 16]
        rows_out = []
        for live in sizes:
            one, counted = per_token_sample(live, device)
            got = interleaved({"sample": timed(one, 1, sync)}, rounds)
            ops = kernel_ops(one)
            rows_out.append((f"{live / (1 << 20):.0f}M", fmt(got["sample"], 1e3, 2), fmt(got["sample"], 1e9 / counted, 1), str(ops)))
            del one  # the batch's tensors with it
        print_table("4. one sample per live token (batch 256, fill 1/8, rows and lengths on the host)",
                    ("live tokens", "ms", "ns / live token", "device ops"), rows_out)

    if "5" in sections:
        # 5. the window check against none, same batch, same reporter kind
        batch = 256
        live = (1 << 16) if args.quick else (1 << 20)
        per_request = live // batch
        rows_out = []
        for label, width, host in (("live, fill 1/8", per_request * 8, True), ("dense, fill 0.97", int(per_request / 0.97), True),
                                   ("dense, no host lengths", int(per_request / 0.97), False)):
            r2t, mapping, rows, lens, _ = make_batch(batch, width, per_request, 2 * live, device)
            plain = view_of(r2t, mapping, rows, lens, device, host=host)
            windowed = SwaBatch(plain.req_to_token, plain.full_to_swa_index_mapping, plain.req_pool_indices, plain.seq_lens,
                                plain.seq_lens_cpu, req_pool_indices_cpu=plain.req_pool_indices_cpu,
                                sliding_window=per_request // 4, swa_eviction_allowance=16,
                                # per request, as the engines give it: decodes and a prefill chunk in eight
                                extend_lens_cpu=[1 if i % 8 else 512 for i in range(batch)])
            reporters = {name: SwaDivergenceReporter(1, device=device, ring_size=8) for name in ("window", "none")}

            def step(name, view):
                def run():
                    reporters[name].step(view)
                    reporters[name].flush()
                return run

            got = interleaved({"window": timed(step("window", windowed), 1, sync), "none": timed(step("none", plain), 1, sync)},
                              rounds, warmup=2)
            ops = (kernel_ops(step("window", windowed)), kernel_ops(step("none", plain)))
            rows_out.append((label, fmt(got["window"], 1e3, 2), fmt(got["none"], 1e3, 2),
                             fmt(ratios(got["window"], got["none"]), 1, 2, "x"), f"{ops[0]} / {ops[1]}"))
            del r2t, mapping, plain, windowed
        print_table(f"5. window check / none (one sampling step, batch {batch}, {live / (1 << 20):.2f}M live tokens; ms)",
                    ("gather", "with window", "without", "window / none", "device ops"), rows_out)

    if "6" in sections:
        # 6. the sample against its floor: every live token's FULL slot must be read from req_to_token
        # (one gather) and its SWA slot from the mapping (a second, dependent gather)
        live = (1 << 16) if args.quick else (1 << 20)
        one, counted = per_token_sample(live, device)
        per_request = live // 256
        r2t, mapping, rows, lens, _ = make_batch(256, per_request * 8, per_request, 2 * live, device)
        flat = (torch.tensor(rows, device=device)[:, None] * r2t.shape[1]
                + torch.arange(per_request, device=device)[None, :]).reshape(-1)
        full = torch.empty(flat.numel(), dtype=r2t.dtype, device=device)
        wide = torch.empty(flat.numel(), dtype=torch.int64, device=device)
        swa = torch.empty(flat.numel(), dtype=mapping.dtype, device=device)
        table = r2t.reshape(-1)

        def one_gather():
            torch.index_select(table, 0, flat, out=full)

        def mapping_gather():
            torch.index_select(mapping, 0, wide, out=swa)

        def two_gathers():
            torch.index_select(table, 0, flat, out=full)
            wide.copy_(full)
            torch.index_select(mapping, 0, wide, out=swa)

        two_gathers()  # the FULL slots in ``wide`` for the mapping's gather alone
        got = interleaved({"sample": timed(one, 1, sync), "one": timed(one_gather, 1, sync),
                           "mapping": timed(mapping_gather, 1, sync), "two": timed(two_gathers, 1, sync)}, rounds, warmup=2)
        print_table(f"6. the sample against its floor ({counted / (1 << 20):.0f}M live tokens, batch 256, fill 1/8; ms)",
                    ("sample", "req_to_token gather", "mapping gather", "both gathers", "sample / mapping gather",
                     "sample / both gathers"),
                    [(fmt(got["sample"], 1e3, 2), fmt(got["one"], 1e3, 2), fmt(got["mapping"], 1e3, 2), fmt(got["two"], 1e3, 2),
                      fmt(ratios(got["sample"], got["mapping"]), 1, 2, "x"), fmt(ratios(got["sample"], got["two"]), 1, 2, "x"))])
        del one, r2t, mapping


if __name__ == "__main__":
    main()
