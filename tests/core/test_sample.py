"""The lean sample: both gathers (live, dense) against a plain recount, and its device operations
counted per sample (each one a kernel launch on a GPU: the count is a contract)."""

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from otel_swa.device import DENSE_FILL_RATIO, STAGE_WIDTH, Workspace, read_sample, stage_sample
from otel_swa.device.audit import AUDIT_WIDTH, audit_counts
from otel_swa.reporter import KVPool, SwaDivergenceReporter
from otel_swa.views import SwaAuditInputs, SwaBatch

from live_tally import tallied_by


def recount(req_to_token, mapping, rows, lens):
    divergence = out_of_window = 0
    for row, length in zip(rows, lens):
        for pos in range(length):
            swa = mapping[req_to_token[row][pos]]
            out_of_window += swa == 0
            divergence += swa != 0 and swa != req_to_token[row][pos]
    return divergence, out_of_window


def random_batch(rng, num_rows, width, full_size):
    req_to_token = [[rng.randrange(0, full_size) for _ in range(width)] for _ in range(num_rows)]
    # mapping[0] is 0 in the engines (FULL slot 0 is their padding slot) but any value is read
    # as it is: the sample must count the tokens at FULL slot 0 by it
    slot0 = rng.choice([0, 0, rng.randrange(1, full_size + 3)])
    mapping = [slot0] + [rng.choice([0, slot, rng.randrange(1, full_size)]) for slot in range(1, full_size)]
    rows = [rng.randrange(0, num_rows) for _ in range(rng.randint(1, 2 * num_rows))]  # repeats allowed
    lens = [rng.choice([0, width, rng.randint(0, width)]) for _ in rows]
    return req_to_token, mapping, rows, lens


SHARED = Workspace("cpu")  # one workspace for every example: buffers grow and are reused


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    path=st.sampled_from(["live", "dense", "no host lengths"]),
    host_rows=st.booleans(),
    r2t_dtype=st.sampled_from([torch.int32, torch.int64]),
    map_dtype=st.sampled_from([torch.int32, torch.int64]),
    tally=st.sampled_from(["cumsum", "counts"]),
)
def test_both_gathers_equal_the_recount(seed, path, host_rows, r2t_dtype, map_dtype, tally):
    """``tally``: the live path's masks counted by its one cumsum (few live tokens) or by flat counts (many)."""
    rng = random.Random(seed)
    num_rows, width, full_size = rng.randint(1, 6), rng.randint(1, 24), rng.choice([1, 2, rng.randint(3, 80)])
    req_to_token, mapping, rows, lens = random_batch(rng, num_rows, width, full_size)
    out = torch.full((STAGE_WIDTH,), -7, dtype=torch.int64)
    with tallied_by(tally):
        meta = stage_sample(
            out, torch.tensor([11, 5]), torch.tensor(req_to_token, dtype=r2t_dtype),
            torch.tensor(mapping, dtype=map_dtype), torch.tensor(rows), torch.tensor(lens, dtype=torch.int32),
            None if path == "no host lengths" else lens, req_pool_indices_cpu=rows if host_rows else None,
            workspace=SHARED, dense_fill_ratio={"live": float("inf"), "dense": 0.0}.get(path, DENSE_FILL_RATIO),
        )
    reading = read_sample(out.tolist(), meta)
    assert reading.faults == ()
    assert (reading.verify_full, reading.verify_swa) == (11, 5)
    assert (reading.divergence, reading.out_of_window) == recount(req_to_token, mapping, rows, lens)
    if path != "no host lengths" and sum(lens):
        assert meta.path == path


def test_the_fill_ratio_chooses_the_gather():
    req_to_token = torch.arange(1, 41, dtype=torch.int32).reshape(4, 10)
    mapping = torch.arange(41)
    out = torch.zeros(STAGE_WIDTH, dtype=torch.int64)
    paths = []
    assert 0.9 < DENSE_FILL_RATIO <= 29 / 30  # the fills below straddle it
    for lens in ([1, 1, 1], [10, 10, 7], [10, 10, 9], [10, 10, 10]):  # fill 0.1, 0.9, 0.97, 1.0 of 3 x 10
        meta = stage_sample(out, torch.zeros(2, dtype=torch.int64), req_to_token, mapping, torch.tensor([1, 2, 3]),
                            torch.tensor(lens), lens)
        paths.append(meta.path)
        assert read_sample(out.tolist(), meta).out_of_window == 0
    assert paths == ["live", "live", "dense", "dense"]


# ------------------------------------------------------------------------------ operations per sample

#: Operations that only describe memory (no kernel on a GPU, no pass over data).
_VIEWS = {"slice", "select", "view", "unsqueeze", "alias", "as_strided", "lift_fresh", "detach", "_reshape_alias", "expand"}


class KernelOps(TorchDispatchMode):
    """The aten operations dispatched, views left out."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _VIEWS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def ops_of_one_sample(view):
    reporter = SwaDivergenceReporter(2)
    reporter.step(view)
    reporter.step(view)  # first sample: buffers made
    reporter.step(view)
    with KernelOps() as counted:
        reporter.step(view)
    assert reporter.stats.samples_delivered == 2 and reporter.stats.invalid_samples == 0
    return counted.ops


def batch(host_lengths=True, host_rows=False, fill=0.1, audit=False):
    width = 100
    req_to_token = torch.arange(1, 801, dtype=torch.int32).reshape(8, width)
    mapping = torch.arange(801) % 97
    lens = [int(width * fill)] * 7
    rows = list(range(1, 8))
    swa_audit = SwaAuditInputs(torch.arange(90, 97), 96, 1, req_to_token[1:].reshape(-1)) if audit else None
    return SwaBatch(
        req_to_token, mapping, torch.tensor(rows), torch.tensor(lens), lens if host_lengths else None,
        swa_audit=swa_audit, req_pool_indices_cpu=rows if host_rows else None,
    )


# The contract. Live gather, rows and lengths known on the host: 12 operations compute the sample
# (the flat index: fill_, scatter_add_, cumsum; the two gathers and the widening copy of the FULL
# slots between them; one ne giving s != 0, s != f and f != 0; one cumsum over the masks, the gather
# of its counted offsets, a sum and a sub: every count; one cat into the staged slot), 2 give the
# evidence of a bad view (the FULL slots' range, and the ne of the entries whose seq_lens differs
# from seq_lens_cpu; the clamp that keeps the mapping's gather in bounds runs on the CPU only when
# a FULL slot is out of range, always on other devices), and 1 copies the staged slot to the host
# ring. On CUDA one more: the upload of the host offsets. Without host rows, 4 more: their range,
# their clamp, and the two operations that turn them into index jumps. Above TALLY_ALL_MAX live
# tokens, 3 more (s != f, f != 0 and the lengths counted flat).
CONTRACT = {
    "live, host rows and lengths": (batch(host_rows=True), 15),
    "live, host lengths": (batch(), 19),
    "dense, host lengths (fill 0.97)": (batch(fill=0.97), 17),
    "dense, no host lengths": (batch(host_lengths=False), 18),
}


@pytest.mark.parametrize("case", list(CONTRACT))
def test_device_operations_per_sample_are_the_contract(case):
    view, most = CONTRACT[case]
    ops = ops_of_one_sample(view)
    assert len(ops) <= most, ops
    # req_to_token (rows or tokens), then the mapping; the live path's counts are one more gather,
    # of the masks' cumsum at the counted offsets
    assert ops.count("index_select") == (3 if case.startswith("live") else 2)


def test_the_audit_adds_its_own_operations_and_none_sized_by_the_pool():
    plain = ops_of_one_sample(batch(host_rows=True))
    audited = ops_of_one_sample(batch(host_rows=True, audit=True))
    extra = len(audited) - len(plain)
    # the counts (30 at most) and their first offenders (10 at most: three first-index reductions,
    # the leaked-page mask and the gathers of the offenders' slots)
    assert 0 < extra <= 40, audited


def test_batch_holders_are_not_gathered_twice():
    """With holders_include_batch the audit takes the batch's SWA slots from the sample's own
    mapping gather: its gathers are the free-list lookup and the owner read-back only (listed
    holders add the gather of their SWA slots from the mapping)."""
    listed_view = batch(host_rows=True, audit=True)
    batch_held = SwaAuditInputs(listed_view.swa_audit.swa_free_page_ids, 96, 1, torch.zeros(0, dtype=torch.int64),
                                holders_include_batch=True)
    plain = ops_of_one_sample(batch(host_rows=True))
    listed = ops_of_one_sample(listed_view)
    held = ops_of_one_sample(dataclasses.replace(listed_view, swa_audit=batch_held))
    view = listed_view

    def offenders(holders):
        """One-element gathers of the first offenders' slots: stale SWA and FULL slots when a holder
        is stale, the shared FULL slot when a slot is shared (on the CPU only for a count above 0)."""
        out = torch.zeros(AUDIT_WIDTH, dtype=torch.int64)
        audit_counts(out, view.full_to_swa_index_mapping, view.swa_audit.swa_free_page_ids, 96, 1, holders)
        stale, shared = out.tolist()[3:5]
        return 2 * (stale > 0) + (shared > 0)

    lens = view.seq_lens.tolist()
    batch_tokens = torch.cat([view.req_to_token[row, :n] for row, n in zip(view.req_pool_indices.tolist(), lens)])
    assert offenders(view.swa_audit.holder_full_slots) == 3  # the listed holders: stale and shared
    assert listed.count("index_select") == plain.count("index_select") + 3 + 3
    assert held.count("index_select") == plain.count("index_select") + 2 + offenders(batch_tokens)
    assert len(held) < len(listed)


def test_observe_with_an_int_is_no_device_operation():
    reporter = SwaDivergenceReporter(1)
    with KernelOps() as counted:
        for _ in range(100):
            reporter.observe(KVPool.FULL, 3)
            reporter.observe("swa", 2)
    assert counted.ops == []
    assert reporter.totals.tolist() == [300, 200]
