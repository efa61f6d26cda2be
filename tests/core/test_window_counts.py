"""The sliding-window check of a sample (premature evictions, late-held SWA slots) against a plain
Python recount over random views, on every gather path, and hand-computed cases."""

import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_swa.device import DENSE_FILL_RATIO, STAGE_WIDTH, Workspace, read_sample, stage_sample
from otel_swa.views import SwaAuditInputs

from live_tally import tallied_by


def recount(req_to_token, mapping, rows, lens, window, allowance, extend=None):
    """Query by query: the step computes the last ``e`` positions of a request (``extend``, 1 each
    when None); each query at q reads q - window + 1 .. q. A position some query reads with mapping
    0 is premature; one older than the oldest position read by more than the allowance with mapping
    != 0 is late-held."""
    premature = late = 0
    for i, (row, length) in enumerate(zip(rows, lens)):
        a = allowance[i] if isinstance(allowance, (list, torch.Tensor)) else allowance
        e = 1 if extend is None else int(extend[i]) if isinstance(extend, (list, torch.Tensor)) else extend
        read = set()
        for query in range(max(0, length - e), length):
            read.update(range(max(0, query - window + 1), query + 1))
        oldest = min(read, default=length)
        for pos in range(length):
            swa = mapping[req_to_token[row][pos]]
            if pos in read and swa == 0:
                premature += 1
            if pos < oldest - a and swa != 0:
                late += 1
    return premature, late


def first_premature(req_to_token, mapping, rows, lens, window, extend=None):
    """The first request of the batch with a premature eviction and its first such position (the
    positions its queries read, ascending): ``{"entry", "row", "position", "full_slot"}``, or None."""
    for i, (row, length) in enumerate(zip(rows, lens)):
        e = 1 if extend is None else int(extend[i]) if isinstance(extend, (list, torch.Tensor)) else extend
        read = sorted({p for q in range(max(0, length - e), length) for p in range(max(0, q - window + 1), q + 1)})
        for pos in read:
            if mapping[req_to_token[row][pos]] == 0:
                return {"entry": i, "row": row, "position": pos, "full_slot": req_to_token[row][pos]}
    return None


SHARED = Workspace("cpu")

PATHS = {"live": float("inf"), "dense": 0.0, "no host lengths": DENSE_FILL_RATIO}


def stage(req_to_token, mapping, rows, lens, path, window, allowance, host_rows=False, audit=None, extend=None):
    out = torch.full((STAGE_WIDTH,), -7, dtype=torch.int64)
    meta = stage_sample(
        out, torch.tensor([0, 0]), torch.tensor(req_to_token, dtype=torch.int32), torch.tensor(mapping),
        torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), None if path == "no host lengths" else lens,
        audit, req_pool_indices_cpu=rows if host_rows else None, workspace=SHARED,
        dense_fill_ratio=PATHS[path], sliding_window=window, swa_eviction_allowance=allowance,
        extend_lens_cpu=extend,
    )
    if path != "no host lengths" and sum(lens):
        assert meta.path == path
    return read_sample(out.tolist(), meta)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    path=st.sampled_from(list(PATHS)),
    host_rows=st.booleans(),
    window=st.sampled_from([1, 2, 3, 5, 8, 30]),  # 30: larger than every row
    per_request=st.booleans(),
    extend_kind=st.sampled_from([None, "int", "list", "tensor"]),
    tally=st.sampled_from(["cumsum", "counts"]),
)
def test_window_counts_equal_the_recount(seed, path, host_rows, window, per_request, extend_kind, tally):
    """``tally``: the live path's masks counted by its one cumsum (few live tokens) or by flat counts (many)."""
    rng = random.Random(seed)
    num_rows, width, full_size = rng.randint(1, 6), rng.randint(1, 24), rng.randint(2, 80)
    req_to_token = [[rng.randrange(0, full_size) for _ in range(width)] for _ in range(num_rows)]
    # mostly held, some freed, the mapping's own zeros too
    mapping = [0] + [rng.choice([0, slot, slot, rng.randrange(1, full_size)]) for slot in range(1, full_size)]
    rows = [rng.randrange(0, num_rows) for _ in range(rng.randint(0, 2 * num_rows))]
    lens = [rng.choice([0, width, rng.randint(0, width)]) for _ in rows]
    allowance = [rng.randint(0, 6) for _ in rows] if per_request else rng.randint(0, 6)
    # new tokens of this step: a decode (1), a chunk up to the whole request, longer than the window
    extend = {None: None, "int": rng.randint(1, 12),
              "list": [rng.choice([1, max(1, n), rng.randint(1, max(1, n))]) for n in lens]}.get(extend_kind)
    if extend_kind == "tensor":
        extend = torch.tensor([rng.randint(1, max(1, n)) for n in lens], dtype=torch.int32)
    with tallied_by(tally):
        reading = stage(req_to_token, mapping, rows, lens, path, window, allowance, host_rows, extend=extend)
    assert reading.faults == ()
    assert (reading.premature, reading.late_held) == recount(req_to_token, mapping, rows, lens, window, allowance,
                                                             extend)
    assert reading.premature_where == first_premature(req_to_token, mapping, rows, lens, window, extend)


def paged_request(seq_len, page_size, evicted_pages, freed_in_window_page=None):
    """One request in row 1 whose FULL slots are 1 .. seq_len (page k = slots k*ps .. offset kept:
    slot = position + page_size, page 0 reserved), its first ``evicted_pages`` SWA pages freed."""
    width = seq_len + 2 * page_size
    req_to_token = [[0] * width, [pos + page_size for pos in range(seq_len)] + [0] * (width - seq_len)]
    mapping = [0] * (seq_len + 2 * page_size + 1)
    for pos in range(seq_len):
        page = pos // page_size
        freed = page < evicted_pages or page == freed_in_window_page
        mapping[pos + page_size] = 0 if freed else 1000 + pos
    return req_to_token, mapping


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_hand_computed_paged_eviction(path, page_size):
    window, seq_len = 10, 45
    # healthy: whole pages freed below seq_len - window = 35
    evicted = 35 // page_size
    req_to_token, mapping = paged_request(seq_len, page_size, evicted)
    reading = stage(req_to_token, mapping, [1], [seq_len], path, window, 0)
    assert reading.premature == 0
    assert reading.late_held == 35 - evicted * page_size  # the partly out-of-window page is still held
    assert stage(req_to_token, mapping, [1], [seq_len], path, window, page_size).late_held == 0
    # the page holding position 40 (in the window 35..44) freed on purpose
    page = 40 // page_size
    req_to_token, mapping = paged_request(seq_len, page_size, evicted, freed_in_window_page=page)
    in_window = len([p for p in range(page * page_size, (page + 1) * page_size) if 35 <= p < seq_len])
    assert stage(req_to_token, mapping, [1], [seq_len], path, window, 0).premature == in_window
    # never evicted: every position below 35 - allowance holds its slot
    req_to_token, mapping = paged_request(seq_len, page_size, 0)
    assert stage(req_to_token, mapping, [1], [seq_len], path, window, 3).late_held == 32


@pytest.mark.parametrize("path", list(PATHS))
def test_window_one_and_a_window_longer_than_the_request(path):
    req_to_token, mapping = paged_request(6, 1, 0)
    mapping[6 + 1 - 1] = 0  # the last position (slot 6) freed
    assert (stage(req_to_token, mapping, [1], [6], path, 1, 0).premature,
            stage(req_to_token, mapping, [1], [6], path, 1, 0).late_held) == (1, 5)
    reading = stage(req_to_token, mapping, [1], [6], path, 100, 0)
    assert (reading.premature, reading.late_held) == (1, 0)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("extend_as", ["list", "int", "tensor"])
def test_a_chunked_prefill_sees_the_previous_chunks_freed_tail(path, extend_as):
    """Hand-computed: a request of 16 tokens whose second chunk (positions 8..15, extend 8) runs in
    this step, window 8. Query 8 reads 1..8, so positions 1..15 are read (15 of them). Position 7,
    the first chunk's last token, freed: 1 premature eviction; counted with one query per request
    (decode), positions 8..15 only, it would be invisible. Position 0 still held: older than the
    oldest read (1) by 1, late-held with allowance 0, not with allowance 1."""
    req_to_token, mapping = paged_request(16, 1, 0)
    mapping[7 + 1] = 0  # FULL slot of position 7 (slot = position + page size)
    extend = {"list": [8], "int": 8, "tensor": torch.tensor([8])}[extend_as]
    reading = stage(req_to_token, mapping, [1], [16], path, 8, 0, extend=extend)
    assert (reading.premature, reading.late_held) == (1, 1)
    assert stage(req_to_token, mapping, [1], [16], path, 8, 1, extend=extend).late_held == 0
    decode = stage(req_to_token, mapping, [1], [16], path, 8, 0)
    assert (decode.premature, decode.late_held) == (0, 7)  # positions 0..6 older than 8..15
    # two requests, per-request chunks: row 1 as above (extend 8), row 2 decoding (extend 1) with
    # its position 7 freed too (the same FULL slots): outside its window (8..15), so only row 1's counts
    req_to_token.append(list(req_to_token[1]))
    reading = stage(req_to_token, mapping, [1, 2], [16, 16], path, 8, [1, 8], extend=[8, 1])
    assert (reading.premature, reading.late_held) == (1, 0)


@pytest.mark.parametrize("path", list(PATHS))
def test_an_empty_batch_counts_zero(path):
    assert (stage([[0, 0]], [0, 0], [], [], path, 4, 0).premature, stage([[0, 0]], [0, 0], [], [], path, 4, 0).late_held) == (0, 0)
    reading = stage([[0, 0], [0, 0]], [0, 0], [1], [0], path, 4, 0)
    assert (reading.premature, reading.late_held) == (0, 0)


def test_without_a_window_nothing_is_counted():
    req_to_token, mapping = paged_request(8, 1, 0)
    reading = stage(req_to_token, mapping, [1], [8], "live", None, None)
    assert (reading.premature, reading.late_held) == (None, None)


def test_the_allowance_defaults_to_the_audit_page_size():
    page_size, seq_len, window = 4, 30, 10
    req_to_token, mapping = paged_request(seq_len, page_size, 0)
    audit = SwaAuditInputs(torch.zeros(0, dtype=torch.int64), 64, page_size, torch.zeros(0, dtype=torch.int64))
    reading = stage(req_to_token, mapping, [1], [seq_len], "live", window, None, audit=audit)
    assert reading.late_held == seq_len - window - page_size
    assert stage(req_to_token, mapping, [1], [seq_len], "live", window, None).late_held == seq_len - window


# ------------------------------------------------------------------ through the reporter, and bad windows
from otel_swa.record import find_all  # noqa: E402
from otel_swa.reporter import SwaDivergenceReporter  # noqa: E402
from otel_swa.views import SwaBatch, validate_view  # noqa: E402


def view_of(window=None, allowance=None, freed=(), extend=None):
    """Row 1: 12 tokens at FULL slots 1..12, identity mapping except the ``freed`` slots (0)."""
    req_to_token = torch.zeros((2, 16), dtype=torch.int32)
    req_to_token[1, :12] = torch.arange(1, 13)
    mapping = torch.arange(14)
    mapping[list(freed)] = 0
    return SwaBatch(req_to_token, mapping, torch.tensor([1]), torch.tensor([12]), seq_lens_cpu=[12],
                    sliding_window=window, swa_eviction_allowance=allowance, extend_lens_cpu=extend)


def test_the_reporter_puts_both_counts_on_the_record_and_its_audit_line():
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    # window 4: positions 8..11 read; slot 10 (position 9) freed -> 1 premature; positions 0..5
    # (below 12 - 4 - 2) still hold slots 1..6 -> 6 late-held; position 6, 7 within the allowance
    reporter.step(view_of(4, 2, freed=[10]))
    reporter.step(view_of())
    reporter.close()
    assert (records[0].swa_premature_evictions, records[0].swa_late_held_slots) == (1, 6)
    assert (records[1].swa_premature_evictions, records[1].swa_late_held_slots) == (None, None)
    assert records[0].audit_line() == ('otel_swa[verify=attention] otel_swa_audit={"forward_ct":1,'
                                       '"swa_premature_evictions":1,"swa_late_held_slots":6}')
    assert records[1].audit_line() is None
    (back,) = find_all("\n".join(records[0].lines()))
    assert (back.swa_premature_evictions, back.swa_late_held_slots, back.swa_leaked_slots) == (1, 6, None)


@pytest.mark.parametrize("window, allowance, error, message", [
    (0, None, ValueError, "view.sliding_window must be None or an int >= 1 (tokens attention reads, the current one included), got 0"),
    (True, None, ValueError, "got True"),
    (4.0, None, ValueError, "got 4.0"),
    (4, -1, ValueError, "view.swa_eviction_allowance must be an int >= 0 (tokens), got -1"),
    (4, [1, 2], ValueError, "view.swa_eviction_allowance has 2 entries but view.req_pool_indices has 1"),
    (4, [-3], ValueError, "got -3 among its entries"),
    (4, "3", TypeError, "view.swa_eviction_allowance must be an int >= 0 or one int >= 0 per batch entry on the host, got str"),
    (4, torch.tensor([1.5]), ValueError, "got a torch.float32 tensor of shape (1,) on cpu"),
])
def test_a_bad_window_is_refused_naming_the_value(window, allowance, error, message):
    with pytest.raises(error, match=re.escape(message)):
        validate_view(view_of(window, allowance))


@pytest.mark.parametrize("extend, error, message", [
    (0, ValueError, "view.extend_lens_cpu must be an int >= 1 (new tokens of the request in this forward step), got 0"),
    ([8, 1], ValueError, "view.extend_lens_cpu has 2 entries but view.req_pool_indices has 1"),
    ([0], ValueError, "view.extend_lens_cpu must be an int >= 1 or one int >= 1 per batch entry on the host, got 0 "
                      "among its entries"),
    ([2.0], ValueError, "got 2.0 among its entries"),
    ("8", TypeError, "view.extend_lens_cpu must be an int >= 1 or one int >= 1 per batch entry on the host, got str"),
    (torch.tensor([[8]]), ValueError, "got a torch.int64 tensor of shape (1, 1) on cpu"),
])
def test_bad_extend_lengths_are_refused_naming_the_value(extend, error, message):
    with pytest.raises(error, match=re.escape(message)):
        validate_view(view_of(4, 0, extend=extend))


def test_the_reporter_counts_the_window_of_an_extend_step():
    """Through the reporter: 12 tokens, the last 6 (positions 6..11) new in this step, window 4:
    query 6 reads 3..6, so positions 3..11 are read; slot 5 (position 4) freed: premature 1.
    Positions 0..2 hold slots, older than 3; with allowance 1 those below 2 are late-held: 2."""
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    reporter.step(view_of(4, 1, freed=[5], extend=[6]))
    reporter.step(view_of(4, 1, freed=[5]))  # as a decode step: 8..11 read, position 4 outside
    reporter.close()
    assert (records[0].swa_premature_evictions, records[0].swa_late_held_slots) == (1, 2)
    assert (records[1].swa_premature_evictions, records[1].swa_late_held_slots) == (0, 6)


def test_a_per_request_allowance_may_be_a_host_tensor():
    validate_view(view_of(4, torch.tensor([3])))
    reading = stage([[0] * 16, list(range(1, 13)) + [0] * 4], list(range(14)), [1], [12], "live", 4,
                    torch.tensor([3]))
    assert (reading.premature, reading.late_held) == (0, 12 - 4 - 3)


@pytest.mark.gpu
@pytest.mark.parametrize("host_lengths", [True, False])
@pytest.mark.parametrize("fill", [0.1, 1.0])  # the live and the dense gather
@pytest.mark.parametrize("extend", [None, [1, 12, 30, 2]])  # decode; extend chunks, some past the window
def test_on_cuda_the_window_counts_equal_the_recount(host_lengths, fill, extend):
    rng = random.Random(5)
    width, full_size, window = 64, 400, 9
    req_to_token = [[rng.randrange(1, full_size) for _ in range(width)] for _ in range(6)]
    mapping = [0] + [rng.choice([0, slot, rng.randrange(1, full_size)]) for slot in range(1, full_size)]
    rows = [1, 2, 3, 5]
    lens = [max(1, int(width * fill) - i) for i in range(len(rows))]
    allowance = [0, 3, 7, 1]
    records = []
    reporter = SwaDivergenceReporter(1, device="cuda", sinks=[lambda record, context: records.append(record)])
    view = SwaBatch(torch.tensor(req_to_token, dtype=torch.int32, device="cuda"), torch.tensor(mapping, device="cuda"),
                    torch.tensor(rows, device="cuda"), torch.tensor(lens, device="cuda"),
                    lens if host_lengths else None, sliding_window=window, swa_eviction_allowance=allowance,
                    extend_lens_cpu=extend)
    for _ in range(3):  # ring slots reused: each upload stays its sample's
        reporter.step(view)
    reporter.close()
    expected = recount(req_to_token, mapping, rows, lens, window, allowance, extend)
    assert [(r.swa_premature_evictions, r.swa_late_held_slots) for r in records] == [expected] * 3
