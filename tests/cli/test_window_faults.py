"""Both window faults made on purpose on the reference engine (window_faults.py): the records count
exactly what the pools' host bookkeeping says, and a replay with premature eviction fails
`otel-swa check`, the pytest assertion and the fixture, with the reason in words."""

import re

import pytest

import window_faults
from verdict_fronts import assert_fails_on_every_front, summary_of
from otel_swa.cli import main
from otel_swa.record import Offender
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.trace import load_trace
from otel_swa.reporter import SwaDivergenceReporter

WINDOW = 32


def run_engine(page_size):
    """Run 30 requests, sampling every step; for each record, the counts the pools' host state
    gives at that moment (the sink runs inside the step, before the step's own eviction): a
    request's positions below ``swa_evicted_len`` have no SWA slot; its queries (the last
    ``extend_len`` positions) read the last ``WINDOW + extend_len - 1``. Also the premature count a
    check of the last ``WINDOW`` positions only would give."""
    config = EngineConfig(window=WINDOW, full_pool_size=32768, swa_pool_size=32768, page_size=page_size,
                          max_running=8, token_budget=256, max_context_len=8192, run_model=False)
    pairs = []
    engine = None

    def sink(record, context):
        premature = late = last_window_only = 0
        first = None  # the first request of the batch with a premature eviction, at its oldest read position
        for item in engine.last_batch:
            length, evicted = item.seq_len, item.req.slots.swa_evicted_len  # positions < evicted: no SWA slot
            oldest_read = max(0, length - (WINDOW + item.extend_len - 1))
            premature += max(0, min(evicted, length) - oldest_read)
            late += max(0, oldest_read - page_size - evicted)
            last_window_only += max(0, min(evicted, length) - max(0, length - WINDOW))
            if first is None and min(evicted, length) > oldest_read:
                row = item.req.slots.row
                first = Offender("swa_premature_evictions", request=str(item.req.rid), row=row, position=oldest_read,
                                 full_slot=int(engine.pools.req_to_token[row, oldest_read]))
        pairs.append((record, premature, late, last_window_only, first))

    # an SWA pool of 32,768 slots audited whole at every sample: the audit's budget above its free
    # list and page cells (the default audits a pool that large in passes over several samples)
    reporter = SwaDivergenceReporter(1, device="cpu", sinks=[sink], audit_budget=1 << 17)
    engine = ReferenceEngine(config, reporter=reporter)
    for request in load_trace("conv", limit=30):
        engine.submit(request, arrival_s=0.0)
    engine.run_until_done()
    reporter.close()
    return pairs


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_premature_eviction_counts_the_freed_in_window_tokens(monkeypatch, page_size):
    window_faults.install_premature(monkeypatch)
    pairs = run_engine(page_size)
    assert [(r.swa_premature_evictions, r.swa_late_held_slots) for r, *_ in pairs] == [(p, 0) for _, p, *_ in pairs]
    assert max(p for _, p, *_ in pairs) >= page_size  # the fault was made: at least a page per request
    # each sample names its first premature eviction: request, row, position, FULL slot
    assert [r.offender("swa_premature_evictions") for r, *_ in pairs] == [first for *_, first in pairs]
    assert {r.swa_leaked_slots + r.swa_stale_tokens + r.swa_shared_slots for r, *_ in pairs} == {0}  # only the window check sees it


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_never_evicting_counts_every_slot_held_past_the_window(monkeypatch, page_size):
    window_faults.install_never_evict(monkeypatch)
    pairs = run_engine(page_size)
    assert [(r.swa_premature_evictions, r.swa_late_held_slots) for r, *_ in pairs] == [(0, late) for _, _, late, *_ in pairs]
    assert max(late for _, _, late, *_ in pairs) > 1000


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_freed_tail_of_the_previous_chunk_counts_as_premature(monkeypatch, page_size):
    counts = window_faults.install_chunk_tail_freed(monkeypatch)
    pairs = run_engine(page_size)
    assert counts["calls"] > 0  # chunked prefills ran (prompts longer than the token budget)
    assert [(r.swa_premature_evictions, r.swa_late_held_slots) for r, *_ in pairs] == [(p, 0) for _, p, *_ in pairs]
    # the chunks (up to the 256-token budget) are longer than the window: the last WINDOW
    # positions alone miss the freed tail, the step's reach sees it
    assert [r for r, p, _, only, _ in pairs if only == 0 and p > 0]
    assert {r.swa_leaked_slots + r.swa_stale_tokens + r.swa_shared_slots for r, *_ in pairs} == {0}


def test_a_replay_with_premature_eviction_fails_check_on_every_front(monkeypatch, capsys, tmp_path):
    window_faults.install_premature(monkeypatch)
    log = tmp_path / "run.log"
    assert main(["replay", "--no-model", "--no-progress", "--requests", "60", "--log-file", str(log)]) == 1
    captured = capsys.readouterr()
    summary = summary_of(captured.out)
    assert summary["SWA slot audit"].startswith("clean:")  # the pool's bookkeeping is consistent
    peak = int(re.match(r"PREMATURE EVICTION: peak premature evictions (\d+) tokens, late-held 0 slots",
                        summary["window check"]).group(1))
    assert peak >= 1
    assert captured.err.splitlines() == [
        "otel-swa replay: the window check found live tokens inside the sliding window without an SWA slot "
        f"(peak swa_premature_evictions={peak}); exit status 1"]
    reason = (f"{peak} live token(s) inside the sliding window had no SWA slot (premature eviction: attention read "
              f"freed KV): peak swa_premature_evictions={peak}")
    assert_fails_on_every_front(log, capsys, f"FAILED SWA slot audit: {reason}", re.escape(reason))


def test_a_replay_that_never_evicts_reports_late_held_slots_and_passes(monkeypatch, capsys, tmp_path):
    window_faults.install_never_evict(monkeypatch)
    log = tmp_path / "run.log"
    assert main(["replay", "--no-model", "--no-progress", "--requests", "20", "--swa-pool", "65536",
                 "--log-file", str(log)]) == 0
    late = int(re.match(r"clean: peak premature evictions 0 tokens, late-held (\d+) slots",
                        summary_of(capsys.readouterr().out)["window check"]).group(1))
    assert late > 0
    # nothing left the window, so there is no divergence and no out-of-window token to require
    assert main(["check", str(log), "--min-divergence", "0", "--min-out-of-window", "0"]) == 0
    out = capsys.readouterr().out
    assert f"info   late-held SWA slots: peak swa_late_held_slots={late}" in out
    assert "reported, not judged" in out
