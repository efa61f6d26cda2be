"""The bug zoo: published classes of SWA KV cache bug, re-created inside a real sglang 0.5.23 Engine on
CPU (``shims/sglang_cpu/sglang_faults.py``), each caught by otel-swa with its first offender named
(markers ``sglang``, ``sglang_engine``).

Every run is the engine suite's (``sglang_engine/harness.py``: the tiny Mellum model under
``opentelemetry-instrument``, 16 requests of the Azure trace scaled down, a real collector), with
SGLang's KV canary beside otel-swa in ``log`` mode (it reports violations without stopping the
engine) and SGLang's idle memory check in warn mode, both sampled every :data:`INTERVAL` steps.
The fault is on from forward step :data:`AT_STEP` (the raw read from the first step): the records
before it are the configuration's clean run, and must show no fault of any kind.

The faults of the KV's provenance (what a slot holds against what the tables say it holds) share four
runs (:data:`PHASED`, 16 requests of the trace and 4 repeats each): ``provenance`` makes five faults
(``sglang_faults``: a wrong position, swapped ownership, a stale write location, a raw-index SWA
write, a stale prefix-cache SWA slot), ``perturbations`` runs SGLang's own KV canary self-tests
(``sglang_perturb_phases``: ``req_to_token``, ``real_kv_used``, ``real_kv_unused_cache``,
``real_kv_post_forward``, each for the FULL and for the SWA pool, with the canary's real-KV hashing
on and a sweep every :data:`INTERVAL` steps); ``every_layer`` and ``every_layer_bf16`` (a float32 and
a bf16 KV cache) make what a checksum of one layer's first bytes misses (issue 32): a stray write in
the last sliding-window layer only and one bit past a row's first 64 bytes of the last layer, each
named by its layer. Each fault is made once, at a sampled step, on the
requests closest to finishing; the next waits until those requests have left and a clean sample was
taken (the perturbations are undone after both checkers had a look), so each is judged on its own
records: the last sample before it must be clean, its first sample must flag it naming what it
touched, and ``otel-swa check`` on its records (with the clean sample before them) must fail.
``tests/engines/sglang_engine/zoo_outputs.py`` measures, by hand, what each fault does to the
outputs against a clean run of the same configuration.

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


#: Faults of the KV's provenance (what a slot holds against what the tables say), several made one
#: after the other in one engine run each (``sglang_faults.Gate``, ``sglang_perturb_phases``): a fault
#: waits until the requests the previous one touched have left and a clean sample was taken, so
#: each is seen on its own. run -> (engine arguments, environment, ((fault, re-creates), ...)).
# (the byte flips first: they are undone and leave nothing behind; a req_to_token entry read while
# pointed elsewhere seeds wrong chains in its request until the request ends, which the next fault
# waits for)
_PERTURBATIONS = (*(f"{mode}:{group}" for group in ("full", "swa")
                    for mode in ("real_kv_used", "real_kv_unused_cache", "real_kv_post_forward")),
                  "req_to_token:full", "req_to_token:swa")
PHASED = {
    "provenance": (
        {"page_size": 1, "swa_full_tokens_ratio": 1.0, "disable_overlap_schedule": True},
        {"OTEL_SWA_TEST_SGLANG_FAULT": ",".join(f"{fault}@{AT_STEP}" for fault in (
            "wrong_position", "swapped_ownership", "stale_write_loc", "write_raw", "stale_prefix"))},
        (("wrong_position", "sgl-project/sglang#33656 (a new token's KV written for another position)"),
         ("swapped_ownership", "two requests' new tokens' SWA mapping entries swapped after the write"),
         ("stale_write_loc", "sgl-project/sglang#25889 (a stale write location: KV written into another "
                             "request's live slot)"),
         ("write_raw", "sgl-project/sglang#23984, #20181 (SWA layers store new KV at the raw FULL index)"),
         ("stale_prefix", "sgl-project/sglang#31486 (a prefix hit re-uses window-evicted SWA KV)")),
    ),
    "every_layer": (
        {"page_size": 1, "disable_overlap_schedule": True},
        {"OTEL_SWA_TEST_SGLANG_FAULT": ",".join(f"{fault}@{AT_STEP}" for fault in ("deep_layer_write",
                                                                                  "v_sign_bit_flip"))},
        (("deep_layer_write", "a stray write of another request's K/V over a live slot of the last sliding-window "
                              "layer only (issue 32)"),
         ("v_sign_bit_flip", "one bit past the first 64 bytes of a live V row of the last layer (issue 32)")),
    ),
    "every_layer_bf16": (
        {"page_size": 1, "disable_overlap_schedule": True, "dtype": "bfloat16"},
        {"OTEL_SWA_TEST_SGLANG_FAULT": ",".join(f"{fault}@{AT_STEP}" for fault in ("deep_layer_write",
                                                                                  "v_sign_bit_flip"))},
        (("deep_layer_write", "the same, a bf16 KV cache (its 2-byte words hashed as stored)"),
         ("v_sign_bit_flip", "the same, a bf16 KV cache (the last byte of a 64-byte row)")),
    ),
    "perturbations": (
        {"page_size": 1, "disable_overlap_schedule": True, "kv_canary_real_data": "partial",
         "kv_canary_sweep_interval": INTERVAL},
        {"OTEL_SWA_TEST_SGLANG_PERTURB": ",".join(f"{p}@{AT_STEP}" for p in _PERTURBATIONS)},
        tuple((f"perturb {p}", f"SGLang's own KV canary self-test {p.split(':')[0]} (target group "
                               f"{p.split(':')[1]}), made once") for p in _PERTURBATIONS),
    ),
}

#: The faults to run (a comma list in ``OTEL_SWA_TEST_ZOO``, to run some by hand; default every one).
SELECTED = [f for f in os.environ.get("OTEL_SWA_TEST_ZOO", ",".join([*ZOO, *PHASED])).split(",") if f in ZOO]
SELECTED_PHASED = [f for f in os.environ.get("OTEL_SWA_TEST_ZOO", ",".join([*ZOO, *PHASED])).split(",")
                   if f in PHASED]


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


def _phased_run(tmp_path_factory, model, agent, name):
    import time

    from sglang_engine.harness import run_engine

    engine, env, _ = PHASED[name]
    directory = tmp_path_factory.mktemp(name)
    start = time.monotonic()
    run = run_engine(
        directory, model, agent, requests=16, repeat=4,
        engine={"kv_canary": "log", **engine},
        env={"OTEL_SWA_DIVERGENCE_INTERVAL": str(INTERVAL),
             "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": str(INTERVAL),
             "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": str(INTERVAL),
             "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
             "OTEL_SWA_TEST_SGLANG_FAULT_ALIGN": str(INTERVAL), **env},
    )
    print(f"\nsglang zoo run {name!r}: {time.monotonic() - start:.1f} s, {run.forward_steps} forward steps")
    made = [json.loads(line) for pattern in ("faults-*.jsonl", "perturb-*.jsonl")
            for path in sorted((directory / "probe").glob(pattern)) for line in path.read_text().splitlines()]
    for fault in made:  # one naming for both kinds
        if "perturbation" in fault:
            fault["fault"] = f"perturb {fault['perturbation']}:{fault['group']}"
    run.faults = sorted(made, key=lambda f: f["step"])
    run.directory = directory
    run.name = name
    return run


@pytest.fixture(scope="module")
def phased_runs(tmp_path_factory, model, agent_binary, detection_dir):
    """Every run of :data:`PHASED` (one engine each), with a row of the detection table per fault made."""
    runs = {}
    for name in SELECTED_PHASED:
        run = _phased_run(tmp_path_factory, model, agent_binary, name)
        upstream = dict(PHASED[name][2])
        steps = [f["step"] for f in run.faults]
        run.rows = {}
        for i, fault in enumerate(run.faults):
            until = steps[i + 1] if i + 1 < len(steps) else run.forward_steps + 1
            run.rows[fault["fault"]] = _phase_row(run, fault, upstream[fault["fault"]], until)
        with open(detection_dir / "detection.json", "a") as out:
            for row in run.rows.values():
                out.write(json.dumps(row) + "\n")
        runs[name] = run
    return runs


@pytest.fixture(params=[(run, fault) for run in SELECTED_PHASED for fault, _ in PHASED[run][2]],
                ids=lambda param: param[1].replace(" ", "_"))
def phase(request, phased_runs):
    """One fault of a phased run: ``(run, the fault as made, its row)``."""
    run = phased_runs[request.param[0]]
    made = next((f for f in run.faults if f["fault"] == request.param[1]), None)
    assert made is not None, f"{request.param[1]} was never made in the {run.name!r} run"
    return run, made, run.rows[made["fault"]]


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


_VIOLATION = re.compile(r"kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(-?\d+).*?"
                        r"step_when_pumped=(\d+)", re.S)


def canary_said(log: str, start: int, until: int) -> str:
    """What SGLang's KV canary reported for forward steps ``start .. until - 1``: its violations
    pumped to the host in that range (``step_when_pumped``), the first one's launch tag and reasons."""
    found = [(int(step), tag, reasons) for tag, reasons, _, step in _VIOLATION.findall(log)
             if start <= int(step) < until]
    if not found:
        return "violations=0"
    step, tag, reasons = min(found)
    return f"violations={len(found)} from step {step} ({tag} {reasons})"


def log_slice(log: str, start: int, until: int) -> str:
    """otel-swa's lines of ``log`` whose ``forward_ct`` is in ``start .. until - 1``, in order: one
    fault's part of a phased run, for ``otel-swa check``."""
    keep = []
    for line in log.splitlines():
        if "otel_swa" not in line:
            continue
        found = re.search(r'"forward_ct":(\d+)', line)
        if found and start <= int(found.group(1)) < until:
            keep.append(line)
    return "\n".join(keep) + "\n"


def log_between(log: str, start: int, until: int) -> str:
    """Every line of ``log`` from otel-swa's first line with ``forward_ct >= start`` to the line before
    its first with ``forward_ct >= until`` (what the engine logged meanwhile)."""
    lines = log.splitlines()
    first = end = None
    for index, line in enumerate(lines):
        found = re.search(r'"forward_ct":(\d+)', line) if "otel_swa" in line else None
        if found is None:
            continue
        if first is None and int(found.group(1)) >= start:
            first = index
        if int(found.group(1)) >= until:
            end = index
            break
    return "\n".join(lines[first:end]) if first is not None else ""


def _check_exit(text: str, path: Path) -> int:
    import contextlib
    import io

    from otel_swa.cli import main

    path.write_text(text)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["check", str(path)])


def _phase_row(run, made: dict, upstream: str, until: int) -> dict:
    """The detection row of one fault of a phased run: the records from the step it was made up to
    the step the next one was."""
    start = made["step"]
    window = [r for r in run.ours if start <= r.forward_ct < until]
    flagged = [r for r in window if _faults_of(r)]
    first = flagged[0] if flagged else None
    signals = sorted({name for r in flagged for name in _faults_of(r)}, key=FAULT_FIELDS.index)
    offender = first.offender(signals[0]) if first is not None and signals else None
    before = [r.forward_ct for r in run.ours if r.forward_ct < start]
    # the check judges the fault's records with the last sample before it (clean, see the tests)
    text = log_slice(run.log, before[-1] if before else start, until)
    slug = made["fault"].replace(" ", "_").replace(":", "_")
    return {
        "engine": "sglang 0.5.23 Engine", "fault": made["fault"], "upstream": upstream,
        "signal": ", ".join(signals) or "none", "injected_at": start,
        "first_forward_ct": first.forward_ct if first is not None else None,
        "offender": dataclasses.replace(offender, request=None).describe() if offender is not None else None,
        "request": offender.request if offender is not None else None,
        "check_exit": _check_exit(text, run.directory / f"check-{slug}.log"),
        "canary": canary_said(run.log, start, until),
        "memory_check": "memory leak detected" if "memory leak detected" in log_between(run.log, start, until)
        else "clean",
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


# ------------------------------------------------------------------ provenance faults, one run each kind
def _expected_signals(fault: str) -> tuple:
    """The otel-swa fault fields (one of which) a phased fault must raise."""
    if fault.startswith("perturb req_to_token"):
        return ("kv_foreign_tokens",)
    if fault.startswith("perturb "):
        return ("kv_corrupt_tokens",)
    return {"write_raw": ("kv_write_mismatches", "kv_corrupt_tokens"),
            "deep_layer_write": ("kv_corrupt_tokens",), "v_sign_bit_flip": ("kv_corrupt_tokens",),
            "stale_write_loc": ("kv_foreign_tokens", "kv_write_mismatches")}.get(fault, ("kv_foreign_tokens",))


def _made_where(offender, made: dict) -> bool:
    """Whether ``offender`` (a :class:`otel_swa.record.Offender`) names a token or slot the fault touched."""
    at = (offender.row, offender.position)
    fault = made["fault"]
    if offender.row is None and offender.request in made.get("requests", ()):
        # the write check names the request and position (no row): the request the fault wrote for
        return offender.position in {made.get("position"), *made.get("positions", ())}
    if fault == "swapped_ownership":
        return at in set(zip(made["rows"], made["positions"]))
    if fault == "stale_write_loc":
        return at in {(made["row"], made["position"]), (made["other_row"], made["other_position"])}
    if fault == "write_raw":
        return at == (made["row"], made["position"]) or offender.full_slot in made["overwritten_swa_slot_full_slots"]
    if fault.startswith("perturb req_to_token"):
        return at in {(c["row"], c["position"]) for c in made["changes"]}
    if fault.startswith("perturb "):
        change = made["changes"][0]
        slot = offender.swa_slot if change["pool"] == "swa" else offender.full_slot
        return slot == change["physical_slot"]
    return at == (made["row"], made["position"])


def test_no_fault_before_each_phased_fault(phase):
    run, made, _ = phase
    before = [r for r in run.ours if r.forward_ct < made["step"]]
    assert before, "no sample before the fault"
    if made is run.faults[0]:  # the run's clean part: every sample before its first fault
        assert [(r.forward_ct, _faults_of(r)) for r in before if _faults_of(r)] == []
    # the last sample before each fault is clean: what the fault's row counts is its own
    assert _faults_of(before[-1]) == {}, (before[-1].forward_ct, _faults_of(before[-1]))


def test_each_phased_fault_is_flagged_where_it_was_made(phase):
    run, made, row = phase
    assert set(_expected_signals(made["fault"])) & set(row["signal"].split(", ")), row
    first_sample = next(r.forward_ct for r in run.ours if r.forward_ct >= made["step"])
    assert row["first_forward_ct"] == first_sample, row
    first = next(r for r in run.ours if r.forward_ct == first_sample)
    # the provenance signal's offender (a fault may also show elsewhere first: the stale prefix leaks
    # the SWA slot it replaced, which the audit names)
    signal = next(name for name in _expected_signals(made["fault"]) if getattr(first, name))
    assert _made_where(first.offender(signal), made), (first.offender(signal), made)
    if "layer" in made:  # a fault of one layer: the offender names it
        assert (first.offender(signal).layer, first.offender(signal).pool) == (made["layer"], made["pool"]), made
    assert row["check_exit"] == 1, row


def test_otel_swa_flags_every_perturbation_sglangs_canary_flags(phase):
    _, made, row = phase
    if row["canary"] != "violations=0":
        assert row["signal"] != "none", row


# ------------------------------------------------------------------ the table in the docs
def _table_order(fault: str) -> int:
    order = [*ZOO, *(name for run in PHASED.values() for name, _ in run[2])]
    return order.index(fault)


def render_table(rows: list[dict]) -> str:
    """The detection table's markdown, a row per fault in :data:`ZOO` then :data:`PHASED` order."""
    head = ("| fault | re-creates | otel-swa signal | took effect at step | first flagged at forward_ct | first offender "
            "| `otel-swa check` | SGLang's KV canary | SGLang's memory check |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in sorted(rows, key=lambda r: _table_order(r["fault"])):
        lines.append(f"| `{row['fault']}` | {row['upstream']} | {row['signal']} | {row['injected_at']} | "
                     f"{row['first_forward_ct']} | {row['offender']} | exit {row['check_exit']} | {row['canary']} | "
                     f"{row['memory_check']} |")
    return "\n".join(lines)


def test_the_detection_table_in_the_docs_is_the_runs(zoo_runs, phased_runs):
    if set(zoo_runs) != set(ZOO) or set(phased_runs) != set(PHASED):
        pytest.skip(f"only {', '.join([*zoo_runs, *phased_runs])} ran (OTEL_SWA_TEST_ZOO)")
    table = render_table([run.row for run in zoo_runs.values()]
                         + [row for run in phased_runs.values() for row in run.rows.values()])
    docs = DOCS.read_text()
    if os.environ.get("OTEL_SWA_UPDATE_DOCS") == "1":  # regenerate the table from this run
        start, end = docs.index(TABLE_BEGIN) + len(TABLE_BEGIN), docs.index(TABLE_END)
        DOCS.write_text(docs[:start] + "\n" + table + "\n" + docs[end:])
        docs = DOCS.read_text()
    assert TABLE_BEGIN in docs and TABLE_END in docs
    in_docs = docs[docs.index(TABLE_BEGIN) + len(TABLE_BEGIN):docs.index(TABLE_END)].strip()
    assert _comparable(in_docs) == _comparable(table), f"docs/engines.md's detection table differs from this run's:\n{table}"


#: Cells of a row of SGLang's own perturbations that SGLang's random pick decides (which slot its
#: PerturbManager flips, drawn from Python's and torch's generators, which other code of the
#: scheduler process draws from too): the first offender and the canary's violation count. They are
#: compared for every other row; for these the step, the signal and the check's exit are.
_PICKED_BY_SGLANG = (5, 7)


def _comparable(table: str) -> list:
    rows = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith("`perturb "):
            cells = [cell for i, cell in enumerate(cells) if i not in _PICKED_BY_SGLANG]
        rows.append(cells)
    return rows
