"""Provenance inside the reference engine: clean runs verify every live slot and find nothing, and each
fault of ``provenance_faults`` is flagged at the step it was made with its first offender named."""

from __future__ import annotations

import pytest

from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.reporter import SwaDivergenceReporter

import provenance_faults as faults
import sample_readings
from engine_runs import run_trace

# SWA pool as large as the FULL pool: raw FULL slots stay inside the SWA buffers
CONFIG = dict(window=32, full_pool_size=16384, swa_pool_size=16384, max_running=16, token_budget=512,
              max_context_len=8192)


def readings_of(reporter, monkeypatch) -> list:
    """``[(forward_ct, SampleReading)]`` of every sample ``reporter`` delivers, at the step it was
    taken (on the CPU a sample is read at its own step)."""
    readings = []
    sample_readings.capture(reporter, readings, monkeypatch.setattr)
    return readings


def run(fault=None, *, interval=5, requests=24, page_size=1, budget=1 << 16, max_steps=None, monkeypatch, **config):
    """Run the engine (until every request finished, or ``max_steps`` steps ran); return it and
    ``[(forward_ct, SampleReading)]`` of every sample."""
    reporter = SwaDivergenceReporter(interval)
    readings = readings_of(reporter, monkeypatch)
    engine_config = EngineConfig(**{**CONFIG, **config}, page_size=page_size)
    slots = (engine_config.full_pool_size // page_size + 1) * page_size
    swa_slots = (engine_config.swa_pool_size // page_size + 1) * page_size
    reporter.enable_provenance(full_slots=slots, swa_slots=swa_slots, budget=budget,
                               checksum=engine_config.provenance)
    engine = ReferenceEngine(engine_config, reporter=reporter)
    run_trace(engine, requests, fault, max_steps)
    reporter.close()
    return engine, readings


def flagged(readings, name):
    return [(step, r) for step, r in readings if getattr(r.provenance, name)]


def first_flagged(install, name, monkeypatch):
    """Run with the fault ``install(engine)``; return what it made, and the step and provenance
    reading of the first sample with ``name`` (``foreign_tokens``, ``corrupt_tokens``)."""
    # 80 of the run's 198 steps: in the whole run each fault of these tests (made at step 25 to 43) is
    # flagged at steps 25 to 75 and never after, the same samples as in the 80
    engine, readings = run(install, max_steps=80, monkeypatch=monkeypatch)
    (made,) = engine.fault_log
    step, first = flagged(readings, name)[0]
    return made, step, first.provenance, readings


def foreign_in_the_full_pool_at(install, at, monkeypatch):
    """Run with the fault ``install(engine, at)``; assert that the first sample with a foreign token
    is step ``at`` and that its first offender is in the FULL pool; return what the fault made and
    that offender."""
    made, step, provenance, _ = first_flagged(lambda e: install(e, at), "foreign_tokens", monkeypatch)
    assert step == at
    offender = provenance.foreign_offender
    assert offender["pool"] == "full"
    return made, offender


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_runs_verify_every_live_slot_and_flag_nothing(page_size, monkeypatch):
    engine, readings = run(page_size=page_size, monkeypatch=monkeypatch)
    assert readings and all(r.provenance is not None for _, r in readings)
    for step, r in readings:
        p = r.provenance
        assert (p.foreign_tokens, p.corrupt_tokens, r.write[1]) == (0, 0, 0), step
        assert p.foreign_offender is None and p.corrupt_offender is None and r.write_offender is None
        # every live slot of the batch, both pools, was judged: the budget covers them all here
        assert p.stamp_unchecked == 0 and p.checksum_unchecked == 0, step
        assert p.stamp_checks == p.checksum_checks > 0
    # the FULL pool's live slots are the batch's tokens; the SWA pool's are counted with them
    last_step, last = readings[-1]
    assert last.provenance.stamp_checks >= sum(item.seq_len for item in engine.last_batch) or last_step != engine.forward_ct
    # 8 new tokens (or the step's, when fewer) of one layer of each pool kind per sampled step
    assert all(r.write[0] > 0 and r.write[0] <= 16 and r.write[2] == 0 for _, r in readings)


def test_the_default_budget_rotates_over_the_live_slots(monkeypatch):
    _, readings = run(budget=256, monkeypatch=monkeypatch, interval=3)
    p = [r.provenance for _, r in readings]
    assert all(x.foreign_tokens == 0 and x.corrupt_tokens == 0 for x in p)
    assert max(x.stamp_checks for x in p) <= 2 * 256  # at most the budget per pool
    assert sum(x.stamp_unchecked for x in p) > 0


def test_a_swa_write_at_the_full_index_is_caught_by_the_write_check_and_the_checksums(monkeypatch):
    engine, readings = run(faults.install_swa_write_at_full_index, monkeypatch=monkeypatch)
    writes = [(step, r) for step, r in readings if r.write[1]]
    corrupt = flagged(readings, "corrupt_tokens")
    assert writes and corrupt
    step, first = writes[0]
    offender = first.write_offender
    # the fault writes the right slot while the SWA allocator has not remapped: nothing to see until then
    assert offender["layer"] == 1 and offender["swa_slot"] != offender["full_slot"]
    assert corrupt[0][1].provenance.corrupt_offender["pool"] == "swa"
    # the stamps are written through the engine's own (right) tables: no foreign token
    assert not flagged(readings, "foreign_tokens")
    # the full-attention layer's writes stay right
    assert all(r.write_offender is None or r.write_offender["layer"] == 1 for _, r in readings)


@pytest.mark.parametrize("at", [40, 43])
def test_swapped_ownership_is_a_foreign_token_at_the_step_or_the_next_sample(at, monkeypatch):
    made, step, provenance, readings = first_flagged(lambda e: faults.install_swapped_ownership(e, at),
                                                     "foreign_tokens", monkeypatch)
    assert step == -(-at // 5) * 5  # the first sample at or after the step it was made
    offender = provenance.foreign_offender
    if step == at:  # sampled at the step itself: the token that was swapped, in the SWA pool
        assert offender["pool"] == "swa"
        assert (offender["entry"], offender["position"], offender["full_slot"], offender["swa_slot"]) == (
            made["entry"], made["position"], made["full_slot"], made["swa_slot"])
        assert (offender["expected_token"], offender["found_token"], offender["found_position"]) == (
            made["expected_token"], made["found_token"], made["found_position"])
    assert all(r.provenance.corrupt_tokens == 0 for _, r in readings)  # the bytes of every slot are its own


def test_a_stale_prefix_is_a_foreign_token_of_the_full_pool(monkeypatch):
    made, offender = foreign_in_the_full_pool_at(faults.install_stale_prefix, 30, monkeypatch)
    assert (offender["entry"], offender["position"], offender["full_slot"]) == (made["entry"], 0, made["full_slots"][0])
    assert offender["expected_token"] == made["ids_a"][0] and offender["found_token"] == made["ids_b"][0]
    assert offender["found_position"] == offender["expected_position"] == 0
    assert offender["row"] == made["row"]


def test_a_wrong_position_is_a_foreign_token_naming_both_positions(monkeypatch):
    made, offender = foreign_in_the_full_pool_at(faults.install_wrong_position, 35, monkeypatch)
    assert (offender["entry"], offender["position"], offender["full_slot"]) == (
        made["entry"], made["position"], made["full_slot"])
    assert (offender["expected_position"], offender["found_position"]) == (made["position"], made["position"] + 1)
    assert offender["expected_token"] == offender["found_token"] == made["token"]


@pytest.mark.parametrize("pool", ["full", "swa"])
@pytest.mark.parametrize("used", [False, True])
def test_a_flipped_byte_is_a_corrupt_token_of_its_pool(pool, used, monkeypatch):
    made, step, provenance, readings = first_flagged(lambda e: faults.install_byte_flip(e, 25, pool, used),
                                                     "corrupt_tokens", monkeypatch)
    assert step == 25
    offender = provenance.corrupt_offender
    assert (offender["pool"], offender["entry"], offender["position"], offender["full_slot"]) == (
        pool, made["entry"], made["position"], made["full_slot"])
    assert offender["swa_slot"] == made["swa_slot"]
    assert provenance.corrupt_tokens == 1
    assert not flagged(readings, "foreign_tokens")  # the stamps say the slot is the token's


DEEP_FAULTS = {
    "a bit past the first 64 bytes of a SWA V row": (lambda e: faults.install_bit_flip_past_the_prefix(e, 25, "swa")),
    "a bit past the first 64 bytes of a FULL V row": (lambda e: faults.install_bit_flip_past_the_prefix(e, 25, "full")),
    "a stray write in the last layer only": (lambda e: faults.install_stray_write_in_the_last_layer(e, 25)),
}


@pytest.mark.parametrize("name", list(DEEP_FAULTS))
def test_every_layer_and_every_byte_by_default_the_changed_layer_named(name, monkeypatch):
    """Rows of 128 bytes (2 heads of 16, float32): the default checksum sees a byte past the first 64
    and the model's last layer, and the first offender names the layer; ``prefix`` misses the bit."""
    # 60 of the run's 198 steps: the fault made at step 25 is seen at steps 25 to 40 in the whole run too
    engine, readings = run(DEEP_FAULTS[name], num_heads=2, max_steps=60, monkeypatch=monkeypatch)
    (made,) = engine.fault_log
    step, first = flagged(readings, "corrupt_tokens")[0]
    assert step == made["step"] == 25
    offender = first.provenance.corrupt_offender
    assert {k: offender[k] for k in ("pool", "entry", "position", "full_slot", "swa_slot", "layer")} == {
        k: made[k] for k in ("pool", "entry", "position", "full_slot", "swa_slot", "layer")}
    assert first.provenance.corrupt_tokens == 1 and not flagged(readings, "foreign_tokens")
    if "bit" in name:  # past the 64 bytes the cheaper option covers (the last layer is the only SWA one here)
        _, readings = run(DEEP_FAULTS[name], num_heads=2, provenance="prefix", max_steps=60, monkeypatch=monkeypatch)
        assert readings and not flagged(readings, "corrupt_tokens")


# ---------------------------------------------------------------------- a whole engine, both ways
def engine_readings(recorded: bool, monkeypatch, fault=None):
    reporter = SwaDivergenceReporter(4)
    reporter.gate.force_recorded = recorded  # every forward runs the checks, the flag decides
    readings = readings_of(reporter, monkeypatch)
    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=4096, swa_pool_size=4096, max_running=8,
                                          token_budget=256, max_context_len=4096), reporter=reporter)
    run_trace(engine, 10, fault, max_steps=60)
    reporter.close()
    return readings


@pytest.mark.parametrize("faulty", [False, True])
def test_an_engine_on_the_recorded_path_gives_the_eager_readings(faulty, monkeypatch):
    """Every forward runs the read check and the write check as a CUDA graph would hold them (the
    flag set only at sampled steps): each sample's readings equal the eager engine's, faults included."""
    fault = faults.install_swa_write_at_full_index if faulty else None
    eager = engine_readings(False, monkeypatch, fault)
    recorded = engine_readings(True, monkeypatch, fault)
    assert [step for step, _ in eager] == [step for step, _ in recorded] == list(range(4, 61, 4))
    for (step, a), (_, b) in zip(eager, recorded):
        assert (a.read, a.read_offender, a.write, a.write_offender, a.provenance) == (
            b.read, b.read_offender, b.write, b.write_offender, b.provenance), step
    assert any(r.write[1] for _, r in eager) == faulty
    assert all(r.read[0] > 0 for _, r in eager)


# ---------------------------------------------------------------------- the records and otel-swa check
FAULTS = {
    "sglang#20181 write at the FULL index": (faults.install_swa_write_at_full_index, "kv_write_mismatches"),
    "swapped ownership": (lambda e: faults.install_swapped_ownership(e, 40), "kv_foreign_tokens"),
    "sglang#31486 stale prefix": (lambda e: faults.install_stale_prefix(e, 30), "kv_foreign_tokens"),
    "sglang#33656 wrong position": (lambda e: faults.install_wrong_position(e, 35), "kv_foreign_tokens"),
    "real_kv_post_forward, SWA pool": (lambda e: faults.install_byte_flip(e, 25, "swa"), "kv_corrupt_tokens"),
    "real_kv_used, FULL pool": (lambda e: faults.install_byte_flip(e, 25, "full", used=True), "kv_corrupt_tokens"),
}
#: forward steps the logged fault runs take (the whole run: 198): past the first sample each fault
#: shows at (step 25 - 40; the write at the FULL index once the SWA allocator remaps: step 80)
FAULT_STEPS = {"sglang#20181 write at the FULL index": 100}
FAULT_STEPS_DEFAULT = 60


def logged_run(fault, log, max_steps=None, **config):
    import logging

    from otel_swa.logline import LogLineSink

    records = []
    logger = logging.getLogger(f"test_provenance.{id(records)}")
    logger.propagate = False
    handler = logging.FileHandler(log)
    logger.addHandler(handler)
    reporter = SwaDivergenceReporter(5, sinks=[lambda record, context: records.append(record), LogLineSink(logger)])
    engine = ReferenceEngine(EngineConfig(**{**CONFIG, **config}, provenance_budget=1 << 16), reporter=reporter)
    run_trace(engine, 24, fault, max_steps)
    reporter.close()
    handler.close()
    return engine, records


def test_a_clean_run_passes_check_with_every_provenance_field_zero(tmp_path, capsys):
    from otel_swa.cli import main

    log = tmp_path / "clean.log"
    _, records = logged_run(None, log)
    assert records and all(r.provenance_checked for r in records)
    assert all((r.kv_write_mismatches, r.kv_foreign_tokens, r.kv_corrupt_tokens) == (0, 0, 0) for r in records)
    assert sum(r.kv_stamp_checks for r in records) > 0 and sum(r.kv_write_checks for r in records) > 0
    assert main(["check", str(log)]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("name", list(FAULTS))
def test_check_fails_each_fault_naming_its_first_offender(name, tmp_path, capsys):
    from otel_swa.cli import main

    install, fault = FAULTS[name]
    log = tmp_path / "fault.log"
    _, records = logged_run(install, log, FAULT_STEPS.get(name, FAULT_STEPS_DEFAULT))
    first = next(r for r in records if getattr(r, fault))
    offender = first.offender(fault)
    assert offender is not None and offender.pool in ("full", "swa") and offender.request is not None
    capsys.readouterr()
    assert main(["check", str(log)]) == 1
    out = capsys.readouterr().out
    assert fault in out and offender.describe() in out, out


@pytest.mark.parametrize("name", list(DEEP_FAULTS))
def test_check_fails_a_deep_fault_naming_its_layer(name, tmp_path, capsys):
    from otel_swa.cli import main

    log = tmp_path / "deep.log"
    engine, records = logged_run(DEEP_FAULTS[name], log, FAULT_STEPS_DEFAULT, num_heads=2)
    (made,) = engine.fault_log
    first = next(r for r in records if r.kv_corrupt_tokens)
    offender = first.offender("kv_corrupt_tokens")
    assert (offender.pool, offender.position, offender.layer) == (made["pool"], made["position"], made["layer"])
    capsys.readouterr()
    assert main(["check", str(log)]) == 1
    out = capsys.readouterr().out
    assert "kv_corrupt_tokens" in out and offender.describe() in out and f"layer {made['layer']}" in out, out


def test_a_replay_whose_engine_flips_a_written_byte_exits_1_and_says_why(monkeypatch, capsys):
    """``otel-swa replay``'s own verdict takes provenance's faults too: the reference engine with
    SGLang's ``real_kv_post_forward`` perturbation made at step 25 (a byte of the FULL pool's K flipped
    after the write) exits 1 with the reason on stderr, where the same replay without it exits 0."""
    from otel_swa.cli import main
    from otel_swa.reference import replay as reference_replay

    run = ["replay", "--requests", "20", "--interval", "5", "--no-progress", "--exporter", "logline"]
    assert main(run) == 0
    capsys.readouterr()
    real = reference_replay.ReferenceEngine

    def faulty(*args, **kwargs):
        engine = real(*args, **kwargs)
        faults.install_byte_flip(engine, 25, "full")
        return engine

    monkeypatch.setattr(reference_replay, "ReferenceEngine", faulty)
    assert main(run) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "otel-swa replay: the write check and provenance found KV that is not the KV of the token the tables name "
        "(peak kv_corrupt_tokens=") and err[0].endswith("); exit status 1"), err
