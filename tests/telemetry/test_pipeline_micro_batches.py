"""Pipeline parallelism: a 2-stage pipeline simulated on the reference engine, two micro-batches.

Under pipeline parallelism every stage runs the micro-batches of the pipeline in turn (SGLang's PP
event loop: ``for mb_id in range(pp_loop_size)``), one forward step each, and SGLang's reporter
counts every micro-batch's forward in ``forward_ct``: a sample at a multiple of the interval is
whichever micro-batch ran then. These tests check that each record says which micro-batch it
sampled (record, audit line, event and gauge attributes), that ``micro_batches="every"`` samples
the whole round, and that every count equals a plain recount of that micro-batch's batch.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from recount_support import recount as recount_tokens

from otel_swa.logline import LogLineSink
from otel_swa.record import find_all
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.trace import TraceRequest
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.telemetry.events import record_attributes
from otel_swa.cli import main
from otel_swa.testing import assert_swa_divergence_observed

WINDOW = 16
INTERVAL = 4


def recount(view) -> tuple[int, int]:
    """Divergence and out-of-window tokens of ``view``, by SGLang's definitions, one token at a time."""
    return recount_tokens(view.req_to_token.tolist(), view.full_to_swa_index_mapping.tolist(),
                          view.req_pool_indices.tolist(), view.seq_lens.tolist())


class PipelineStage:
    """Stands in for the reporter calls of one pipeline stage's model runner, for one micro-batch.

    The reference engine has no pipeline: each micro-batch is an engine of its own (its own
    requests, KV pools and request rows, as a micro-batch's batch is in SGLang), and every stage
    runs every micro-batch, so each engine's reporter hook forwards to the reporter of each stage
    (pipeline ranks 0 and 1), with the micro-batch's index, as SGLang's scheduler passes ``mb_id``.
    It also writes down, at each step, what a plain recount of the view gives.
    """

    def __init__(self, reporters: list[SwaDivergenceReporter], micro_batch: int, expected: dict) -> None:
        self.reporters = reporters
        self.micro_batch = micro_batch
        self.expected = expected

    def observe(self, pool, count) -> None:
        for reporter in self.reporters:
            reporter.observe(pool, count)

    def step(self, view) -> None:
        built = view()
        for stage, reporter in enumerate(self.reporters):
            reporter.step(built, micro_batch=self.micro_batch)
            self.expected.setdefault(stage, []).append((reporter.forward_ct, self.micro_batch, recount(built)))


def run_pipeline(micro_batches: str, *, steps: int = 40):
    """Two micro-batches of different requests, stepped in turn on a 2-stage pipeline; returns
    the records of each stage, the steps each stage saw (``forward_ct, micro-batch, recount``)
    and the lines logged for each stage."""
    records: dict[int, list] = {0: [], 1: []}
    streams = {stage: io.StringIO() for stage in records}
    reporters = []
    for stage in records:
        logger = logging.getLogger(f"otel_swa.test.pp{stage}.{micro_batches}")
        logger.propagate = False
        handler = logging.StreamHandler(streams[stage])
        handler.setFormatter(logging.Formatter(f"[2026-12-01 10:00:00 PP{stage}] %(message)s"))
        logger.handlers[:] = [handler]
        reporter = SwaDivergenceReporter(
            INTERVAL, micro_batches=micro_batches,
            sinks=[lambda record, context, stage=stage: records[stage].append(record), LogLineSink(logger)],
        )
        reporters.append(reporter)
    expected: dict[int, list] = {}
    engines = []
    for micro_batch, prompts in enumerate(((40, 9, 70), (25, 60))):
        engine = ReferenceEngine(EngineConfig(window=WINDOW, full_pool_size=2048, swa_pool_size=96, run_model=False))
        for rid, context in enumerate(prompts):
            engine.submit(TraceRequest(0.0, context, 30), rid=rid)
        engine.reporter = PipelineStage(reporters, micro_batch, expected)
        engines.append(engine)
    for _ in range(steps):  # the PP event loop: each micro-batch in turn
        for engine in engines:
            engine.step()
    for reporter in reporters:
        reporter.close()
    return records, expected, {stage: stream.getvalue() for stage, stream in streams.items()}


def sampled_one(seen):
    """Which steps ``micro_batches="one"`` samples: forward counts that are multiples of the interval."""
    return [(ct, mb, counts) for ct, mb, counts in seen if ct % INTERVAL == 0]


def sampled_every(seen):
    """Which steps ``micro_batches="every"`` samples, by its rule: an interval step, then each next
    step whose micro-batch was not sampled since, until a micro-batch comes round again."""
    out, round_ = [], None
    for ct, mb, counts in seen:
        if ct % INTERVAL == 0:
            round_ = {mb}
            out.append((ct, mb, counts))
        elif round_ is not None and mb not in round_:
            round_.add(mb)
            out.append((ct, mb, counts))
        else:
            round_ = None
    return out


def as_seen(records):
    return [(r.forward_ct, r.micro_batch, (r.swa_full_idx_divergence, r.swa_out_of_window_tokens)) for r in records]


def test_one_micro_batch_per_interval_is_always_the_same_one_with_an_even_interval():
    records, expected, _ = run_pipeline("one")
    for stage in (0, 1):
        assert as_seen(records[stage]) == sampled_one(expected[stage])
        # forwards alternate micro-batches 0, 1, 0, 1...: forward_ct 4k is always micro-batch 1,
        # so micro-batch 0 is never sampled (why SGLang's CI assertion takes peaks)
        assert {r.micro_batch for r in records[stage]} == {1}
        assert len(records[stage]) == 61 // INTERVAL  # 31 + 30 forward steps


def test_every_micro_batch_of_a_sampled_round():
    records, expected, _ = run_pipeline("every")
    for stage in (0, 1):
        seen = as_seen(records[stage])
        assert seen == sampled_every(expected[stage])
        # the round after each interval step: micro-batch 1 at 4k, micro-batch 0 at 4k + 1
        assert [(ct, mb) for ct, mb, _ in seen[:4]] == [(4, 1), (5, 0), (8, 1), (9, 0)]
        assert len(seen) == 2 * (61 // INTERVAL)
    # the two micro-batches hold different requests: their counts differ somewhere
    by_micro_batch = {mb: [counts for _, m, counts in as_seen(records[0]) if m == mb] for mb in (0, 1)}
    assert by_micro_batch[0] != by_micro_batch[1]
    assert any(out for _, out in by_micro_batch[0]) and any(out for _, out in by_micro_batch[1])


def test_micro_batch_on_the_audit_line_and_the_verdict_per_stage(tmp_path, capsys):
    records, _, logs = run_pipeline("every")
    for stage in (0, 1):
        found = find_all(logs[stage])
        assert [(r.forward_ct, r.micro_batch) for r in found] == [(r.forward_ct, r.micro_batch) for r in records[stage]]
        assert all(r.audited for r in found)  # the reference engine audits: micro-batch and audit on one line
        assert f'otel_swa_audit={{"forward_ct":5,"micro_batch":0,"swa_leaked_slots":0' in logs[stage]
    log = tmp_path / "server.log"
    log.write_text(logs[0] + logs[1])  # both stages' lines in one server log
    observation = assert_swa_divergence_observed(str(log))
    assert sorted(group.rank for group in observation.groups) == ["PP0", "PP1"]
    assert main(["check", str(log)]) == 0
    out = capsys.readouterr().out
    assert "PP0" in out and "PP1" in out


def test_micro_batch_as_event_attribute():
    record = run_pipeline("every", steps=3)[0][0][0]
    assert record.micro_batch == 1
    assert record_attributes(record)["kv_cache.swa.micro_batch"] == 1


@pytest.mark.parametrize("bad", [-1, 1024, 1.0, True, "0"])
def test_a_bad_micro_batch_is_refused_at_any_step(bad):
    reporter = SwaDivergenceReporter(100)
    with pytest.raises(ValueError, match="micro_batch must be None or an int from 0 to 1023"):
        reporter.step(None, micro_batch=bad)
    assert reporter.forward_ct == 0  # the step was not counted


def test_micro_batches_mode_is_checked():
    with pytest.raises(ValueError, match="micro_batches must be one of one, every, got 'all'"):
        SwaDivergenceReporter(1, micro_batches="all")


def test_micro_batches_from_the_environment():
    from otel_swa.config import ConfigError

    env = {"OTEL_SWA_DIVERGENCE_INTERVAL": "2", "OTEL_SWA_MICRO_BATCHES": " Every "}
    assert SwaDivergenceReporter.from_env(environ=env).micro_batches == "every"
    assert SwaDivergenceReporter.from_env(environ={"OTEL_SWA_DIVERGENCE_INTERVAL": "2"}).micro_batches == "one"
    with pytest.raises(ConfigError, match="OTEL_SWA_MICRO_BATCHES='each': expected one of one, every"):
        SwaDivergenceReporter.from_env(environ={**env, "OTEL_SWA_MICRO_BATCHES": "each"})


def test_micro_batch_splits_the_per_sample_gauges_not_the_totals(make_pipeline):
    from otel_swa.telemetry import configure

    pipeline = make_pipeline()
    tel = configure(exporters="none", use_global=False, set_global=False, environ={},
                    meter_provider=pipeline.meter_provider, tracer_provider=pipeline.tracer_provider,
                    logger_provider=pipeline.logger_provider)
    records, expected, _ = run_pipeline("every", steps=12)
    for record in records[0]:
        tel.sink(record, None)
    tel.sink.flush()
    metrics = pipeline.metrics()
    gauge = {dict(p.attributes).get("kv_cache.swa.micro_batch"): p.value
             for p in metrics["kv_cache.swa.tokens.out_of_window"]["points"]}
    last = {mb: counts[1] for _, mb, counts in sampled_every(expected[0])}  # the latest sample of each
    assert gauge == last and set(gauge) == {0, 1}
    totals = metrics["kv_cache.swa.forward_steps"]["points"]
    assert [dict(p.attributes) for p in totals] == [{}]
    tel.shutdown()
