"""The SWA slot audit in passes (``SwaAuditSweep``): each pass against a plain recount of the pool as it
was at the pass's first sample, faults found within the bound of ``otel_swa.device.audit``'s
docstring, work per sample independent of the pool, and the reporter's records."""

import math
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_swa.device.audit import AUDIT_COUNTS, AUDIT_WIDTH, SwaAuditSweep, holder_slots
from otel_swa.device.workspace import Workspace
from otel_swa.record import Offender
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.trace import TraceRequest
from otel_swa.reporter import SwaDivergenceReporter

from test_audit import check_offenders, recount


def random_state(rng, num_pages, page_size, full_size):
    """A pool state with faults of every kind possible: a mapping, a free list (duplicates and bad
    ids included, in random order, split into up to three tensors as an allocator keeps them) and
    holders."""
    swa_slots = (num_pages + 1) * page_size
    mapping = [0] + [rng.choice([0, rng.randrange(0, swa_slots + 3)]) for _ in range(full_size - 1)]
    free = [rng.randrange(-1, num_pages + 3) for _ in range(rng.randint(0, num_pages + 2))]
    holders = [rng.randrange(-2, full_size + 3) for _ in range(rng.randint(0, 40))]
    cuts = sorted(rng.randint(0, len(free)) for _ in range(rng.randint(0, 2)))
    parts = [free[a:b] for a, b in zip([0] + cuts, cuts + [len(free)])]
    return mapping, free, parts, holders


class Driver:
    """Stages one sample at a time through a sweep and keeps, for each pass, the state its first
    sample saw (what the pass's record must equal)."""

    def __init__(self, budget, pages, page_size):
        self.sweep = SwaAuditSweep("cpu", budget=budget)
        self.ws = Workspace("cpu")
        self.pages, self.page_size = pages, page_size
        self.origin = None
        self.samples = 0

    def sample(self, mapping, free_parts, holders, dtype=torch.int64):
        """One sample; returns ``(cells, origin state, first sample of the pass)`` when a pass
        ended here, else ``None``."""
        self.samples += 1
        mapping_t = torch.tensor(mapping)
        swa_slots = (self.pages + 1) * self.page_size
        out = torch.full((AUDIT_WIDTH,), -99, dtype=torch.int64)
        done = self.sweep.stage(
            out, lambda: holder_slots(mapping_t, torch.tensor(holders, dtype=dtype), swa_slots, self.ws),
            [torch.tensor(p, dtype=dtype) for p in free_parts], self.pages, self.page_size, self.ws)
        if self.sweep.started:
            self.origin = (list(mapping), [f for p in free_parts for f in p], list(holders), self.samples)
        return (out.tolist(), self.origin) if done else None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 12),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_every_pass_equals_a_recount_of_the_pool_at_its_first_sample(seed, page_size, budget, dtype):
    """The pool changes completely at every sample (a new mapping, free list and holders): each
    pass's counts and first offenders are exactly those of the state of its first sample."""
    rng = random.Random(seed)
    num_pages, full_size = rng.randint(1, 12), rng.randint(2, 60)
    driver = Driver(budget, num_pages, page_size)
    passes = 0
    for _ in range(40):
        mapping, free, parts, holders = random_state(rng, num_pages, page_size, full_size)
        got = driver.sample(mapping, parts, holders, dtype)
        if got is None:
            continue
        cells, (mapping0, free0, holders0, _) = got
        assert cells[:AUDIT_COUNTS] == recount(mapping0, free0, num_pages, page_size, holders0)
        check_offenders(cells, mapping0, free0, num_pages, page_size, holders0)
        passes += 1
    assert passes >= 1


def healthy_pool(rng, num_pages, holders_n):
    """A healthy page-size-1 state: ``holders_n`` FULL slots 1.. each on its own SWA slot, every
    other SWA slot free, the free list in random order (as a sort or a reuse would leave it)."""
    held = rng.sample(range(1, num_pages + 1), holders_n)
    mapping = [0] * (holders_n + 1)
    for full, swa in enumerate(held, start=1):
        mapping[full] = swa
    free = sorted(set(range(1, num_pages + 1)) - set(held))
    rng.shuffle(free)
    return mapping, free, list(range(1, holders_n + 1))


def test_a_fault_made_at_any_sample_of_a_pass_is_reported_within_the_bound():
    """Module docstring of the audit: a fault that lasts from sample ``t`` is reported by ``t +
    N_1 + N_2 - 2`` (``N_1`` the pass in progress at ``t``, ``N_2`` the next), whatever the order
    of the free list at each sample; no pass before it reports a fault."""
    budget, num_pages = 16, 200
    for kind in ("leak", "stale", "shared"):
        for t in range(1, 40):
            rng = random.Random(t)
            driver = Driver(budget, num_pages, 1)
            lengths, reported = [], None  # lengths: (first sample, samples) of each pass
            for sample in range(1, 200):
                mapping, free, holders = healthy_pool(rng, num_pages, 60)
                if sample >= t:  # the fault, made anew on each state from t on
                    if kind == "leak":
                        free = free[1:]  # a free page taken by nobody
                    elif kind == "stale":
                        free = free + [mapping[1]]  # a held page on the free list too
                    else:
                        mapping = mapping + [mapping[1]]  # another FULL slot mapped into a held SWA slot
                        holders = holders + [len(mapping) - 1]
                got = driver.sample(mapping, [free], holders)
                if got is None:
                    continue
                cells, origin = got
                lengths.append((origin[3], sample - origin[3] + 1))
                faulty = cells[2] or cells[3] or cells[4]
                if origin[3] < t:
                    assert not faulty, (kind, t, sample, cells)  # no false fault
                elif faulty:
                    reported = sample
                    break
            assert reported is not None, (kind, t)
            n1 = next(n for start, n in lengths if start <= t < start + n) if any(
                start <= t < start + n for start, n in lengths) else lengths[-1][1]
            n2 = lengths[-1][1]
            assert reported <= t + n1 + n2 - 2, (kind, t, reported, lengths)
            passes_bound = math.ceil(len(free) / budget) + math.ceil(num_pages / budget)
            assert max(n for _, n in lengths) <= passes_bound + 1


def test_work_per_sample_does_not_grow_with_the_pool():
    """Counted, not timed: with the same holders and free list, an SWA pool 64x larger takes the
    same operations, none larger than the holders or the budget (after the first pass, which makes
    the sweep's tables)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest, self.ops = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            self.ops += 1
            if func.is_view or any(result is arg for arg in args):  # a view, or an in-place write
                return result
            for value in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(value, torch.Tensor):
                    self.largest = max(self.largest, value.numel())
            return result

    budget, holders = 500, torch.arange(1, 301)
    largest, ops = [], []
    for pages in (1 << 12, 1 << 18):
        mapping = torch.arange(pages + 2) % 1000
        free = torch.arange(1000, 3000)
        sweep, ws = SwaAuditSweep("cpu", budget=budget), Workspace("cpu")
        out = torch.zeros(AUDIT_WIDTH, dtype=torch.int64)

        def one():
            return sweep.stage(out, lambda: holder_slots(mapping, holders, pages + 1, ws), free, pages, 1, ws)

        while not one():  # the first pass makes the tables
            pass
        with Sizes() as sizes:
            for _ in range(6):  # the first samples of the next pass: its start, then free-list chunks
                one()
        largest.append(sizes.largest)
        ops.append(sizes.ops)
    assert largest[0] == largest[1] <= budget and ops[0] == ops[1]


def test_the_holders_are_listed_only_at_the_first_sample_of_a_pass():
    calls = []
    sweep, ws = SwaAuditSweep("cpu", budget=8), Workspace("cpu")
    mapping = torch.arange(40) % 20
    out = torch.zeros(AUDIT_WIDTH, dtype=torch.int64)

    def holders():
        calls.append(1)
        return holder_slots(mapping, torch.arange(1, 10), 21, ws)

    records = sum(sweep.stage(out, holders, torch.arange(10, 20), 20, 1, ws) for _ in range(30))
    assert records == len(calls) == sweep.passes and sweep.last_pass_samples == math.ceil(10 / 8) + math.ceil(20 / 8)


# ----------------------------------------------------------------------- through the reporter


def run_engine(budget, fault_at=None, steps=160):
    config = EngineConfig(window=16, full_pool_size=4096, swa_pool_size=512, page_size=1, max_running=4,
                          token_budget=64, max_context_len=1024, run_model=False)
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: records.append(r)], audit_budget=budget)
    engine = ReferenceEngine(config, reporter=reporter)
    for rid in range(6):
        engine.submit(TraceRequest(arrival_s=0.0, context_tokens=40 + rid, generated_tokens=400), arrival_s=0.0)
    leaked = None
    for step in range(1, steps + 1):
        if step == fault_at:
            leaked = engine.pools._swa_free.pop()  # a page off the free list, given to nobody
        engine.step()
    reporter.flush()
    return records, leaked


def test_the_reporter_audits_a_large_pool_in_passes_each_record_of_a_pass_end():
    exact, _ = run_engine(budget=1 << 20)
    passes, _ = run_engine(budget=64)
    assert all(r.audited for r in exact)
    audited = [r for r in passes if r.audited]
    # a pass of about 512 free ids and 512 pages at 64 a sample: about 16 samples
    assert 6 <= len(audited) <= len(passes) // 10
    assert all((r.swa_leaked_slots, r.swa_stale_tokens, r.swa_shared_slots) == (0, 0, 0) for r in audited)
    assert all(r.swa_pages_in_use == r.swa_pages_referenced > 0 for r in audited)


def test_the_reporter_finds_a_leak_within_the_bound_and_names_the_page():
    records, leaked = run_engine(budget=64, fault_at=50)
    audited = [r for r in records if r.audited]
    first = next(r for r in audited if r.swa_leaked_slots)
    lengths = [b.forward_ct - a.forward_ct for a, b in zip(audited, audited[1:])]
    bound = 2 * max(lengths) - 2
    assert first.forward_ct - 50 <= bound
    assert first.swa_leaked_slots == 1 and first.offender("swa_leaked_slots") == Offender("swa_leaked_slots", swa_page=leaked)
    assert all(not r.swa_leaked_slots for r in audited if r.forward_ct < 50)


def test_passes_stay_exact_across_the_stamp_tables_wrap_and_a_pool_that_changes_size():
    """The stamp tables hold a byte per page: after 254 passes they are cleared and the stamps start
    over. Passes on both sides of each wrap, on pools of two sizes (a cell of the larger pool left
    from before a wrap must not pass for the current stamp), equal a recount of their first sample."""
    from otel_swa.device import audit as audit_module

    rng = random.Random(7)
    sweep, ws = SwaAuditSweep("cpu", budget=4), Workspace("cpu")
    origin, passes, wrapped = None, 0, 0
    sizes = (13, 5)
    while passes < 2 * (audit_module._STAMP_LIMIT - 1) + 20:
        num_pages = sizes[(passes // 97) % 2]  # the pool size changes now and then, between passes
        mapping, free, parts, holders = random_state(rng, num_pages, 1, 30)
        out = torch.full((AUDIT_WIDTH,), -99, dtype=torch.int64)
        mapping_t = torch.tensor(mapping)
        stamp_before = sweep._stamp
        done = sweep.stage(out, lambda: holder_slots(mapping_t, torch.tensor(holders, dtype=torch.int64), num_pages + 1, ws),
                           [torch.tensor(p, dtype=torch.int64) for p in parts], num_pages, 1, ws)
        if sweep.started:
            origin = (mapping, [f for p in parts for f in p], holders, num_pages)
            wrapped += sweep._stamp < stamp_before
        if done:
            mapping0, free0, holders0, pages0 = origin
            cells = out.tolist()
            assert cells[:AUDIT_COUNTS] == recount(mapping0, free0, pages0, 1, holders0), passes
            check_offenders(cells, mapping0, free0, pages0, 1, holders0)
            passes += 1
    assert wrapped == 2


def test_a_page_stamped_before_the_wrap_on_a_larger_pool_is_not_taken_for_one_of_a_later_pass():
    """Page 13 of a 13-page pool is stamped free and held by the last pass before the wrap; the wrap
    happens on a 5-page pool; when the 13-page pool is audited again, its pass with that same stamp
    must not find page 13 free or held: it is a leaked page there (in use, no holder)."""
    from otel_swa.device import audit as audit_module

    sweep, ws = SwaAuditSweep("cpu", budget=4), Workspace("cpu")
    sweep._stamp = audit_module._STAMP_LIMIT - 3  # (the wrap, reached without 250 passes first)

    def one_pass(num_pages, mapping, free, holders):
        out = torch.zeros(AUDIT_WIDTH, dtype=torch.int64)
        mapping_t, holders_t = torch.tensor(mapping), torch.tensor(holders, dtype=torch.int64)
        while not sweep.stage(out, lambda: holder_slots(mapping_t, holders_t, num_pages + 1, ws),
                              torch.tensor(free, dtype=torch.int64), num_pages, 1, ws):
            pass
        return out.tolist(), sweep._stamp

    # before the wrap, 13 pages: page 13 held (FULL slot 1) and on the free list
    _, stamped = one_pass(13, [0, 13, 2], list(range(3, 14)), [1, 2])
    one_pass(5, [0, 1, 2], [3, 4, 5], [1, 2])  # 5 pages
    one_pass(5, [0, 1, 2], [3, 4, 5], [1, 2])  # the wrap: the stamps start over
    # 13 pages again: page 13 in use and held by nobody, until a pass has the stamp page 13 kept
    mapping, free, holders = [0, 1, 2], list(range(3, 13)), [1, 2]
    expected = recount(mapping, free, 13, 1, holders)
    assert expected[2] == 1  # the leaked page
    while True:
        cells, stamp = one_pass(13, mapping, free, holders)
        assert cells[:AUDIT_COUNTS] == expected, stamp
        if stamp == stamped:
            break

