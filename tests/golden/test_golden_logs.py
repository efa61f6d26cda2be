"""Golden logs: every line otel-swa writes stays byte for byte what it was.

The scenarios (:mod:`golden_scenarios`) are small ``otel-swa replay`` runs of the reference engine,
each with a fault made on purpose, whose logs together hold every line kind: SGLang's
``kv_canary_swa_divergence=`` record, the audit line, the provenance line, the run start marker,
the liveness warning, the fault line of each fault the reference engine can make (leaked, stale
and shared SWA slots, premature evictions, read and write mismatches, foreign and corrupt tokens),
records of a pipeline's micro-batches and a rank prefix. Each run's log, its summary and exit
status, ``otel-swa check`` and ``otel-swa records`` on its log, and one run's metric points are
compared with the files under ``tests/golden/data/`` (taken at commit f358b45; a corrupt token's offender names
its layer since the checksums cover every layer), after normalising
only what varies between two runs (times, pid, the log's path: :func:`golden_scenarios.normalise`).
"""

from __future__ import annotations

import difflib
import json

import pytest

import golden_metrics
import golden_scenarios
from golden_scenarios import DATA, SCENARIOS


def _first_difference(expected: str, actual: str) -> str:
    """Where the first differing line differs, with 40 characters either side of it."""
    old, new = expected.splitlines(), actual.splitlines()
    for number, (a, b) in enumerate(zip(old, new), 1):
        if a != b:
            col = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            start = max(0, col - 40)
            return (f"first difference: line {number}, column {col + 1}\n"
                    f"  golden:   ...{a[start:col + 40]}...\n  this run: ...{b[start:col + 40]}...\n")
    return f"first difference: the golden file has {len(old)} lines, this run {len(new)}\n"


def _diff(expected: str, actual: str, name: str) -> str:
    lines = list(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                      fromfile=f"golden/{name}", tofile=f"this run/{name}", n=1))
    shown = "".join(lines[:80])
    more = f"... ({len(lines) - 80} more diff lines)\n" if len(lines) > 80 else ""
    return f"{name} differs from its golden file:\n{_first_difference(expected, actual)}{shown}{more}"


def _assert_same(name: str, actual: str) -> None:
    expected = (DATA / name).read_text(encoding="utf-8")
    if actual != expected:
        pytest.fail(_diff(expected, actual, name), pytrace=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("golden")
    return {scenario.name: golden_scenarios.run(scenario, work) for scenario in SCENARIOS}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_run_writes_its_golden_lines(runs, scenario):
    texts = runs[scenario.name]
    for line in scenario.lines:  # what the scenario is there for, whatever the golden file holds
        assert line in texts[f"{scenario.name}.log"], f"{scenario.name}.log holds no {line!r}"
    for name, text in texts.items():
        _assert_same(name, text)


def test_the_golden_logs_hold_every_line_kind_and_fault():
    """The golden files themselves cover every line kind and every fault the reference engine
    makes (so a golden file written again cannot silently lose one)."""
    logs = "".join((DATA / f"{s.name}.log").read_text(encoding="utf-8") for s in SCENARIOS)
    for prefix in ("kv_canary_swa_divergence=", "otel_swa_audit=", "otel_swa_provenance=", "otel_swa_fault=",
                   "otel_swa_run_start=", "otel_swa_liveness="):
        assert f"otel_swa[verify=attention] {prefix}" in logs, prefix
    for fault in ("swa_leaked_slots", "swa_stale_tokens", "swa_shared_slots", "swa_premature_evictions",
                  "swa_read_mismatches", "kv_write_mismatches", "kv_foreign_tokens", "kv_corrupt_tokens"):
        assert f'"fault":"{fault}"' in logs, fault
    assert '"micro_batch":1' in logs and "[<time> PP1 TP2] " in logs
    assert set(DATA.iterdir()) == {DATA / golden_metrics.FILE} | {
        DATA / f"{s.name}{suffix}" for s in SCENARIOS
        for suffix in (".log", ".replay.txt", ".check.txt", ".records.jsonl", ".records.csv")}


def test_the_metric_points_of_a_run_are_golden(tmp_path):
    actual = golden_metrics.dump(golden_metrics.collect(tmp_path))
    assert json.loads(actual), "no metric point read"
    _assert_same(golden_metrics.FILE, actual)
