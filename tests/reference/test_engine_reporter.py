"""The reference engine with the real reporter: every record recounted in plain Python."""

import opentelemetry.context
import pytest

from otel_swa.record import SwaDivergenceRecord
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.replay import replay
from otel_swa.reference.trace import load_trace
from otel_swa.reporter import SwaDivergenceReporter

INTERVAL = 5


class RecountingReporter:
    """Forwards to the real reporter and recounts, from the engine state at each step, what the
    record of that step must say."""

    def __init__(self, reporter, engine_config):
        self.reporter = reporter
        self.window = engine_config.window
        self.engine = None
        self.forward_ct = self.verify_full = self.verify_swa = 0
        self.seq_len_by_rid: dict[int, int] = {}
        self.expected: list[SwaDivergenceRecord] = []

    def observe(self, pool, count):
        self.reporter.observe(pool, count)

    def step(self, view, context=None):
        if callable(view):  # the engine may pass a view factory (built at sampling steps only)
            view = view()
        self.forward_ct += 1
        seq_lens = [int(x) for x in view.seq_lens.tolist()]
        rids = [item.req.rid for item in self.engine.last_batch]
        extends = []
        for rid, seq_len in zip(rids, seq_lens):
            extend = seq_len - self.seq_len_by_rid.get(rid, 0)
            extends.append(extend)
            self.seq_len_by_rid[rid] = seq_len
            self.verify_full += seq_len  # the FULL layer read every cached position
            self.verify_swa += min(seq_len, self.window + extend - 1)  # union of the queries' windows
        if self.forward_ct % INTERVAL == 0:
            mapping = view.full_to_swa_index_mapping.tolist()
            divergent = out = premature = late = 0
            ps = self.engine.pools.page_size
            for row, seq_len, extend in zip(view.req_pool_indices.tolist(), seq_lens, extends):
                for pos, full in enumerate(view.req_to_token[row, :seq_len].tolist()):
                    swa = mapping[full]
                    out += swa == 0
                    divergent += swa != 0 and swa != full
                    # in the window the last query reads, and no slot: premature; held further back
                    # than this step's queries and the page rounding of the last eviction: late
                    premature += pos >= seq_len - self.window and swa == 0
                    late += pos < seq_len - self.window - (ps + extend - 1) and swa != 0
            leaked, stale, shared, in_use, referenced = self.audit(mapping)
            self.expected.append(
                SwaDivergenceRecord(
                    self.forward_ct, self.verify_full, self.verify_swa, divergent, out,
                    swa_leaked_slots=leaked, swa_stale_tokens=stale, swa_shared_slots=shared,
                    swa_pages_in_use=in_use, swa_pages_referenced=referenced,
                    swa_premature_evictions=premature, swa_late_held_slots=late,
                    verify_source="attention",  # the reference engine counts the entries attention reads
                )
            )
        self.reporter.step(view, context)

    def audit(self, mapping):
        """Leaked SWA slots, stale tokens, shared SWA slots, SWA pages in use and in-use pages a live
        token maps into, from the pools' host state."""
        pools = self.engine.pools
        ps = pools.page_size
        free = set(pools.free_swa_page_list())
        held_full = set()
        for slots in pools.requests.values():
            held_full.update(pools.req_to_token[slots.row, : slots.seq_len].tolist())
        held_full.discard(0)
        referenced_pages, stale, users = set(), 0, {}
        for full in held_full:
            swa = mapping[full]
            if swa:
                referenced_pages.add(swa // ps)
                users[swa] = users.get(swa, 0) + 1
        for slots in pools.requests.values():  # stale counts tokens, with repeats
            for full in pools.req_to_token[slots.row, : slots.seq_len].tolist():
                stale += bool(mapping[full]) and mapping[full] // ps in free
        in_use = set(range(1, pools.swa_pages + 1)) - free
        leaked = len(in_use - referenced_pages) * ps
        return leaked, stale, sum(1 for n in users.values() if n > 1), len(in_use), len(in_use & referenced_pages)


@pytest.mark.parametrize("page_size", [1, 4])
def test_records_match_a_plain_recount_of_the_engine_state(page_size):
    config = EngineConfig(
        window=32, full_pool_size=16384, swa_pool_size=1024, page_size=page_size, max_running=8,
        token_budget=256, max_context_len=8192,
    )
    delivered = []
    reporter = SwaDivergenceReporter(INTERVAL, device="cpu", ring_size=2, sinks=[lambda r, c: delivered.append(r)])
    recount = RecountingReporter(reporter, config)
    engine = ReferenceEngine(config, reporter=recount)
    recount.engine = engine
    for request in load_trace("conv", limit=40):
        engine.submit(request, arrival_s=0.0)
    engine.run_until_done()
    reporter.close()
    assert delivered == recount.expected
    assert len(delivered) == engine.stats.forward_steps // INTERVAL
    # the run shows what the CI check looks for
    assert max(r.swa_full_idx_divergence for r in delivered) >= 1
    assert max(r.swa_out_of_window_tokens for r in delivered) >= 1
    assert delivered[-1].verify_swa < delivered[-1].verify_full
    assert reporter.stats.sink_errors == 0
    # a healthy engine: nothing the window reads was freed, nothing past it held
    assert {(r.swa_premature_evictions, r.swa_late_held_slots) for r in delivered} == {(0, 0)}


def test_sinks_get_the_context_of_the_forward_span():
    config = EngineConfig(window=16, full_pool_size=4096, swa_pool_size=256, max_running=4, token_budget=64, max_context_len=2048, run_model=False)
    seen = []
    reporter = SwaDivergenceReporter(2, device="cpu", sinks=[lambda r, c: seen.append((r.forward_ct, opentelemetry.context.get_value("step", c)))])
    engine = ReferenceEngine(config, reporter=reporter)
    infos = []

    def forward_span(info):
        import contextlib

        @contextlib.contextmanager
        def span():
            infos.append(info)
            token = opentelemetry.context.attach(opentelemetry.context.set_value("step", info.forward_ct))
            try:
                yield
            finally:
                opentelemetry.context.detach(token)

        return span()

    engine.forward_span = forward_span
    for request in load_trace("conv", limit=3):
        engine.submit(request, arrival_s=0.0)
    engine.run_until_done()
    reporter.close()
    assert [info.forward_ct for info in infos] == list(range(1, engine.stats.forward_steps + 1))
    # the first prompt (374 tokens) takes the whole 64-token budget of step 1
    assert (infos[0].batch_size, infos[0].num_prefill, infos[0].num_decode, infos[0].request_ids) == (1, 1, 0, (0,))
    assert seen == [(ct, ct) for ct in range(2, engine.stats.forward_steps + 1, 2)]


def test_replay_summary_and_flushed_last_sample():
    requests = load_trace("conv", limit=25)
    config = EngineConfig(window=32, full_pool_size=16384, swa_pool_size=1024, max_running=8, token_budget=256, max_context_len=8192, run_model=False)
    records = []
    reporter = SwaDivergenceReporter(7, device="cpu", ring_size=4, sinks=[lambda r, c: records.append(r)])
    summary = replay(requests, config, reporter, progress=True)
    assert summary.requests_total == summary.requests_finished == 25
    assert summary.engine.decode_tokens == sum(r.generated_tokens - 1 for r in requests)
    assert 0 < summary.peak_swa_slots <= 1024 and summary.peak_full_slots <= 16384
    # replay flushes: the record of the last sampled step is delivered, none pending
    assert records[-1].forward_ct == summary.forward_steps // 7 * 7
    assert reporter.stats.pending == 0
    with pytest.raises(ValueError, match="arrivals='later'"):
        replay(requests, config, arrivals="later")


def test_view_before_any_step_is_an_error_and_no_reporter_is_fine():
    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=1024, swa_pool_size=128, max_running=4, token_budget=64, max_context_len=512))
    with pytest.raises(RuntimeError, match="no forward step"):
        engine.view()
    engine.submit(load_trace("conv", limit=1)[0])
    assert engine.step() is not None and engine.reporter is None


class _BrokenSpan:
    def __init__(self, fail_on):
        self.fail_on = fail_on

    def __enter__(self):
        if self.fail_on == "enter":
            raise RuntimeError("span start failed")

    def __exit__(self, *exc):
        if self.fail_on == "exit":
            raise RuntimeError("span end failed")


@pytest.mark.parametrize("fail_on", ["hook", "enter", "exit"])
def test_a_failing_forward_span_hook_is_logged_and_the_engine_goes_on(fail_on, caplog):
    def forward_span(info):
        if fail_on == "hook":
            raise RuntimeError("no span")
        return _BrokenSpan(fail_on)

    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=1024, swa_pool_size=128, max_running=4, token_budget=64, max_context_len=512, run_model=False))
    engine.forward_span = forward_span
    engine.submit(load_trace("conv", limit=1)[0])
    with caplog.at_level("ERROR", logger="otel_swa.reference.engine"):
        stats = engine.run_until_done()
    assert stats.finished_requests == 1
    assert len([r for r in caplog.records if r.name == "otel_swa.reference.engine"]) == stats.forward_steps
