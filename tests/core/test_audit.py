"""The SWA slot audit (leaked / stale / shared) against a plain-Python recount, and faults made on purpose."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_swa.device import DENSE_FILL_RATIO, STAGE_WIDTH, read_sample, stage_sample
from otel_swa.device.audit import AUDIT_COUNTS, AUDIT_WIDTH, audit_counts
from otel_swa.device.workspace import Workspace
from otel_swa.views import SwaAuditInputs
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.trace import TraceRequest
from otel_swa.record import Offender
from otel_swa.reporter import SwaDivergenceReporter


def recount(mapping, free_pages, num_pages, page_size, holders):
    free = {p for p in free_pages if 1 <= p <= num_pages}
    swa_slots = (num_pages + 1) * page_size
    referenced, stale, users = set(), 0, {}
    for full in holders:
        swa = mapping[full] if 0 <= full < len(mapping) else 0
        if 0 < swa < swa_slots:
            referenced.add(swa // page_size)
            stale += swa // page_size in free
    for full in {f for f in holders if 0 <= f < len(mapping)}:  # FULL slot 0 is read like any other
        swa = mapping[full]
        if 0 < swa < swa_slots:
            users[swa] = users.get(swa, 0) + 1
    in_use = set(range(1, num_pages + 1)) - free
    referenced.discard(0)
    return [len(in_use), len(in_use & referenced), len(in_use - referenced), stale, sum(n > 1 for n in users.values())]


def check_offenders(cells, mapping, free_pages, num_pages, page_size, holders):
    """The first offenders after the counts name real offenders (module docstring of the audit):
    the lowest leaked page, the first stale holder, a shared SWA slot and a FULL slot mapped into it."""
    counts = recount(mapping, free_pages, num_pages, page_size, holders)
    leaked_index, stale_at, stale_full, stale_swa, shared_swa, shared_full = cells[AUDIT_COUNTS:]
    free = {p for p in free_pages if 1 <= p <= num_pages}
    swa_slots = (num_pages + 1) * page_size
    swa_of = lambda full: mapping[full] if 0 <= full < len(mapping) else 0  # noqa: E731
    if counts[2]:
        referenced = {swa_of(f) // page_size for f in holders if 0 < swa_of(f) < swa_slots}
        leaked = sorted(set(range(1, num_pages + 1)) - free - referenced)
        assert leaked_index + 1 == leaked[0]
    if counts[3]:
        first = next(i for i, f in enumerate(holders) if 0 < swa_of(f) < swa_slots and swa_of(f) // page_size in free)
        assert (stale_at, stale_full, stale_swa) == (first, holders[first], swa_of(holders[first]))
    if counts[4]:
        fulls = {f for f in holders if swa_of(f) == shared_swa}
        assert 0 < shared_swa < swa_slots and len(fulls) >= 2 and shared_full in fulls


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 2, 4]),
       free_dtype=st.sampled_from([torch.int32, torch.int64]), holder_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_audit_counts_equal_plain_recount(seed, page_size, free_dtype, holder_dtype):
    rng = random.Random(seed)
    num_pages = rng.randint(1, 12)
    full_size = rng.randint(2, 60)
    swa_slots = (num_pages + 1) * page_size
    # mapping[0] is 0 in the engines; any other value is read as it is (FULL slot 0 is read like any other)
    slot0 = rng.choice([0, 0, rng.randrange(0, swa_slots + 3)])
    mapping = [slot0] + [rng.choice([0, rng.randrange(0, swa_slots + 3)]) for _ in range(full_size - 1)]
    free = rng.sample(range(1, num_pages + 1), rng.randint(0, num_pages))
    holders = [rng.randrange(-2, full_size + 3) for _ in range(rng.randint(0, 40))]
    out = torch.full((AUDIT_WIDTH,), 99, dtype=torch.int64)
    audit_counts(out, torch.tensor(mapping), torch.tensor(free, dtype=free_dtype), num_pages, page_size,
                 torch.tensor(holders, dtype=holder_dtype))
    assert out.tolist()[:AUDIT_COUNTS] == recount(mapping, free, num_pages, page_size, holders)
    check_offenders(out.tolist(), mapping, free, num_pages, page_size, holders)


# One workspace for every example, its tables first filled with noise: the audit never relies on
# what a table holds from an earlier audit (or from nothing).
_SHARED = Workspace("cpu")
for _name, _dtype in (("audit.free", torch.bool), ("audit.present", torch.bool), ("audit.shared", torch.bool),
                      ("audit.swa", torch.int64), ("audit.swa", torch.int32)):
    _SHARED.get(_name, 128, _dtype).copy_(torch.randint(-5, 50, (128,)).to(_dtype))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 2, 4]))
def test_audit_with_a_reused_workspace_equals_plain_recount(seed, page_size):
    rng = random.Random(seed)
    num_pages = rng.randint(1, 12)
    full_size = rng.randint(2, 60)
    swa_slots = (num_pages + 1) * page_size
    mapping = [0] + [rng.choice([0, rng.randrange(0, swa_slots + 3)]) for _ in range(full_size - 1)]
    # duplicates and out-of-range ids in the free list too
    free = [rng.randrange(-1, num_pages + 3) for _ in range(rng.randint(0, num_pages + 2))]
    holders = [rng.randrange(-2, full_size + 3) for _ in range(rng.randint(0, 40))]
    out = torch.full((AUDIT_WIDTH,), 99, dtype=torch.int64)
    audit_counts(out, torch.tensor(mapping), torch.tensor(free, dtype=torch.int64), num_pages, page_size,
                 torch.tensor(holders, dtype=torch.int64), _SHARED)
    expected = recount(mapping, free, num_pages, page_size, holders)
    assert out.tolist()[:AUDIT_COUNTS] == expected
    check_offenders(out.tolist(), mapping, free, num_pages, page_size, holders)


def test_audit_cost_does_not_grow_with_the_pool():
    """O(live holders + free list): the same holders and free list against a 64x larger pool take
    the same device operations, none of them sized by the pool (counted, not timed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.is_view or any(result is arg for arg in args):  # a view, or an in-place write of n cells
                return result
            for value in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(value, torch.Tensor):
                    self.largest = max(self.largest, value.numel())
            return result

    largest = []
    for pool in (1 << 12, 1 << 18):
        mapping = torch.arange(pool + 2) % 1000
        out = torch.zeros(AUDIT_WIDTH, dtype=torch.int64)
        ws = Workspace("cpu")
        holders, free = torch.arange(1, 301), torch.arange(500, 600)
        audit_counts(out, mapping, free, 999, 1, holders, ws)  # tables made here, once
        with Sizes() as sizes:
            audit_counts(out, mapping, free, 999, 1, holders, ws)
        largest.append(sizes.largest)
    # the largest is the holders (300) or the SWA pool's 999 page cells (1,000 slot cells), never the pool
    assert largest[0] == largest[1] <= 1000


def test_prefix_sharing_is_not_a_shared_slot():
    mapping = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    out = torch.zeros(AUDIT_WIDTH, dtype=torch.int64)
    # FULL 6 held twice (prefix sharing): fine; FULL 4 and 5 both map to SWA 1: shared
    audit_counts(out, mapping, torch.tensor([], dtype=torch.int64), 2, 1, torch.tensor([4, 5, 6, 6]))
    assert out.tolist()[:AUDIT_COUNTS] == [2, 2, 0, 0, 1]
    shared_swa, shared_full = out.tolist()[AUDIT_COUNTS + 4:]
    assert shared_swa == 1 and shared_full in {4, 5}


# ----------------------------------------------------------------------- faults in the reference engine


def run_engine(fault, page_size, with_fault=False):
    config = EngineConfig(window=16, full_pool_size=4096, swa_pool_size=512, page_size=page_size,
                          max_running=4, token_budget=64, max_context_len=1024, run_model=False)
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: records.append(r)])
    engine = ReferenceEngine(config, reporter=reporter)
    for rid in range(3):
        engine.submit(TraceRequest(arrival_s=0.0, context_tokens=40 + rid, generated_tokens=30), arrival_s=0.0)
    for _ in range(6):
        engine.step()
    reporter.flush()
    healthy = records[-1]
    measure = fault(engine)
    engine.step()
    reporter.flush()
    if with_fault:
        return healthy, records[-1], measure(engine), measure
    return healthy, records[-1], measure(engine)


def leak_a_page(engine):
    """Take a page off the SWA free list and give it to nobody (the #27789 shape)."""
    page = engine.pools._swa_free.pop()
    measure = lambda engine: engine.pools.page_size  # noqa: E731
    measure.page = page
    return measure


def free_a_live_page(engine, reuse_next):
    """Put a page that live tokens still map into back on the free list (the #27586 shape): at the
    back (stays free: its tokens are stale) or at the front (handed out at the next allocation:
    two FULL slots then share an SWA slot). Returns a function counting, after the step, the live tokens mapping into the page."""
    pools = engine.pools
    slots = max(pools.requests.values(), key=lambda s: s.seq_len)
    page = slots.swa_pages[-1]
    (pools._swa_free.appendleft if reuse_next else pools._swa_free.append)(page)

    def live_tokens_in_page(engine):  # measured after the step (a decode may add one to the page)
        mapping = pools.full_to_swa_index_mapping.tolist()
        fulls = [f for r in pools.requests.values() for f in pools.req_to_token[r.row, : r.seq_len].tolist()]
        return sum(1 for f in fulls if mapping[f] and mapping[f] // pools.page_size == page)

    live_tokens_in_page.page = page
    live_tokens_in_page.owner = next(req.rid for req in engine.running if req.slots is slots)
    return live_tokens_in_page


@pytest.mark.parametrize("page_size", [1, 4])
def test_leaked_page_is_reported(page_size):
    healthy, record, leaked, fault = run_engine(leak_a_page, page_size, with_fault=True)
    assert (healthy.swa_leaked_slots, healthy.swa_stale_tokens, healthy.swa_shared_slots) == (0, 0, 0)
    assert record.swa_leaked_slots == leaked
    assert record.swa_stale_tokens == 0
    # where: the page taken off the free list (the only leaked one)
    assert healthy.offenders == ()
    assert record.offenders == (Offender("swa_leaked_slots", swa_page=fault.page),)


@pytest.mark.parametrize("page_size", [1, 4])
def test_stale_mapping_is_reported(page_size):
    healthy, record, live_in_page, fault = run_engine(lambda e: free_a_live_page(e, reuse_next=False), page_size,
                                                      with_fault=True)
    assert (healthy.swa_leaked_slots, healthy.swa_stale_tokens) == (0, 0)
    assert live_in_page >= 1
    assert record.swa_stale_tokens == live_in_page
    assert record.swa_leaked_slots == 0
    # where: a token of the request whose page was freed, on that page (the batch's tokens are the
    # first holders: the request and the position are named)
    (offender,) = record.offenders
    assert offender.fault == "swa_stale_tokens" and offender.swa_page == fault.page
    assert offender.request == str(fault.owner) and offender.swa_slot // page_size == fault.page


def test_reused_live_page_shows_as_shared_slots():
    healthy, record, live_in_page, fault = run_engine(lambda e: free_a_live_page(e, reuse_next=True), 1,
                                                      with_fault=True)
    assert healthy.swa_shared_slots == 0
    assert live_in_page == 2  # the old token and the new one
    assert record.swa_shared_slots == 1  # the new token and the old one now write one SWA slot
    shared = record.offender("swa_shared_slots")
    assert shared.swa_slot == shared.swa_page == fault.page


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    page_size=st.sampled_from([1, 2, 4]),
    path=st.sampled_from(["live", "dense", "no host lengths"]),
    map_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_batch_holders_from_the_samples_gathers_equal_a_recount_of_every_holder(seed, page_size, path, map_dtype):
    """holders_include_batch: the batch's live tokens are holders through the sample's own
    gathers (live or dense path), the others are listed; the counts equal a recount over the
    batch's live FULL slots plus the listed ones."""
    rng = random.Random(seed)
    num_pages = rng.randint(1, 12)
    full_size = rng.randint(2, 60)
    swa_slots = (num_pages + 1) * page_size
    mapping = [0] + [rng.choice([0, rng.randrange(0, swa_slots + 3)]) for _ in range(full_size - 1)]
    num_rows, width = rng.randint(1, 5), rng.randint(1, 16)
    req_to_token = [[rng.randrange(0, full_size) for _ in range(width)] for _ in range(num_rows)]
    rows = [rng.randrange(0, num_rows) for _ in range(rng.randint(0, 2 * num_rows))]
    lens = [rng.choice([0, width, rng.randint(0, width)]) for _ in rows]
    others = [rng.randrange(-2, full_size + 3) for _ in range(rng.choice([0, rng.randint(0, 30)]))]
    free = [rng.randrange(-1, num_pages + 3) for _ in range(rng.randint(0, num_pages + 2))]
    audit = SwaAuditInputs(torch.tensor(free, dtype=torch.int64), num_pages, page_size,
                           torch.tensor(others, dtype=torch.int64), holders_include_batch=True)
    out = torch.full((STAGE_WIDTH,), -7, dtype=torch.int64)
    meta = stage_sample(
        out, torch.tensor([0, 0]), torch.tensor(req_to_token, dtype=torch.int32), torch.tensor(mapping, dtype=map_dtype),
        torch.tensor(rows, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64),
        None if path == "no host lengths" else lens, audit, workspace=_SHARED,
        dense_fill_ratio={"live": float("inf"), "dense": 0.0}.get(path, DENSE_FILL_RATIO),
    )
    reading = read_sample(out.tolist(), meta)
    assert reading.faults == ()
    batch_holders = [req_to_token[row][pos] for row, length in zip(rows, lens) for pos in range(length)]
    assert list(reading.audit) == recount(mapping, free, num_pages, page_size, batch_holders + others)


class AuditComparer:
    """Stands in for the engine's reporter (the engine calls ``observe`` and ``step``): at every
    step, inside it (where the view is valid), stages the sample with the engine's audit inputs
    and, separately, audits every request's FULL slots read off the engine's bookkeeping."""

    def __init__(self):
        self.engine = None
        self.compared = 0

    def observe(self, pool, count):
        pass

    def step(self, view, context=None):
        view = view() if callable(view) else view
        listed = view.swa_audit
        assert listed.holders_include_batch
        pools = self.engine.pools
        every = [f for s in pools.requests.values() for f in pools.req_to_token[s.row, : s.seq_len].tolist()]
        got = torch.zeros(STAGE_WIDTH, dtype=torch.int64)
        meta = stage_sample(got, torch.zeros(2, dtype=torch.int64), view.req_to_token, view.full_to_swa_index_mapping,
                            view.req_pool_indices, view.seq_lens, view.seq_lens_cpu, listed,
                            req_pool_indices_cpu=view.req_pool_indices_cpu)
        free = listed.swa_free_page_ids  # the engine gives it to be read when the audit asks
        free = free() if callable(free) else free
        expected = recount(view.full_to_swa_index_mapping.tolist(), free.tolist(),
                           listed.num_swa_pages, listed.page_size, every)
        assert list(read_sample(got.tolist(), meta).audit) == expected
        self.compared += 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_reference_engines_audit_with_batch_holders_equals_a_recount_of_every_request(page_size):
    """The reference engine lists only the requests outside the step and marks the batch's tokens
    as holders: every step's audit equals a recount over every request's FULL slots."""
    config = EngineConfig(window=16, full_pool_size=4096, swa_pool_size=512, page_size=page_size,
                          max_running=4, token_budget=48, max_context_len=1024, run_model=False)
    comparer = AuditComparer()
    engine = ReferenceEngine(config, reporter=comparer)
    comparer.engine = engine
    for rid in range(10):
        engine.submit(TraceRequest(arrival_s=0.0, context_tokens=20 + 9 * rid, generated_tokens=12 + rid), arrival_s=0.0)
    engine.run_until_done()
    assert comparer.compared == engine.stats.forward_steps > 20
    # (the reference scheduler runs every request holding KV at every step, so nothing is listed
    # beside the batch here; listed holders beside it are covered by the test above)


def test_full_slot_0_counts_alike_listed_and_from_the_batch():
    """FULL slot 0 is read like any other slot on both paths (engines keep its mapping 0; here it
    is not): listed as holders, or as the batch's live tokens through the sample's gathers."""
    mapping = torch.tensor([2, 6])
    req_to_token = torch.tensor([[0, 0, 0]], dtype=torch.int32)
    free = torch.zeros(0, dtype=torch.int64)
    listed = torch.zeros(AUDIT_WIDTH, dtype=torch.int64)
    audit_counts(listed, mapping, free, 2, 2, torch.tensor([0, 0]))
    staged = torch.zeros(STAGE_WIDTH, dtype=torch.int64)
    meta = stage_sample(staged, torch.zeros(2, dtype=torch.int64), req_to_token, mapping, torch.tensor([0]), torch.tensor([2]), [2],
                        SwaAuditInputs(free, 2, 2, torch.zeros(0, dtype=torch.int64), holders_include_batch=True))
    # pages 1 and 2 in use; FULL slot 0 maps to SWA slot 2, on page 1: referenced, page 2 leaked
    reading = read_sample(staged.tolist(), meta)
    assert listed.tolist()[:AUDIT_COUNTS] == list(reading.audit) == [2, 1, 1, 0, 0]
    assert listed.tolist()[AUDIT_COUNTS] + 1 == reading.audit_where["leaked_page_index"] + 1 == 2
