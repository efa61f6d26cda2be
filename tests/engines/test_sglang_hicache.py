"""otel-swa with SGLang's hierarchical cache (HiCache) inside a real sglang 0.5.23 ``Engine`` on CPU
(markers ``sglang``, ``sglang_engine``): the KV's provenance follows the KV to the host pools and
back, and the faults of that tier fail ``otel-swa check`` naming their first offender.

Every run is the engine suite's (``sglang_engine/harness.py``: the tiny Mellum model, a 160-token
device pool, 16 requests of the Azure trace sharing a 16-token system prompt, then 4 of them again),
started with plain ``python`` (otel-swa's SGLang plugin), HiCache on with a host pool 10 times the
device pool (``hicache_ratio``), the ``direct`` I/O backend and the ``layer_first`` layout (the CPU
shims stand in for its two CUDA-only calls: ``shims/sglang_cpu/sglang_hicache_cpu.py``), the
overlap scheduler off. Shared prefixes are backed up to the host, evicted from the small device pool
and loaded back for later requests (both pools: FULL and SWA).

Expected values come from elsewhere than the code under test: the probe's plain-Python count of the
host pools' copies (``shims/sglang_cpu/sglang_hicache_probe.py``), a run of the same traffic without
HiCache (its outputs), and the faults' own records of what they changed
(``shims/sglang_cpu/fault_hicache_tier.py``).

Clean runs (:data:`CLEAN`): write policy ``write_through`` with page size 1, ``write_back`` and
``write_through_selective`` with page size 4, each sampled every :data:`INTERVAL` steps. Fault runs (:data:`FAULTS`, write_through, page 1,
every step sampled): one fault each, made from step :data:`AT_STEP` on. Their rows make the table in
docs/engines.md ("KV across tiers"), which the suite compares with its runs
(``OTEL_SWA_UPDATE_DOCS=1`` rewrites it).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from otel_swa.record import FAULT_FIELDS

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_engine]

INTERVAL = 5
AT_STEP = 20
HICACHE = {"enable_hierarchical_cache": True, "hicache_ratio": 10, "hicache_io_backend": "direct",
           "hicache_mem_layout": "layer_first", "disable_overlap_schedule": True, "kv_canary": "none"}
#: clean run -> (its page size, its HiCache write policy, the pools it loads back from the host). With
#: ``write_through_selective`` SGLang backs up only a prefix hit often enough (the shared system
#: prompt here): its FULL part stays on the device, its SWA window tail comes back from the host.
CLEAN = {"write_through": (1, "write_through", ("full", "swa")), "write_back_paged": (4, "write_back", ("full", "swa")),
         "write_through_selective_paged": (4, "write_through_selective", ("swa",))}
#: fault -> its class (the table's "re-creates" column)
FAULTS = {
    "hicache_load_bytes_changed": "host memory corruption or a bad host -> device transfer (a load-back whose "
                                  "bytes changed)",
    "hicache_load_wrong_slots": "a load into the wrong device slots (a bad index translation)",
    "hicache_stale_host_copy": "a stale host copy (a host slot freed and reused while the radix tree points to it)",
    "hicache_skipped_swa_backup": "a skipped backup of the SWA window tail",
}
#: the signal each fault must raise
EXPECTED_SIGNAL = {"hicache_load_bytes_changed": "kv_corrupt_tokens", "hicache_load_wrong_slots": "kv_foreign_tokens",
                   "hicache_stale_host_copy": "kv_foreign_tokens", "hicache_skipped_swa_backup": "kv_foreign_tokens"}
SELECTED = [f for f in os.environ.get("OTEL_SWA_TEST_HICACHE_FAULTS", ",".join(FAULTS)).split(",") if f in FAULTS]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
TABLE_BEGIN = "<!-- detection table: sglang hicache (written by tests/engines/test_sglang_hicache.py) -->"
TABLE_END = "<!-- end of the sglang hicache detection table -->"


def _require() -> None:
    from test_sglang_engine import _require as require

    require()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _require()
    from sglang_engine.harness import build_model

    return build_model(tmp_path_factory.mktemp("hicache-model"))


def _run(tmp_path_factory, model, name: str, *, engine: dict, env: dict):
    from sglang_engine.harness import read_probe, run_engine

    directory = tmp_path_factory.mktemp(name)
    run = run_engine(directory, model, None, engine=engine, launcher=False, collector=False,
                     env={"OTEL_SWA_DIVERGENCE_INTERVAL": str(INTERVAL),
                          "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false", **env})
    run.directory = directory
    run.faults = read_probe(directory / "probe", "faults")
    run.outputs = [r["output_ids"] for r in run.results["requests"]]
    return run


def last_counts(run) -> dict:
    """The probe's last line with HiCache's counts: ``{"hicache": recount, "tier": otel-swa's}``."""
    line = [line for line in run.probe if "hicache" in line][-1]
    return {"hicache": line["hicache"], "tier": line.get("tier")}


@pytest.fixture(scope="module")
def without_hicache(tmp_path_factory, model):
    """The same traffic without HiCache, per page size of :data:`CLEAN` (outputs to compare)."""
    return {page: _run(tmp_path_factory, model, f"no-hicache-page{page}",
                       engine={"page_size": page, "disable_overlap_schedule": True, "kv_canary": "none"}, env={})
            for page in sorted({page for page, _, _ in CLEAN.values()})}


@pytest.fixture(scope="module", params=list(CLEAN))
def clean(request, tmp_path_factory, model):
    page, policy, loaded = CLEAN[request.param]
    run = _run(tmp_path_factory, model, request.param,
               engine={**HICACHE, "page_size": page, "hicache_write_policy": policy}, env={})
    run.page, run.loaded = page, loaded
    return run


def _faults_of(record) -> dict:
    return {name: getattr(record, name) for name in FAULT_FIELDS if getattr(record, name)}


# ------------------------------------------------------------------ clean runs
def test_hicache_backs_up_both_pools_and_a_shared_prefix_comes_back_from_the_host(clean):
    counts = last_counts(clean)["hicache"]
    assert set(counts) == {"full", "swa"}
    for pool in ("full", "swa"):
        assert counts[pool]["backups"] > 0 and counts[pool]["backed_up_slots"] > 0, pool
        assert (counts[pool]["loaded_slots"] > 0) == (pool in clean.loaded), (pool, counts[pool])
    if "full" in clean.loaded:
        # a repeat found more than the system prompt cached: its own prefix, part of it from the host
        second = [r for r in clean.results["requests"] if r["wave"] == 1]
        assert max(r["cached_tokens"] for r in second) > 16
    assert "Retract requests" in clean.log  # retracted requests' KV went through the tree and back too


def test_the_host_tables_moved_with_every_copy_hicache_made(clean):
    counts = last_counts(clean)
    for pool in ("full", "swa"):
        ours, theirs = counts["tier"][pool], counts["hicache"][pool]
        assert {k: ours[k] for k in ("backups", "backed_up_slots", "loads", "loaded_slots")} == {
            k: theirs[k] for k in ("backups", "backed_up_slots", "loads", "loaded_slots")}, pool
        assert ours["unfollowed_slots"] == 0, pool  # every host slot loaded was written by a backup


def test_outputs_with_hicache_equal_the_outputs_without(clean, without_hicache):
    assert clean.outputs == without_hicache[clean.page].outputs


def test_clean_hicache_runs_check_provenance_and_report_no_fault_of_any_kind(clean, tmp_path):
    from otel_swa.cli import main

    assert "KV provenance is off" not in clean.log
    samples = clean.ours
    assert len(samples) > 20
    assert sum(r.kv_stamp_checks or 0 for r in samples) > 0 and sum(r.kv_checksum_checks or 0 for r in samples) > 0
    false_faults = {name: sum(getattr(r, name) or 0 for r in samples) for name in FAULT_FIELDS}
    assert false_faults == {name: 0 for name in FAULT_FIELDS}
    path = tmp_path / "engine.log"
    path.write_text(clean.log)
    assert main(["check", str(path)]) == 0


# ------------------------------------------------------------------ faults of the tier
@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory, model):
    runs = {}
    for fault in SELECTED:
        run = _run(tmp_path_factory, model, fault, engine={**HICACHE, "page_size": 1},
                   env={"OTEL_SWA_DIVERGENCE_INTERVAL": "1", "OTEL_SWA_TEST_SGLANG_FAULT": fault,
                        "OTEL_SWA_TEST_SGLANG_FAULT_AT_STEP": str(AT_STEP)})
        run.fault = fault
        runs[fault] = run
    return runs


@pytest.fixture(scope="module")
def clean_outputs(tmp_path_factory, model):
    """The outputs of the fault runs' configuration without a fault."""
    return _run(tmp_path_factory, model, "fault-free", engine={**HICACHE, "page_size": 1}, env={}).outputs


def _check_exit(log: str, path: Path) -> int:
    import contextlib
    import io

    from otel_swa.cli import main

    path.write_text(log)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["check", str(path)])


def row_of(run, clean_outputs: list) -> dict:
    """The table's row of one fault run."""
    (made,) = run.faults
    flagged = [r for r in run.ours if _faults_of(r)]
    first = flagged[0] if flagged else None
    signals = sorted({name for r in flagged for name in _faults_of(r)}, key=FAULT_FIELDS.index)
    offender = first.offender(signals[0]) if first is not None and signals else None
    changed = sum(a != b for a, b in zip(run.outputs, clean_outputs))
    return {
        "fault": run.fault, "class": FAULTS[run.fault], "signal": ", ".join(signals) or "none",
        "made_at": made["step"], "first_flagged": first.forward_ct if first is not None else None,
        "offender": dataclasses.replace(offender, request=None).describe() if offender is not None else None,
        "request": offender.request if offender is not None else None,
        "host_slot": made.get("host_slot", made.get("host_slots", [None])[0] if "host_slots" in made else None),
        "outputs_changed": f"{changed} of {len(clean_outputs)}",
        "check_exit": _check_exit(run.log, run.directory / "check.log"),
        "made": made,
        "offender_fields": offender.location() if offender is not None else {},
    }


@pytest.fixture(scope="module")
def rows(fault_runs, clean_outputs):
    return {fault: row_of(run, clean_outputs) for fault, run in fault_runs.items()}


@pytest.fixture(params=SELECTED)
def fault(request, fault_runs, rows):
    return fault_runs[request.param], rows[request.param]


def test_the_fault_was_made_and_no_sample_before_it_shows_a_fault(fault):
    run, row = fault
    assert len(run.faults) == 1, run.faults
    before = [r for r in run.ours if r.forward_ct < row["made_at"]]
    assert before and [(r.forward_ct, _faults_of(r)) for r in before if _faults_of(r)] == []


def test_check_fails_the_fault_naming_its_first_offender_where_the_fault_was_made(fault):
    run, row = fault
    made, where = row["made"], row["offender_fields"]
    assert EXPECTED_SIGNAL[run.fault] in row["signal"].split(", "), row
    assert row["check_exit"] == 1 and row["first_flagged"] >= row["made_at"]
    if run.fault == "hicache_load_bytes_changed":
        # a slot loaded from the changed host rows, in the layer changed
        assert where.get("full_slot") in made["full_slots"] and (where.get("layer"), where.get("pool")) == (
            made["layer"], "full"), row
    elif run.fault == "hicache_load_wrong_slots":
        assert where.get("full_slot") in made["full_slots"] and where.get("pool") == "full", row
    elif run.fault == "hicache_stale_host_copy":
        assert (where.get("full_slot"), where.get("pool")) == (made["full_slot"], "full"), row
    else:  # the SWA slots loaded from host slots no backup wrote: never written there
        assert where.get("pool") == "swa" and where.get("found_token") is None, row
    # otel-swa's offender names the host slot its device slot was loaded from: one the fault touched
    # (the skipped backup: one no backup wrote; every SWA backup from the fault's step on is skipped,
    # the record lists the first one's)
    if run.fault == "hicache_skipped_swa_backup":
        assert where.get("host_slot") is not None, row
    else:
        assert where.get("host_slot") in made["host_slots"], row


# ------------------------------------------------------------------ the table in the docs
def render_table(rows: list) -> str:
    """The HiCache detection table's markdown, a row per fault in :data:`FAULTS` order."""
    lines = ["| fault | class | otel-swa signal | made at step | first flagged at forward_ct | first offender "
             "| host slot touched (the fault's record) | outputs changed vs clean | `otel-swa check` |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in sorted(rows, key=lambda r: list(FAULTS).index(r["fault"])):
        lines.append(f"| `{row['fault']}` | {row['class']} | {row['signal']} | {row['made_at']} | "
                     f"{row['first_flagged']} | {row['offender']} | {row['host_slot']} | {row['outputs_changed']} | "
                     f"exit {row['check_exit']} |")
    return "\n".join(lines)


def test_the_hicache_detection_table_in_the_docs_is_the_runs(rows):
    if set(rows) != set(FAULTS):
        pytest.skip(f"only {', '.join(rows)} ran (OTEL_SWA_TEST_HICACHE_FAULTS)")
    table = render_table(list(rows.values()))
    docs = DOCS.read_text()
    if os.environ.get("OTEL_SWA_UPDATE_DOCS") == "1":
        start, end = docs.index(TABLE_BEGIN) + len(TABLE_BEGIN), docs.index(TABLE_END)
        DOCS.write_text(docs[:start] + "\n" + table + "\n" + docs[end:])
        docs = DOCS.read_text()
    in_docs = docs[docs.index(TABLE_BEGIN) + len(TABLE_BEGIN):docs.index(TABLE_END)].strip()
    assert in_docs == table, f"docs/engines.md's HiCache detection table differs from this run's:\n{table}"

