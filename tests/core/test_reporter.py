"""The reporter against a plain-Python recount, its delivery order, flush, and failure handling."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from recount_support import recount

from otel_swa.device import FAULTS, DeviceToHostRing
from otel_swa.sampling import SampleLayout
from otel_swa.record import SwaDivergenceRecord
from otel_swa.reporter import KVPool, SwaDivergenceReporter
from otel_swa.views import SwaBatch


def random_state(rng: random.Random, num_rows=6, width=12, full_size=40):
    """A random engine state: req_to_token rows of FULL slots and a FULL->SWA mapping with
    zeros (evicted), identities and remaps."""
    req_to_token = [[0] * width for _ in range(num_rows)]
    for row in range(1, num_rows):
        for pos in range(width):
            req_to_token[row][pos] = rng.randrange(0, full_size)
    mapping = [0] * full_size
    for slot in range(1, full_size):
        kind = rng.random()
        mapping[slot] = 0 if kind < 0.3 else slot if kind < 0.6 else rng.randrange(1, full_size)
    batch = rng.randint(0, num_rows - 1)
    rows = rng.sample(range(1, num_rows), batch)
    lens = [rng.randint(0, width) for _ in rows]
    return req_to_token, mapping, rows, lens


def make_view(req_to_token, mapping, rows, lens, host_lens, dtype=torch.int32):
    return SwaBatch(
        req_to_token=torch.tensor(req_to_token, dtype=dtype),
        full_to_swa_index_mapping=torch.tensor(mapping, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(lens, dtype=dtype),
        seq_lens_cpu=list(lens) if host_lens else None,
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), host_lens=st.booleans(), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_counts_equal_plain_recount(seed, host_lens, dtype):
    rng = random.Random(seed)
    state = random_state(rng)
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)])
    full_entries = rng.randint(0, 1000)
    swa_entries = rng.randint(0, full_entries)
    reporter.observe(KVPool.FULL, full_entries)
    reporter.observe(KVPool.SWA, torch.tensor(swa_entries))
    reporter.step(make_view(*state, host_lens=host_lens, dtype=dtype))
    reporter.flush()
    divergence, out_of_window = recount(*state)
    assert got == [SwaDivergenceRecord(1, full_entries, swa_entries, divergence, out_of_window, verify_source="attention")]


def _cadence_run(reporter, got):
    """25 steps with random batches at interval 5; returns the records expected, in order, and
    the number of records delivered right after each step."""
    rng = random.Random(7)
    states = [random_state(rng) for _ in range(25)]
    expected, delivered_after = [], []
    full_total = swa_total = 0
    for step, state in enumerate(states, start=1):
        full, swa = 10 * step, 3 * step
        full_total += full
        swa_total += swa
        reporter.observe("full", full)
        reporter.observe("swa", swa)
        reporter.step(make_view(*state, host_lens=step % 2 == 0))
        if step % 5 == 0:
            expected.append(SwaDivergenceRecord(step, full_total, swa_total, *recount(*state), verify_source="attention"))
        delivered_after.append(len(got))
    return expected, delivered_after


def test_sampling_cadence_cumulative_totals_and_cpu_delivery_at_the_sampled_step():
    got = []
    reporter = SwaDivergenceReporter(5, sinks=[lambda r, c: got.append(r)])
    expected, delivered_after = _cadence_run(reporter, got)
    assert got == expected
    # On CPU the copy is done when the sample is staged: each record reaches the sinks at the step
    # it describes, so nothing is pending for a later step (or lost if the process dies after it).
    assert delivered_after == [step // 5 for step in range(1, 26)]
    assert reporter.stats.pending == 0
    assert reporter.stats.samples_taken == 5 and reporter.stats.samples_delivered == 5
    reporter.close()
    reporter.close()  # idempotent
    reporter.flush()
    assert got == expected


def test_flush_delivers_samples_whose_copy_is_still_in_flight(monkeypatch):
    """As on a GPU whose copies have not finished: samples wait in the ring, a full ring makes the
    host wait for the oldest (counted, never dropped), and close() delivers the rest in order."""
    got = []
    reporter = SwaDivergenceReporter(5, ring_size=4, sinks=[lambda r, c: got.append(r)])
    monkeypatch.setattr(reporter._queue.ring, "ready", lambda slot: False)
    expected, delivered_after = _cadence_run(reporter, got)
    # samples 1-4 fill the ring; the 5th waits for the oldest copy and delivers it
    assert delivered_after == [0] * 24 + [1]
    assert got == expected[:1]
    assert reporter.stats.pending == 4 and reporter.stats.ring_full_waits == 1
    reporter.close()
    assert got == expected
    assert reporter.stats.pending == 0 and reporter.stats.samples_delivered == 5


def test_context_manager_flushes():
    got = []
    state = random_state(random.Random(1))
    with SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)]) as reporter:
        reporter.step(make_view(*state, host_lens=True))
    assert [r.forward_ct for r in got] == [1]
    reporter.step(make_view(*state, host_lens=True))  # after close: no work, no error
    assert reporter.forward_ct == 1


def test_sample_reads_the_batch_at_its_step():
    """Changing the engine's tensors after step() must not change the staged sample."""
    req_to_token = [[0, 0, 0], [1, 2, 3]]
    mapping = [0, 1, 5, 0]
    view = make_view(req_to_token, mapping, [1], [3], host_lens=True)
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)])
    reporter.step(view)
    view.full_to_swa_index_mapping.fill_(0)
    view.seq_lens.fill_(0)
    reporter.flush()
    # token 1 -> 1 (same), 2 -> 5 (remapped), 3 -> 0 (evicted)
    assert got == [SwaDivergenceRecord(1, 0, 0, 1, 1, verify_source="attention")]


class ControlledRing(DeviceToHostRing):
    """A CPU ring whose copies finish only when the test says so (stands in for CUDA events)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.done = set()
        self.waited = []

    def start_copy(self, slot):
        super().start_copy(slot)
        self.done.discard(slot)

    def ready(self, slot):
        return slot in self.done

    def wait(self, slot):
        self.waited.append(slot)
        self.done.add(slot)


def test_poll_never_blocks_and_full_ring_waits_for_oldest_without_dropping():
    got = []
    reporter = SwaDivergenceReporter(1, ring_size=2, sinks=[lambda r, c: got.append(r.forward_ct)])
    ring = ControlledRing(2, SampleLayout().width, torch.device("cpu"))
    reporter._queue.ring = ring
    state = random_state(random.Random(3))
    view = make_view(*state, host_lens=True)
    reporter.step(view)  # slot 0 in flight
    reporter.step(view)  # slot 1 in flight; slot 0 not ready: nothing delivered, nothing waited
    assert got == [] and ring.waited == []
    reporter.step(view)  # ring full: waits for the oldest (slot 0) and delivers it
    assert got == [1] and ring.waited == [0]
    assert reporter.stats.ring_full_waits == 1
    ring.done.add(1)
    reporter.step(view)  # slot 1 became ready: delivered by polling, in order
    assert got[:2] == [1, 2]
    reporter.flush()
    assert got == [1, 2, 3, 4]
    assert reporter.stats.samples_delivered == 4


def test_sink_errors_are_caught_counted_and_others_still_receive(caplog):
    got = []

    def broken(record, context):
        raise RuntimeError("exporter down")

    reporter = SwaDivergenceReporter(1, sinks=[broken, lambda r, c: got.append(r)])
    state = random_state(random.Random(5))
    reporter.step(make_view(*state, host_lens=True))
    reporter.flush()
    assert len(got) == 1
    assert reporter.stats.sink_errors == 1
    assert "exporter down" in caplog.text


def test_context_handed_to_sinks_is_that_of_the_sampled_step():
    from opentelemetry import context as otel_context

    key = otel_context.create_key("step")
    seen = []
    reporter = SwaDivergenceReporter(2, sinks=[lambda r, c: seen.append((r.forward_ct, otel_context.get_value(key, c)))])
    state = random_state(random.Random(9))
    for step in range(1, 5):
        token = otel_context.attach(otel_context.set_value(key, f"step-{step}"))
        try:
            reporter.step(make_view(*state, host_lens=True))
        finally:
            otel_context.detach(token)
    explicit = otel_context.set_value(key, "explicit")
    for _ in range(2):
        reporter.step(make_view(*state, host_lens=True), context=explicit)
    reporter.flush()
    assert seen == [(2, "step-2"), (4, "step-4"), (6, "explicit")]


@pytest.mark.parametrize(
    "view, message",
    [
        (object(), "has no attribute 'req_to_token'"),
        (SwaBatch(torch.zeros(2, 3, dtype=torch.float32), torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)), "req_to_token must be int32 or int64, got float32"),
        (SwaBatch(torch.zeros(6, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)), "req_to_token must have 2 dimension(s), got shape (6,)"),
        (SwaBatch(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)), "req_pool_indices has 2 entries but view.seq_lens has 1"),
    ],
)
def test_bad_view_gives_clear_error(view, message):
    reporter = SwaDivergenceReporter(1)
    with pytest.raises((TypeError, ValueError)) as info:
        reporter.step(view)
    assert message in str(info.value)


def test_non_sampling_steps_do_not_read_the_view():
    reporter = SwaDivergenceReporter(3)
    reporter.step(None)
    reporter.step(None)
    assert reporter.forward_ct == 2 and reporter.stats.samples_taken == 0


@pytest.mark.parametrize("pool", ["FULLX", 2, None, -1])
def test_unknown_pool(pool):
    reporter = SwaDivergenceReporter(1)
    with pytest.raises(ValueError, match="unknown KV pool"):
        reporter.observe(pool, 1)


@pytest.mark.parametrize("kwargs", [{"interval": 0}, {"interval": -2}, {"interval": 2.0}, {"interval": 1, "ring_size": 0}])
def test_bad_construction(kwargs):
    with pytest.raises(ValueError):
        SwaDivergenceReporter(**kwargs)


def test_full_slot_outside_the_mapping_is_a_fault_not_a_count(caplog):
    """A live token whose FULL slot lies beyond the mapping makes the sample invalid: no
    record with plausible numbers, the fault counted, the device never reading out of bounds."""
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)])
    for req_to_token in ([[0, 0], [7, 99]], [[0, 0], [-1, 2]]):  # 99 beyond the 8 entries, and -1
        for host_lens in (True, False):
            reporter.step(make_view(req_to_token, [0, 1, 2, 3, 4, 5, 6, 3], [1], [2], host_lens=host_lens))
    reporter.flush()
    assert got == []
    stats = reporter.stats
    assert (stats.samples_taken, stats.samples_delivered, stats.invalid_samples) == (4, 0, 4)
    assert dict(stats.view_faults) == {**NO_FAULTS, "full_slot_out_of_range": 4}
    assert caplog.text.count("full_slot_out_of_range") == 1  # logged once, then counted


@pytest.mark.parametrize("host_lens", [True, False])
def test_a_mapping_of_no_entry_is_a_fault_with_live_tokens_and_nothing_without(host_lens):
    """Every FULL slot lies beyond a mapping of no entry: with live tokens the sample is invalid
    (counted, never raised into the engine); a batch of empty requests still gives its record."""
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)])
    empty = torch.zeros(0, dtype=torch.int64)
    reporter.step(SwaBatch(torch.tensor([[1, 2, 3, 0]]), empty, torch.tensor([0]), torch.tensor([3]),
                           seq_lens_cpu=[3] if host_lens else None))
    reporter.step(SwaBatch(torch.tensor([[1, 2, 3, 0]]), empty, torch.tensor([0]), torch.tensor([0]),
                           seq_lens_cpu=[0] if host_lens else None))
    reporter.flush()
    assert dict(reporter.stats.view_faults) == {**NO_FAULTS, "full_slot_out_of_range": 1}
    assert [(r.forward_ct, r.swa_full_idx_divergence, r.swa_out_of_window_tokens) for r in got] == [(2, 0, 0)]


def test_cpu_path_never_touches_cuda(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda used on the CPU path")

    for name in ("Stream", "Event", "current_stream", "stream", "is_current_stream_capturing", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    got = []
    reporter = SwaDivergenceReporter(1, ring_size=2, sinks=[lambda r, c: got.append(r)])
    state = random_state(random.Random(11))
    for _ in range(5):
        reporter.observe(KVPool.FULL, 3)
        reporter.step(make_view(*state, host_lens=True))
    reporter.close()
    assert len(got) == 5


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_ring_matches_recount_and_is_pinned():
    rng = random.Random(13)
    got = []
    reporter = SwaDivergenceReporter(1, device="cuda", ring_size=3, sinks=[lambda r, c: got.append(r)])
    assert reporter._queue.ring.host.is_pinned()
    # (after the loop) host lengths went through the ring's pinned buffers
    expected = []
    total = 0
    for step in range(1, 21):
        state = random_state(rng, num_rows=16, width=256, full_size=4000)
        view = make_view(*state, host_lens=step % 2 == 0)
        view = SwaBatch(*(t.cuda() for t in (view.req_to_token, view.full_to_swa_index_mapping, view.req_pool_indices, view.seq_lens)), view.seq_lens_cpu)
        reporter.observe(KVPool.FULL, torch.tensor(step, device="cuda"))
        total += step
        reporter.step(view)
        expected.append(SwaDivergenceRecord(step, total, 0, *recount(*state), verify_source="attention"))
    reporter.close()
    assert got == expected
    assert all(buffers["sample"].is_pinned() for buffers in reporter._queue.ring._uploads)


@pytest.mark.gpu
def test_observe_inside_cuda_graph():
    reporter = SwaDivergenceReporter(1, device="cuda")
    count = torch.tensor(5, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        reporter.observe(KVPool.SWA, count)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        reporter.observe(KVPool.SWA, count)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert reporter.totals.tolist() == [0, 5 + 3 * 5]  # warm-up + 3 replays (capture itself does not run)


NO_FAULTS = {name: 0 for name in FAULTS}


@pytest.mark.parametrize("host_lens", [True, False])
def test_bad_rows_and_lengths_are_faults_and_never_read_out_of_bounds(host_lens):
    """A row index outside req_to_token and a length beyond max_context_len give no record
    (their clamped counts would look normal: divergence 1, out-of-window 1 here), each fault counted."""
    req_to_token = [[0, 0, 0], [1, 2, 3], [3, 3, 3]]
    mapping = [0, 1, 7, 0]
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)])
    # row 9 does not exist; row 1 claims 10 tokens in a 3-wide table; then one fault at a time
    for rows, lens in (([9, 1], [2, 10]), ([9], [2]), ([1], [10]), ([-1], [1])):
        reporter.step(make_view(req_to_token, mapping, rows, lens, host_lens=host_lens))
    reporter.step(make_view(req_to_token, mapping, [1], [3], host_lens=host_lens))  # a good one
    reporter.flush()
    assert got == [SwaDivergenceRecord(5, 0, 0, 1, 1, verify_source="attention")]
    assert dict(reporter.stats.view_faults) == {
        **NO_FAULTS, "req_pool_index_out_of_range": 3, "seq_len_beyond_width": 2,
    }
    assert reporter.stats.invalid_samples == 4


@pytest.mark.parametrize("host_lens", [True, False])
def test_negative_seq_len_is_a_fault(host_lens):
    view = make_view([[0, 0, 0], [1, 2, 3]], [0, 1, 7, 0], [1, 1], [3, -2], host_lens=host_lens)
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: pytest.fail("record delivered")])
    reporter.step(view)
    assert dict(reporter.stats.view_faults) == {**NO_FAULTS, "negative_seq_len": 1}


def test_host_lengths_differing_from_the_device_lengths_is_a_fault():
    """seq_lens_cpu disagreeing with seq_lens (here the live gather would count divergence 1
    where the device lengths give 0) is counted, not reported as a measurement."""
    req_to_token = [[0, 0, 0], [1, 2, 3]]
    mapping = [0, 1, 7, 0]
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)])
    for device_lens, host in (([1], [3]), ([3, 0], [3, 1]), ([2], [2])):
        view = SwaBatch(
            torch.tensor(req_to_token, dtype=torch.int32), torch.tensor(mapping, dtype=torch.int64),
            torch.ones(len(device_lens), dtype=torch.int64), torch.tensor(device_lens), seq_lens_cpu=host,
        )
        reporter.step(view)
    reporter.flush()
    assert got == [SwaDivergenceRecord(3, 0, 0, 1, 0, verify_source="attention")]  # only the agreeing one
    assert dict(reporter.stats.view_faults) == {**NO_FAULTS, "seq_lens_cpu_mismatch": 2}


def test_lazy_view_is_built_only_at_sampling_steps():
    state = random_state(random.Random(21))
    built = []

    def view():
        built.append(True)
        return make_view(*state, host_lens=True)

    got = []
    reporter = SwaDivergenceReporter(4, sinks=[lambda r, c: got.append(r)])
    for _ in range(8):
        reporter.step(view)
    reporter.flush()
    assert len(built) == 2
    assert [r.forward_ct for r in got] == [4, 8]
    assert (got[0].swa_full_idx_divergence, got[0].swa_out_of_window_tokens) == recount(*state)


def test_negative_int_count_is_refused_at_the_call():
    reporter = SwaDivergenceReporter(1)
    with pytest.raises(ValueError, match="count of KV entries must be >= 0, got -5"):
        reporter.observe("full", -5)
    assert reporter.totals.tolist() == [0, 0]


def test_negative_device_total_never_raises_into_the_engine_and_is_counted(caplog):
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r)])
    state = random_state(random.Random(2))
    reporter.observe("full", torch.tensor(-5))  # a tensor's value is not read at observe
    for _ in range(3):
        reporter.step(make_view(*state, host_lens=True))
    reporter.flush()
    stats = reporter.stats
    assert got == []
    assert (stats.samples_taken, stats.samples_delivered, stats.invalid_samples, stats.pending) == (3, 0, 3, 0)
    assert "verify_full must be >= 0" in caplog.text


def test_host_lengths_must_match_the_batch():
    view = SwaBatch(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(5, dtype=torch.int64),
                    torch.tensor([1, 2]), torch.tensor([1, 1]), seq_lens_cpu=[1, 1, 1])
    with pytest.raises(ValueError, match="seq_lens_cpu has 3 entries but view.req_pool_indices has 2"):
        SwaDivergenceReporter(1).step(view)


@pytest.mark.parametrize(
    "count", [2.5, True, None, "3", torch.tensor(1.5), torch.tensor([1, 2]), torch.tensor(True)]
)
def test_observe_refuses_what_is_not_a_count(count):
    reporter = SwaDivergenceReporter(1)
    with pytest.raises(TypeError, match="must be an int or a 0-dim integer tensor"):
        reporter.observe("swa", count)
    assert reporter.totals.tolist() == [0, 0]


def test_a_failed_sample_does_not_take_a_slot_still_in_flight():
    """A sample that raises must leave the ring as it was: the next sample may not reuse the
    slot of a copy still in flight (it would overwrite that sample's values)."""
    rng = random.Random(31)
    first, third = random_state(rng), random_state(rng)
    got = []
    reporter = SwaDivergenceReporter(1, ring_size=2, sinks=[lambda r, c: got.append(r)])
    reporter._queue.ring = ControlledRing(2, SampleLayout().width, torch.device("cpu"))
    reporter.step(make_view(*first, host_lens=True))  # slot 0, in flight
    broken = make_view(*first, host_lens=False)
    broken = SwaBatch(broken.req_to_token, broken.full_to_swa_index_mapping, broken.req_pool_indices,
                      broken.seq_lens, seq_lens_cpu=["x"] * broken.seq_lens.shape[0])
    if broken.seq_lens.shape[0]:
        with pytest.raises((TypeError, ValueError)):
            reporter.step(broken)
    else:
        reporter.step(broken)  # nothing to convert; keep the cadence
    reporter.step(make_view(*third, host_lens=True))
    reporter.flush()
    assert (got[0].swa_full_idx_divergence, got[0].swa_out_of_window_tokens) == recount(*first)
    assert (got[-1].swa_full_idx_divergence, got[-1].swa_out_of_window_tokens) == recount(*third)


def test_totals_is_the_device_accumulator_until_an_int_is_observed():
    """What SGLang's canary manager reads inside its graph must stay one device tensor."""
    reporter = SwaDivergenceReporter(1)
    first = reporter.totals
    reporter.observe("full", torch.tensor(4))
    assert reporter.totals is first is reporter.device_totals and first.tolist() == [4, 0]
    reporter.observe("swa", 3)  # a host int: totals now adds the host part
    assert reporter.totals.tolist() == [4, 3] and reporter.device_totals.tolist() == [4, 0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device 'cuda:0': no CUDA device here \(torch .*is_available\(\) is False"):
        SwaDivergenceReporter(1, device="cuda:0")


def test_every_entry_point_leaves_state_alone_while_a_graph_is_being_captured(monkeypatch):
    """The host side of CUDA graph capture, on the CPU: while the current stream captures (as
    torch.cuda.is_current_stream_capturing() reports it), step() counts no forward step and takes
    no sample (counted as skipped), flush() and close() deliver nothing and keep the reporter open;
    once capture ends the reporter goes on where it was. The capture itself: tests/core/test_gpu_capture.py."""
    got = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: got.append(r.forward_ct)])
    state = random_state(random.Random(3))
    reporter.step(make_view(*state, host_lens=True))
    assert got == [1]
    capturing = {"now": True}
    monkeypatch.setattr(reporter, "_cuda", True)  # the reporter's device is CUDA ...
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])  # ... capturing
    for _ in range(3):
        reporter.step(make_view(*state, host_lens=True))
    reporter.flush()
    reporter.close()
    assert reporter.forward_ct == 1 and got == [1] and not reporter.closed
    assert reporter.stats.skipped_captures == 3
    capturing["now"] = False
    monkeypatch.setattr(reporter, "_cuda", False)
    reporter.step(make_view(*state, host_lens=True))
    reporter.close()
    assert got == [1, 2] and reporter.closed
