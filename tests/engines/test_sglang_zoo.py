"""The bug zoo: published classes of SWA KV cache bug, re-created inside a real sglang 0.5.23 Engine on
CPU (``shims/sglang_cpu/sglang_faults.py``), each caught by otel-swa with its first offender named
(markers ``sglang``, ``sglang_engine``).

Every run is the engine suite's (``sglang_engine/harness.py``: the tiny Mellum model under
``opentelemetry-instrument``, 16 requests of the Azure trace scaled down, a real collector), with
SGLang's KV canary beside otel-swa in ``log`` mode (it reports violations without stopping the
engine) and SGLang's idle memory check in warn mode, both sampled every :data:`INTERVAL` steps.
The fault is on from forward step :data:`AT_STEP` (the raw read from the first step): the records
before it are the configuration's clean run, and must show no fault of any kind.

For each run the suite writes a row of the detection table (``detection.json`` in
``$OTEL_SWA_DETECTION_DIR``, default the test's tmp directory): the otel-swa signal that flags the
fault, the first sample that does against the step the fault took effect, the first offender it
names, ``otel-swa check``'s exit status on the engine log, and what SGLang's canary and its memory
check said. ``test_the_detection_table_in_the_docs_is_the_runs`` compares the table in
``docs/engines.md`` with these rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from otel_swa.record import FAULT_FIELDS, SwaDivergenceRecord

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_engine]

INTERVAL = 5
AT_STEP = 20
DOCS = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
TABLE_BEGIN = "<!-- detection table: sglang (written by tests/engines/test_sglang_zoo.py) -->"
TABLE_END = "<!-- end of the sglang detection table -->"

#: fault -> (upstream report, engine arguments, environment)
ZOO = {
    "torch_native_raw_read": (
        "sglang 0.5.23 TorchNativeAttnBackend (SWA layers read at raw FULL slots)",
        {"page_size": 1, "swa_full_tokens_ratio": 1.0, "disable_overlap_schedule": True}, {},
    ),
    "early_eviction": (
        "sgl-project/sglang#8649 (eviction frees in-window tokens)",
        {"page_size": 1, "disable_radix_cache": True, "disable_overlap_schedule": True},
        {"SGLANG_SWA_EVICTION_INTERVAL": "1"},
    ),
    "leak_on_free": (
        "sgl-project/sglang#29860, #34870 (a freed SWA page never returned)",
        {"page_size": 4, "disable_overlap_schedule": True}, {},
    ),
    "freed_while_mapped": (
        "sgl-project/sglang#27586, #31486 (a live SWA page freed while mapped, then reused)",
        {"page_size": 4, "disable_overlap_schedule": True}, {},
    ),
}


#: The faults to run (a comma list in ``OTEL_SWA_TEST_ZOO``, to run some by hand; default every one).
SELECTED = [f for f in os.environ.get("OTEL_SWA_TEST_ZOO", ",".join(ZOO)).split(",") if f in ZOO]


def _require() -> None:
    from test_sglang_engine import _require as require

    require()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _require()
    from sglang_engine.harness import build_model

    return build_model(tmp_path_factory.mktemp("zoo-model"))


@pytest.fixture(scope="module")
def detection_dir(tmp_path_factory):
    where = os.environ.get("OTEL_SWA_DETECTION_DIR")
    path = Path(where) if where else tmp_path_factory.mktemp("detection")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _zoo_run(tmp_path_factory, model, agent, fault):
    from sglang_engine.harness import run_engine

    _, engine, env = ZOO[fault]
    directory = tmp_path_factory.mktemp(fault)
    run = run_engine(
        directory, model, agent, requests=12, repeat=2,
        engine={"kv_canary": "log", **engine},
        env={"OTEL_SWA_DIVERGENCE_INTERVAL": str(INTERVAL),
             "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": str(INTERVAL),
             "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": str(INTERVAL),
             "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
             "OTEL_SWA_TEST_SGLANG_FAULT": fault, "OTEL_SWA_TEST_SGLANG_FAULT_AT_STEP": str(AT_STEP), **env},
    )
    run.faults = [json.loads(line) for path in sorted((directory / "probe").glob("faults-*.jsonl"))
                  for line in path.read_text().splitlines()]
    run.directory = directory
    return run


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory, model, agent_binary, detection_dir):
    """Every zoo run (one engine each, in :data:`ZOO` order), with its row of the detection table."""
    runs = {}
    for fault in SELECTED:
        run = _zoo_run(tmp_path_factory, model, agent_binary, fault)
        run.fault = fault
        run.row = _row(run)
        with open(detection_dir / "detection.json", "a") as out:
            out.write(json.dumps(run.row) + "\n")
        runs[fault] = run
    return runs


@pytest.fixture(params=SELECTED)
def zoo(request, zoo_runs):
    return zoo_runs[request.param]


def _faults_of(record: SwaDivergenceRecord) -> dict:
    return {name: getattr(record, name) for name in FAULT_FIELDS if getattr(record, name)}


def canary_violations(log: str) -> int:
    """The most violations SGLang's KV canary reported (its ``[canary] step=.. violations=N`` lines)."""
    return max((int(n) for n in re.findall(r"\[canary\] step=\d+ .*?violations=(\d+)", log)), default=0)


def _row(run) -> dict:
    from otel_swa.cli import main

    injected = min((f["step"] for f in run.faults), default=None)
    flagged = [r for r in run.ours if _faults_of(r)]
    first = flagged[0] if flagged else None
    signals = sorted({name for r in flagged for name in _faults_of(r)}, key=FAULT_FIELDS.index)
    offender = first.offender(signals[0]) if first is not None and signals else None
    log = run.directory / "engine.log"
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        check_exit = main(["check", str(log)])
    return {
        "engine": "sglang 0.5.23 Engine", "fault": run.fault, "upstream": ZOO[run.fault][0],
        "signal": ", ".join(signals) or "none", "injected_at": injected,
        "first_forward_ct": first.forward_ct if first is not None else None,
        # the request ids are SGLang's random rids: the table names the row (the id is in "request")
        "offender": dataclasses.replace(offender, request=None).describe() if offender is not None else None,
        "request": offender.request if offender is not None else None, "check_exit": check_exit,
        "canary": f"violations={canary_violations(run.log)}",
        "memory_check": "memory leak detected" if "memory leak detected" in run.log else "clean",
    }


# ------------------------------------------------------------------ every fault caught, where it began
def test_the_fault_took_effect_in_the_engine(zoo):
    assert zoo.faults, f"{zoo.fault} never took effect"
    assert zoo.row["injected_at"] <= zoo.forward_steps - INTERVAL


def _clean_phase(zoo) -> list:
    """The samples of the run before the fault could show: before the step it took effect; for the
    raw read (on from the start), those whose checked windows held no remapped SWA slot (raw FULL
    and mapped reads then read the same KV), by the probe's recount."""
    if zoo.fault == "torch_native_raw_read":
        return [r for r in zoo.ours if zoo.recount(r.forward_ct)["last_window_remapped"] == 0]
    return [r for r in zoo.ours if r.forward_ct < zoo.row["injected_at"]]


def test_no_fault_of_any_kind_before_the_injection(zoo):
    before = _clean_phase(zoo)
    assert before, "no sample before the fault could show"
    assert [(r.forward_ct, _faults_of(r)) for r in before if _faults_of(r)] == []


def test_the_first_sample_after_the_injection_flags_it_and_names_the_offender(zoo):
    expected_signal = {
        "torch_native_raw_read": "swa_read_mismatches",
        "early_eviction": "swa_premature_evictions",
        "leak_on_free": "swa_leaked_slots",
        "freed_while_mapped": "swa_stale_tokens",
    }[zoo.fault]
    assert expected_signal in zoo.row["signal"].split(", "), zoo.row
    injected = zoo.row["injected_at"]
    # the first sample at or after the step the fault took effect (the raw read: the first whose
    # checked windows hold a remapped SWA slot, its precondition, by the probe's recount)
    first_sample = next(r.forward_ct for r in zoo.ours if r.forward_ct >= injected
                        and (zoo.fault != "torch_native_raw_read"
                             or zoo.recount(r.forward_ct)["last_window_remapped"] > 0))
    assert zoo.row["first_forward_ct"] == first_sample, zoo.row
    assert zoo.row["offender"], zoo.row
    assert zoo.row["check_exit"] == 1


def test_the_offender_is_where_the_fault_was_made(zoo):
    first = next(r for r in zoo.ours if _faults_of(r))
    made = zoo.faults[0]
    if zoo.fault == "leak_on_free":
        assert first.offender("swa_leaked_slots").swa_page == made["page"]
    elif zoo.fault == "freed_while_mapped":
        stale = first.offender("swa_stale_tokens")
        assert stale.swa_page == made["page"]
    elif zoo.fault == "early_eviction":
        offender = first.offender("swa_premature_evictions")
        recount = zoo.recount(first.forward_ct)
        assert offender.request is not None and offender.position is not None and recount["premature"] > 0
    else:
        offender = first.offender("swa_read_mismatches")
        assert offender.layer in (0, 1, 2, 3) and offender.request is not None and offender.position is not None


def test_what_sglangs_own_checks_said(zoo):
    # recorded in the table; the raw read is the case SGLang's canary cannot see
    if zoo.fault == "torch_native_raw_read":
        assert zoo.row["canary"] == "violations=0", zoo.row
    if zoo.fault == "leak_on_free":
        assert zoo.row["memory_check"] == "memory leak detected"


def test_the_read_check_ran_at_every_sample_and_agreed_in_the_clean_phase(zoo):
    assert all(r.read_checked and r.swa_read_checks >= 1 and r.swa_read_unchecked == 0 for r in zoo.ours)
    assert sum(r.swa_read_mismatches for r in _clean_phase(zoo)) == 0
    if zoo.fault == "torch_native_raw_read":
        # every sample whose checked windows hold a remapped slot disagrees: the wrong read is always seen
        remapped = [r for r in zoo.ours if zoo.recount(r.forward_ct)["last_window_remapped"] > 0]
        assert remapped and all(r.swa_read_mismatches > 0 for r in remapped)


# ------------------------------------------------------------------ the table in the docs
def render_table(rows: list[dict]) -> str:
    """The detection table's markdown, a row per fault in :data:`ZOO` order."""
    head = ("| fault | re-creates | otel-swa signal | took effect at step | first flagged at forward_ct | first offender "
            "| `otel-swa check` | SGLang's KV canary | SGLang's memory check |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in sorted(rows, key=lambda r: list(ZOO).index(r["fault"])):
        lines.append(f"| `{row['fault']}` | {row['upstream']} | {row['signal']} | {row['injected_at']} | "
                     f"{row['first_forward_ct']} | {row['offender']} | exit {row['check_exit']} | {row['canary']} | "
                     f"{row['memory_check']} |")
    return "\n".join(lines)


def test_the_detection_table_in_the_docs_is_the_runs(zoo_runs):
    if set(zoo_runs) != set(ZOO):
        pytest.skip(f"only {', '.join(zoo_runs)} ran (OTEL_SWA_TEST_ZOO)")
    table = render_table([run.row for run in zoo_runs.values()])
    docs = DOCS.read_text()
    if os.environ.get("OTEL_SWA_UPDATE_DOCS") == "1":  # regenerate the table from this run
        start, end = docs.index(TABLE_BEGIN) + len(TABLE_BEGIN), docs.index(TABLE_END)
        DOCS.write_text(docs[:start] + "\n" + table + "\n" + docs[end:])
        docs = DOCS.read_text()
    assert TABLE_BEGIN in docs and TABLE_END in docs
    in_docs = docs[docs.index(TABLE_BEGIN) + len(TABLE_BEGIN):docs.index(TABLE_END)].strip()
    assert in_docs == table, f"docs/engines.md's detection table differs from this run's:\n{table}"
