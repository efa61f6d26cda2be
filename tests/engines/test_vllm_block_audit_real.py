"""The KV block audit, the window check and the pool gauges on vLLM 0.33.0's real Scheduler and
AsyncScheduler, healthy and with faults made on purpose (marker ``vllm``).

Real: vLLM's ``Scheduler`` / ``AsyncScheduler`` (the class ``SchedulerConfig.get_scheduler_cls``
picks), its ``KVCacheManager``, ``BlockPool`` and managers, driven as vLLM's engine core drives them
(``vllm_support.SchedulerDriver``), under the ``swa_vllm`` instrumentor sampling every forward step.
Stand-ins: the model runner's output (one sampled token per request that is not a prefill chunk),
and the faults of ``tests/engines/shims/vllm_faults.py``, each re-creating an upstream bug class.

Every expected value is a recount of that moment by plain loops over vLLM's objects
(``vllm_support.block_audit_recount``, ``window_recount``, ``pool_recount``: vLLM's own free queue
walk, ``block_hash``, ``get_num_skipped_tokens``, the tables) or vLLM's own figure
(``KVCacheManager.usage``, what ``vllm:kv_cache_usage_perc`` reports). The faults' rows are written
to ``$OTEL_SWA_DETECTION_DIR/detection.json`` and compared with the detection table of docs/engines.md.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

import detection_table
from opentelemetry.instrumentation.swa_vllm import SwaVllmInstrumentor
from otel_swa.cli import main as otel_swa_cli
from otel_swa.testing.judge import AUDIT_RULES, PROVENANCE_RULES, REPORTED_RULES
from otel_swa.views import vllm as vllm_view
from vllm_support import (
    BLOCK,
    PREEMPTING_BLOCKS,
    SchedulerDriver,
    block_audit_recount,
    instrumented_run,
    make_scheduler,
    trace_requests,
    vllm_classes,  # noqa: F401
)

pytestmark = pytest.mark.vllm

ENGINE = detection_table.ENGINE
FAULT_STEP = 30
FAILING = tuple(rule.field for rule in AUDIT_RULES + PROVENANCE_RULES)
REPORTED = tuple(rule.field for rule in REPORTED_RULES)
#: The audit and provenance fields a vLLM record carries (the others, SGLang's slot audit, the read
#: check, the write check and the stamps, are not measured on vLLM: None).
MEASURED = ("swa_premature_evictions", "kv_leaked_blocks", "kv_freed_blocks_in_use", "kv_shared_blocks",
            "kv_stale_cache_entries", "kv_foreign_blocks", "swa_late_held_slots")


@pytest.fixture
def instrumented(monkeypatch):
    """The ``swa_vllm`` instrumentor on, sampling every forward step, no telemetry providers."""
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor = SwaVllmInstrumentor()
    instrumentor.instrument()
    yield instrumentor
    instrumentor.uninstrument()


def check(log: Path) -> tuple[int, str]:
    """``otel-swa check LOG``: exit status and output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = otel_swa_cli(["check", str(log)])
    return status, out.getvalue()


def assert_matches_the_recounts(run) -> None:
    """Every step's record against the recounts of that moment, and the pool figures."""
    assert sorted(run.records) == list(range(1, run.steps + 1)), "a record for every forward step"
    for step, record in run.records.items():
        audit = run.audit[step]
        premature, late, _ = run.window[step]
        assert (record.swa_premature_evictions, record.swa_late_held_slots) == (premature, late), step
        assert (record.kv_leaked_blocks, record.kv_freed_blocks_in_use, record.kv_shared_blocks) == (
            len(audit.leaked), len(audit.freed), len(audit.shared)), step
        offenders = {o.fault: o for o in record.offenders}
        if audit.leaked:
            assert offenders["kv_leaked_blocks"].block == audit.leaked[0], step
        if audit.freed:
            o = offenders["kv_freed_blocks_in_use"]
            assert (o.block, o.kv_cache_group, o.request, o.position) == audit.freed[0], step
        if audit.shared:  # an entry of a shared block (which of its requests: the audit's table keeps one)
            o = offenders["kv_shared_blocks"]
            assert o.block in audit.shared and (o.block, o.kv_cache_group, o.request, o.position) in audit.entries, step
        hashes = run.hashes[step]
        assert (record.kv_cache_entries_checked, record.kv_stale_cache_entries, record.kv_foreign_blocks) == (
            hashes.checked, len(hashes.stale), len(hashes.foreign)), step
        if hashes.stale:
            o = offenders["kv_stale_cache_entries"]
            assert (o.block, o.kv_cache_group) == hashes.stale[0], step
            assert {o.request, o.other_request} - {None} <= set(hashes.holders.get(o.block, ())), step
        if hashes.foreign:
            o = offenders["kv_foreign_blocks"]
            assert (o.request, o.position, o.block, o.kv_cache_group) == hashes.foreign[0], step
            assert o.other_request is None or o.other_request in hashes.holders[o.block], step
        assert set(offenders) <= {"kv_leaked_blocks", "kv_freed_blocks_in_use", "kv_shared_blocks",
                                  "kv_stale_cache_entries", "kv_foreign_blocks"} | (
            {"swa_premature_evictions"} if premature else set()), step
        recount, usages, vllm_usage = run.pools[step]
        assert {u.pool: (u.used, u.available, u.evictable, u.total) for u in usages} == recount, step
        assert sum(u.used for u in usages) / usages[0].total == pytest.approx(vllm_usage), step


# ----------------------------------------------------------------------------------- the inputs
def test_block_audit_inputs_are_the_real_pool_at_every_step(vllm_classes, tmp_path):
    """``kv_block_audit_inputs`` against vLLM's own objects after every ``schedule()`` of an
    AsyncScheduler run (prefix hits, the window trimming, requests finishing)."""
    v = vllm_classes
    scheduler = make_scheduler(v, tmp_path / "tiny-llama", async_scheduling=True)
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    managers = kv.coordinator.single_type_managers
    seen = {"cached_free": 0, "null_skipped": 0, "groups": set()}

    def on_schedule(output):
        inputs = vllm_view.kv_block_audit_inputs(kv)
        assert inputs.num_blocks == pool.num_gpu_blocks and inputs.null_block_id == 0
        assert inputs.free_block_ids.tolist() == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert sorted(inputs.cached_block_ids.tolist()) == sorted(b.block_id for b in pool.blocks if b.block_hash is not None)
        expected = [(b.block_id, g, rid, j * m.block_size) for g, m in enumerate(managers)
                    for rid, blocks in m.req_to_blocks.items() for j, b in enumerate(blocks) if not b.is_null]
        ids = inputs.held_request_ids
        got = list(zip(inputs.held_block_ids.tolist(), inputs.held_groups.tolist(),
                       [ids[r] for r in inputs.held_rows.tolist()], inputs.held_positions.tolist()))
        assert got == expected
        assert all(t.dtype == torch.int64 for t in (inputs.free_block_ids, inputs.held_block_ids))
        seen["cached_free"] += len(set(inputs.free_block_ids.tolist()) & set(inputs.cached_block_ids.tolist()))
        seen["null_skipped"] += sum(b.is_null for m in managers for bl in m.req_to_blocks.values() for b in bl)
        seen["groups"] |= set(inputs.held_groups.tolist())

    SchedulerDriver(scheduler, on_schedule=on_schedule).run(trace_requests(v))
    assert seen["cached_free"] > 0 and seen["null_skipped"] > 0 and seen["groups"] == {0, 1}


def test_block_audit_inputs_refuse_what_is_not_a_kv_cache_manager():
    with pytest.raises(TypeError, match="is not vLLM's KVCacheManager"):
        vllm_view.kv_block_audit_inputs(object())


# ---------------------------------------------------------------------------------- clean runs
HEALTHY = {
    "Scheduler": dict(),
    "Scheduler, 66 blocks (preemption)": dict(num_blocks=PREEMPTING_BLOCKS),
    "AsyncScheduler": dict(async_scheduling=True),
    "AsyncScheduler, prefix caching off": dict(async_scheduling=True, prefix_caching=False),
    "Scheduler, 24 extra retained tokens": dict(extra_retained_tokens=24),
    "AsyncScheduler, 24 extra retained tokens": dict(async_scheduling=True, extra_retained_tokens=24),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_clean_runs_have_no_fault_of_any_kind(vllm_classes, tmp_path, instrumented, name):
    """Healthy runs of every configuration: at every forward step 0 leaked blocks, 0 blocks freed
    while in use, 0 shared blocks, 0 stale prefix-cache entries, 0 foreign blocks, 0 premature
    evictions and 0 late-held slots, each equal to the recount; the block hashes compared (every map
    entry and every hashed table entry at every step: the suite's pool is within the check's budget)
    are above 0 with prefix caching on and 0 without; the pool gauges equal vLLM's own usage;
    ``otel-swa check`` passes the run's log."""
    args = HEALTHY[name]
    run = instrumented_run(vllm_classes, tmp_path, **args)
    assert run.outcome == "finished"
    assert_matches_the_recounts(run)
    for step, record in run.records.items():
        measured = {f: getattr(record, f) for f in FAILING + REPORTED if getattr(record, f) is not None}
        assert measured == dict.fromkeys(MEASURED, 0), step
        assert record.offenders == (), step
    assert all(not run.audit[s].freed_cached and not run.audit[s].shared for s in run.audit)
    compared = [record.kv_cache_entries_checked for record in run.records.values()]
    if args.get("prefix_caching") is False:
        assert set(compared) == {0}
    else:
        assert min(compared[10:]) > 0 and sum(compared) > 1000
    status, output = check(run.log)
    assert status == 0, output
    assert run.driver.prefix_hits > 0 or args.get("prefix_caching") is False
    if args.get("async_scheduling"):
        assert run.driver.max_in_flight > 0  # steps were scheduled with the previous one in flight
        # vLLM's trimming under async scheduling keeps more than a block's rounding: without the
        # in-flight term of window_allowance these runs would count late-held slots
        assert sum(run.window[step][2] for step in run.window) > 0
    if args.get("extra_retained_tokens"):
        assert sum(run.window[step][2] for step in run.window) > 0
    if args.get("num_blocks") == PREEMPTING_BLOCKS:
        assert run.driver.preempted


# ------------------------------------------------------------------------------------- the zoo
#: (fault, configuration, scheduler arguments, upstream report it re-creates)
ZOO = (
    ("stale_table_entry", "Scheduler, prefix caching off", dict(prefix_caching=False), "vllm#42273 (#50702, #50749)"),
    ("stale_table_entry", "AsyncScheduler, prefix caching on", dict(async_scheduling=True), "vllm#42273 (#50702, #50749)"),
    ("foreign_free", "Scheduler, prefix caching off", dict(prefix_caching=False), "vllm#39589 (#50702)"),
    ("foreign_free", "AsyncScheduler, prefix caching on", dict(async_scheduling=True), "vllm#39589 (#50702)"),
    ("leaked_tail_block", "Scheduler", dict(), "neuralmagic/vllm#71 (vllm#27073)"),
    ("leaked_tail_block", "AsyncScheduler", dict(async_scheduling=True), "neuralmagic/vllm#71 (vllm#27073)"),
    ("late_eviction", "AsyncScheduler", dict(async_scheduling=True), "vllm#33711"),
    ("stale_cache_entry", "Scheduler", dict(), "local-inference-lab/vllm#480 (vllm#49125)"),
    ("stale_cache_entry", "AsyncScheduler", dict(async_scheduling=True), "local-inference-lab/vllm#480 (vllm#49125)"),
    ("other_group_block", "AsyncScheduler", dict(async_scheduling=True), "vllm#47574"),
    ("hash_of_another_index", "Scheduler", dict(), "ovg-project/kvcached#446 (#451)"),
)


def row_of(run, fault: str, configuration: str, upstream: str) -> dict:
    """The run's detection row (keys ``detection_table.KEYS``)."""
    signal, at = detection_table.first_signal(run.records, FAILING, REPORTED)
    offender = run.records[at].offender(signal) if at is not None and signal in FAILING else None
    return {
        "engine": ENGINE, "fault": f"{fault} ({configuration})", "upstream": upstream, "signal": signal,
        "injected_at": run.injection.injected_at, "first_forward_ct": at,
        "offender": offender.describe() if offender is not None else None, "check_exit": check(run.log)[0],
    }


@pytest.fixture(scope="module")
def zoo(vllm_classes, tmp_path_factory):
    """Every fault of ``ZOO`` made at step ``FAULT_STEP`` in its own instrumented run."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "1")
    instrumentor = SwaVllmInstrumentor()
    instrumentor.instrument()
    runs = []
    try:
        for fault, configuration, args, upstream in ZOO:
            directory = tmp_path_factory.mktemp(fault)
            run = instrumented_run(vllm_classes, directory, fault=f"{fault}@{FAULT_STEP}", **args)
            runs.append((run, row_of(run, fault, configuration, upstream)))
    finally:
        instrumentor.uninstrument()
        mp.undo()
    return runs


def test_every_fault_was_made_and_every_record_equals_the_recount(zoo):
    for run, row in zoo:
        assert run.injection.injected_at is not None and run.injection.injected_at >= FAULT_STEP, row
        assert_matches_the_recounts(run)


def test_the_leak_fails_check_with_its_block_named_at_the_next_step(zoo):
    for run, row in zoo:
        if not row["fault"].startswith("leaked_tail_block"):
            continue
        leaked = sorted(run.injection.blocks)
        assert row["signal"] == "kv_leaked_blocks" and row["first_forward_ct"] == run.injection.injected_at + 1
        assert row["offender"] == f"block {leaked[0]}"
        step = row["first_forward_ct"]
        assert run.records[step].kv_leaked_blocks == len(leaked) == len(run.audit[step].leaked)
        status, output = check(run.log)
        assert status == 1 and f"block {leaked[0]}" in output, output
        # leak or not, the pool gauges are vLLM's own usage (assert_matches_the_recounts); the
        # leaked blocks count as used, not available
        recount, usages, _ = run.pools[step]
        assert usages[0].available == recount["full"][1]


def test_the_late_eviction_is_reported_with_its_recount_and_not_failed(zoo):
    (run, row), = [(r, w) for r, w in zoo if w["fault"].startswith("late_eviction")]
    assert row["signal"] == "swa_late_held_slots" and row["first_forward_ct"] == run.injection.injected_at
    late = {step: r.swa_late_held_slots for step, r in run.records.items()}
    assert late == {step: run.window[step][1] for step in run.records}
    assert all(late[s] == 0 for s in late if s < run.injection.injected_at)
    assert sum(1 for s in late if late[s]) > 20 and row["check_exit"] == 0


def test_early_frees_are_flagged_with_or_without_the_prefix_cache(zoo):
    """The early frees: a held entry whose block is on the free queue (cached or not: a request that
    takes a cached block takes it off the free queue) is freed while in use, and a block without a
    hash in two requests' tables was handed out again. Both configurations fail ``check`` naming the
    request, position, block and group, the step after the fault or earlier."""
    for run, row in zoo:
        fault = row["fault"]
        if not fault.startswith(("stale_table_entry", "foreign_free")):
            continue
        made = run.injection.injected_at
        assert row["signal"] in ("kv_freed_blocks_in_use", "kv_shared_blocks") and row["check_exit"] == 1, row
        assert row["first_forward_ct"] <= made + 1, row
        status, output = check(run.log)
        assert status == 1 and row["offender"] in output, output
        if "prefix caching on" in fault:  # the freed blocks are cached ones, on the free queue while held
            assert run.audit[made + 1].freed_cached, row


#: The prefix-cache faults and the fault each fails ``check`` on first.
PREFIX_CACHE_SIGNALS = {"stale_cache_entry": "kv_stale_cache_entries", "other_group_block": "kv_foreign_blocks",
                        "hash_of_another_index": "kv_foreign_blocks"}


def test_prefix_cache_faults_fail_check_at_the_step_made_naming_block_and_request(zoo):
    """Stale prefix-cache entries, another group's blocks and blocks cached under another index's hash:
    vLLM runs on without a word (every run finishes); each record equals the recount
    (``test_every_fault_was_made_and_every_record_equals_the_recount``), and ``check`` fails at the
    step the fault was made, naming the block and its group and a request: the one whose table
    holds it (foreign), or, for a stale entry, the request whose KV the block now holds; the first
    block a stale entry hands out is then a foreign block of the request that took it."""
    for run, row in zoo:
        fault = row["fault"].split(" ")[0]
        if fault not in PREFIX_CACHE_SIGNALS:
            continue
        made = run.injection.injected_at
        assert row["signal"] == PREFIX_CACHE_SIGNALS[fault] and row["first_forward_ct"] == made, row
        assert row["check_exit"] == 1 and run.outcome == "finished", row
        offender = run.records[made].offender(row["signal"])
        assert offender.block is not None and offender.kv_cache_group is not None, row
        assert (offender.request or offender.other_request) is not None, row
        status, output = check(run.log)
        assert status == 1 and row["offender"] in output, output
        if fault == "stale_cache_entry":
            assert max(r.kv_stale_cache_entries for r in run.records.values()) > 10
            # what the stale entries handed out: blocks holding other tokens' KV (their new owner cached
            # them under another hash; the owner may have finished since), named with the request that
            # took them, and unhashed blocks two tables share (no longer excused by the stale entry)
            step = min(s for s, r in run.records.items() if r.kv_foreign_blocks)
            taken = run.records[step].offender("kv_foreign_blocks")
            assert taken.block in {block for block, _ in run.hashes[step].stale}, row
            assert any(r.kv_shared_blocks for r in run.records.values())
        if fault == "other_group_block":
            assert offender.kv_cache_group == 1 and offender.request == run.injection.request, row
        print(f"\n{row['fault']}: made at step {made}, flagged at {row['first_forward_ct']}; peak "
              f"stale entries {max(r.kv_stale_cache_entries for r in run.records.values())}, peak foreign "
              f"blocks {max(r.kv_foreign_blocks for r in run.records.values())}, records with a provenance "
              f"fault {sum(1 for r in run.records.values() if r.kv_stale_cache_entries or r.kv_foreign_blocks)} "
              f"of {len(run.records)}; {offender.describe()}")


def test_the_detection_rows_are_the_docs_table(zoo):
    rows = [row for _, row in zoo]
    path = detection_table.write_rows(ENGINE, rows)
    assert detection_table.read_rows(path, ENGINE) == rows
    documented = detection_table.docs_rows(detection_table.DOCS.read_text(), ENGINE)
    assert documented == rows, "docs/engines.md's detection table is stale: run the vLLM suite with " \
        f"{detection_table.ROWS_VARIABLE}=DIR, then python tests/engines/detection_table.py DIR --write"


#: What vLLM itself does after each fault of ``ZOO`` (docs/engines.md says it under the table):
#: its own assertion (``BlockPool.get_new_blocks``: ``assert block.ref_cnt == 0``), a stall, or
#: nothing.
VLLM_OUTCOMES = {
    "stale_table_entry (Scheduler, prefix caching off)": "AssertionError in block_pool.get_new_blocks",
    "stale_table_entry (AsyncScheduler, prefix caching on)": "AssertionError in block_pool.get_new_blocks",
    "foreign_free (Scheduler, prefix caching off)": "AssertionError in block_pool.get_new_blocks",
    "foreign_free (AsyncScheduler, prefix caching on)": "AssertionError in block_pool.get_new_blocks",
    "leaked_tail_block (Scheduler)": "finished",
    "leaked_tail_block (AsyncScheduler)": "stalled",
    "late_eviction (AsyncScheduler)": "finished",
    "stale_cache_entry (Scheduler)": "finished",
    "stale_cache_entry (AsyncScheduler)": "finished",
    "other_group_block (AsyncScheduler)": "finished",
    "hash_of_another_index (Scheduler)": "finished",
}


def test_what_vllm_itself_does_after_each_fault(zoo):
    assert {row["fault"]: run.outcome.split(" at step")[0] for run, row in zoo} == VLLM_OUTCOMES
    for run, row in zoo:
        if "at step" in run.outcome:  # vLLM's assertion comes after otel-swa flagged the run, or never
            raised_at = int(run.outcome.rsplit(" ", 1)[1])
            assert row["first_forward_ct"] is None or row["first_forward_ct"] <= raised_at, row

