"""The read check inside the reference engine: 0 disagreements on healthy runs, and the wrong reads of
``read_faults`` caught with their first offender named, by the records and by ``otel-swa check``."""

from __future__ import annotations

import pytest

from otel_swa.cli import main
from otel_swa.logline import LogLineSink
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reference.trace import load_trace
from otel_swa.reporter import SwaDivergenceReporter

import read_faults
from engine_runs import run_trace

# SWA pool as large as the FULL pool: raw FULL slots stay inside the SWA buffers (no IndexError)
CONFIG = dict(window=32, full_pool_size=16384, swa_pool_size=16384, max_running=16, token_budget=512,
              max_context_len=8192)


def run(fault=None, *, page_size=1, interval=10, requests=24, read_check="rotate", log=None):
    records, batches, holder = [], [], {}
    # on the CPU a record reaches its sinks at its own step: the engine's last batch is the sampled one
    sinks = [lambda record, context: records.append(record) or batches.append(len(holder["engine"].last_batch))]
    if log is not None:
        import logging

        logger = logging.getLogger(f"test_read_check.{id(records)}")
        logger.propagate = False
        handler = logging.FileHandler(log)
        logger.addHandler(handler)
        sinks.append(LogLineSink(logger))
    reporter = SwaDivergenceReporter(interval, sinks=sinks)
    engine = holder["engine"] = ReferenceEngine(EngineConfig(**CONFIG, page_size=page_size, read_check=read_check),
                                                reporter=reporter)
    engine.sampled_batches = batches
    run_trace(engine, requests, fault)
    reporter.close()
    if log is not None:
        handler.close()
    return engine, records


@pytest.mark.parametrize("page_size", [1, 16])
def test_healthy_runs_check_every_sampled_step_and_disagree_nowhere(page_size):
    engine, records = run(page_size=page_size)
    # 8 queries a sampled step, or one per request of a smaller batch
    assert [r.swa_read_checks for r in records] == [min(8, batch) for batch in engine.sampled_batches]
    assert [r.swa_read_mismatches for r in records] == [0] * len(records)
    assert all(r.offenders == () for r in records)
    # the runs did remap SWA slots: raw FULL reads would read other tokens
    assert max(r.swa_full_idx_divergence for r in records) > 0


def test_raw_full_reads_are_caught_once_the_swa_allocator_remaps():
    engine, records = run(read_faults.install_raw_full_read)
    faulty = [r for r in records if r.swa_read_mismatches]
    assert faulty, [(r.forward_ct, r.swa_full_idx_divergence) for r in records]
    first = faulty[0]
    # no disagreement can come before the SWA allocator remapped a token the reads touch
    assert all(r.swa_full_idx_divergence > 0 for r in faulty)
    (offender,) = first.offenders
    assert offender.fault == "swa_read_mismatches" and offender.layer == 1
    assert offender.swa_slot == offender.swa_page  # page size 1
    assert offender.request is not None and int(offender.request) in range(24)
    assert offender.position >= CONFIG["window"]  # remapped tokens are those past the first window


@pytest.mark.parametrize("off", [-1, 1])
def test_a_kernel_window_one_off_is_caught(off):
    _, records = run(lambda engine: read_faults.install_window_off(engine, off))
    assert sum(r.swa_read_mismatches for r in records) >= len(records) // 2


def test_read_check_off_leaves_the_fields_absent():
    _, records = run(read_faults.install_raw_full_read, read_check="off")
    assert records and all(r.swa_read_checks is None and r.swa_read_mismatches is None for r in records)


def test_check_fails_the_log_of_a_wrong_read_and_names_the_first_offender(tmp_path, capsys):
    healthy, bad = tmp_path / "healthy.log", tmp_path / "bad.log"
    run(log=healthy)
    _, records = run(read_faults.install_raw_full_read, log=bad)
    assert main(["check", str(healthy)]) == 0
    capsys.readouterr()
    assert main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    first = next(r for r in records if r.swa_read_mismatches)
    offender = first.offenders[0]
    assert (f"first non-zero at forward_ct={first.forward_ct}" in out or f"at forward_ct={first.forward_ct}" in out), out
    assert (f"request {offender.request} (row {offender.row}), position {offender.position}, FULL slot "
            f"{offender.full_slot}, SWA slot {offender.swa_slot} (page {offender.swa_page}), layer 1") in out, out


def test_the_check_runs_at_sampled_steps_only():
    calls = []
    engine = ReferenceEngine(EngineConfig(**CONFIG), reporter=SwaDivergenceReporter(5))
    real = engine.reporter.read_check.check_layer
    engine.reporter.read_check.check_layer = lambda **kw: calls.append(engine.forward_ct + 1) or real(**kw)
    for request in load_trace("conv", limit=6):
        engine.submit(request, arrival_s=0.0)
    for _ in range(20):
        engine.step()
    assert calls == [5, 10, 15, 20]


def test_an_engine_without_a_model_has_no_read_check():
    reporter = SwaDivergenceReporter(5)
    ReferenceEngine(EngineConfig(**CONFIG, run_model=False), reporter=reporter)
    assert reporter.read_check is None
