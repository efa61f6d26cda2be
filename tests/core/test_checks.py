"""The check protocol (``otel_swa.checks``): the registered table, and a check added by one module and
one line in the table reaching every end — the reporter, its line, the parser, ``otel-swa check``, the
replay's summary and exit status, the metrics — with nothing else changed (``docs/checks.md``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from otel_swa import checks
from otel_swa.checks.protocol import CheckField, MetricRow
from otel_swa.record import AUDIT_FIELDS, FAULT_FIELDS, PROVENANCE_FIELDS

# The worked example of docs/checks.md: SWA pages of the mapping beyond the pool (a bound that can
# be lowered, to make the fault).
PAGE_RANGE = '''
import os
from otel_swa.checks.protocol import Check, CheckField, MetricRow

class PageRangeCheck(Check):
    name = "page_range"
    title = "page range"
    line = "audit"
    fields = (
        CheckField("swa_pages_checked", "{page}", "SWA pages of the batch whose index was compared with the pool"),
        CheckField("swa_pages_out_of_range", "{page}", "SWA pages of the batch beyond the pool",
                   role="fault", label="SWA pages out of range"),
    )
    metrics = (MetricRow("pages.out_of_range", "gauge", "{page}", "SWA pages beyond the pool; must be 0",
                         "swa_pages_out_of_range", field="swa_pages_out_of_range"),)
    reason = "the page range check found SWA pages beyond the pool (peak {found}); exit status 1"

    width = 2

    def stage(self, staging, cells):
        view = staging.view
        if getattr(view, "swa_audit", None) is None:
            return None
        import torch
        pages = view.full_to_swa_index_mapping // view.swa_audit.page_size
        bound = view.swa_audit.num_swa_pages // int(os.environ.get("PAGE_RANGE_DIVISOR", "1"))
        cells[0] = pages.numel()
        cells[1] = torch.count_nonzero(pages > bound)
        return True

    def read(self, cells, kept, batch):
        return {"swa_pages_checked": cells[0], "swa_pages_out_of_range": cells[1]}, []

    def summary(self, records):
        checked = [r for r in records if self.present(r)]
        worst = max(r.swa_pages_out_of_range for r in checked)
        return f"{'clean' if not worst else 'OUT OF RANGE'}: peak {worst} pages ({len(checked)} samples)"

CHECK = PageRangeCheck()
'''

# The one line in the table (run before otel_swa.record is imported), then the command line itself,
# once per page range divisor given (one interpreter: each run's output follows its "=== run" line)
DRIVER = '''
import json, os, sys
sys.path.insert(0, sys.argv[1])
import otel_swa.checks as checks
import page_range
checks.use_table(checks.CHECKS + (page_range.CHECK,))
import otel_swa.cli
from otel_swa.record import find_all
from otel_swa.telemetry.metrics import INSTRUMENTS
for divisor in sys.argv[2:]:
    os.environ["PAGE_RANGE_DIVISOR"] = divisor
    log = os.path.join(sys.argv[1], f"run{divisor}.log")
    for stream in (sys.stdout, sys.stderr):
        print(f"=== run {divisor}", file=stream, flush=True)
    replay = otel_swa.cli.main(["replay", "--requests", "12", "--interval", "10", "--no-model", "--no-progress",
                                "--log-file", log])
    check = otel_swa.cli.main(["check", log, "--min-divergence", "0", "--min-out-of-window", "0"])
    records = list(find_all(open(log).read()))
    print(json.dumps({"replay": replay, "check": check,
                      "fields": [[r.swa_pages_checked, r.swa_pages_out_of_range] for r in records],
                      "metric": any(i.name == "kv_cache.swa.pages.out_of_range" for i in INSTRUMENTS)}), flush=True)
'''


def _runs(tmp_path, divisors: tuple) -> dict:
    """``divisor -> (the driver's result, that run's stdout and stderr, its log)`` of one interpreter
    that replays and checks once per page range divisor."""
    (tmp_path / "page_range.py").write_text(PAGE_RANGE)
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), *map(str, divisors)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = (dict(part.split("\n", 1) for part in text.split("=== run ")[1:]) for text in (proc.stdout, proc.stderr))
    return {d: (json.loads(out[str(d)].strip().splitlines()[-1]), out[str(d)] + err[str(d)],
                (tmp_path / f"run{d}.log").read_text()) for d in divisors}


def test_the_table_gives_each_line_its_fields_in_order():
    assert AUDIT_FIELDS == tuple(f for c in checks.CHECKS if c.line == "audit" for f in c.names)
    assert PROVENANCE_FIELDS == tuple(f for c in checks.CHECKS if c.line == "provenance" for f in c.names)
    assert FAULT_FIELDS == tuple(f for c in checks.CHECKS if c.line == "audit" for f in c.faults) + tuple(
        f for c in checks.CHECKS if c.line == "provenance" for f in c.faults)
    assert [c.name for c in checks.CHECKS] == ["slot_audit", "window", "read", "write", "provenance", "block_audit",
                                               "block_hashes"]


def test_a_table_that_declares_a_field_twice_or_a_line_that_does_not_exist_is_refused():
    read = checks.CHECKS_BY_NAME["read"]
    twin = type("Twin", (type(read),), {"name": "twin"})()
    with pytest.raises(ValueError, match="declared by checks .read. and .twin."):
        checks.use_table(checks.CHECKS + (twin,))
    odd = type("Odd", (type(read),), {"name": "odd", "line": "fault", "fields": (CheckField("x_y", "{x}", "x"),)})()
    with pytest.raises(ValueError, match="line must be one of audit, provenance"):
        checks.use_table(checks.CHECKS + (odd,))
    assert [c.name for c in checks.CHECKS][-1] == "block_hashes"  # a refused table changes nothing


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="needs a label"):
        CheckField("swa_x", "{x}", "x", role="fault")
    with pytest.raises(ValueError, match="exactly one of field and outcomes"):
        MetricRow("x", "gauge", "{x}", "x", "x")


def test_a_check_added_by_one_module_and_one_line_reaches_every_end(tmp_path):
    runs = _runs(tmp_path, (1, 2))
    clean, out, log = runs[1]
    assert clean["replay"] == 0 and clean["check"] == 0, out
    assert clean["metric"] is True
    # every record carries the new fields, written on its audit line after the existing ones
    assert clean["fields"] and all(checked > 0 and bad == 0 for checked, bad in clean["fields"]), clean
    audit = next(line for line in log.splitlines() if "otel_swa_audit=" in line)
    assert audit.endswith(f',"swa_pages_checked":{clean["fields"][0][0]},"swa_pages_out_of_range":0}}')
    assert "page range" in out and "clean: peak 0 pages" in out
    # the same check with its bound halved: a fault the verdict and the replay's exit status take
    faulty, out, _ = runs[2]
    assert any(bad > 0 for _, bad in faulty["fields"]), faulty
    assert faulty["replay"] == 1 and faulty["check"] == 1, out
    peak = max(bad for _, bad in faulty["fields"])
    assert f"the page range check found SWA pages beyond the pool (peak swa_pages_out_of_range={peak})" in out
    assert "SWA pages out of range: peak swa_pages_out_of_range=" in out


# ---------------------------------------------------------------------- a check's own bugs
def _reporter_with(monkeypatch, check, part, behaviour):
    """A reporter sampling every step of a small view whose window check (``check``) is made to
    misbehave in ``part`` (``stage`` is not called for a fused check: ``keep`` or ``read``)."""
    import torch

    from otel_swa import sampling
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views import SwaBatch

    monkeypatch.setattr(sampling, "_failed", set())
    monkeypatch.setattr(type(check), part, behaviour)
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: records.append(r)])
    r2t = torch.arange(1, 65, dtype=torch.int32).reshape(2, 32)
    view = SwaBatch(r2t, torch.arange(70, dtype=torch.int64), torch.tensor([0, 1]), torch.tensor([20, 30]),
                    seq_lens_cpu=[20, 30], sliding_window=8, request_ids=["a", "b"])
    return reporter, view, records


@pytest.mark.parametrize("part, behaviour", [
    ("read", lambda self, cells, kept, batch: 1 // 0),
    ("read", lambda self, cells, kept, batch: ({"swa_premature_evictions": -1, "swa_late_held_slots": 0}, [])),
    ("read", lambda self, cells, kept, batch: ({"swa_not_mine": 1}, [])),
    ("read", lambda self, cells, kept, batch: ({"swa_premature_evictions": 0, "swa_late_held_slots": 0},
                                               [{"fault": "swa_premature_evictions", "token": 3}])),
    ("keep", lambda self, staging, staged: [][0]),
], ids=["raises", "negative", "not its field", "bad offender", "keep raises"])
def test_a_check_that_fails_loses_its_own_fields_only_and_never_stops_the_step(monkeypatch, caplog, part, behaviour):
    window = checks.CHECKS_BY_NAME["window"]
    reporter, view, records = _reporter_with(monkeypatch, window, part, behaviour)
    with caplog.at_level("ERROR", logger="otel_swa.reporter"):
        for _ in range(3):
            reporter.step(view)  # never raises
    reporter.close()
    assert [r.forward_ct for r in records] == [1, 2, 3]  # every sample delivered
    assert all(r.swa_premature_evictions is None and r.swa_late_held_slots is None for r in records)
    assert all(r.verify_full == 0 and r.swa_out_of_window_tokens == 0 for r in records)  # the core is kept
    failures = [m for m in caplog.messages if "check 'window' failed" in m]
    assert len(failures) == 1 and f"in {part}()" in failures[0]  # logged once, naming the check


def test_a_table_whose_check_takes_a_record_field_or_misdeclares_is_refused():
    read = checks.CHECKS_BY_NAME["read"]
    core = type("Core", (type(read),), {"name": "core", "fields": (CheckField("swa_full_idx_divergence", "{t}", "x"),)})()
    with pytest.raises(ValueError, match="'swa_full_idx_divergence' is the record's own"):
        checks.use_table(checks.CHECKS + (core,))
    empty = type("Empty", (type(read),), {"name": "empty", "fields": ()})()
    with pytest.raises(ValueError, match="declares no field"):
        checks.use_table(checks.CHECKS + (empty,))
    foreign = type("Foreign", (type(read),), {"name": "foreign", "fields": (CheckField("swa_mine", "{t}", "x"),),
                                               "counters": (MetricRow("mine", "gauge", "{t}", "x", "x",
                                                                      field="swa_other"),)})()
    with pytest.raises(ValueError, match="metric 'mine' reads"):
        checks.use_table(checks.CHECKS + (foreign,))
    peak = type("Peak", (type(read),), {"name": "peak", "fields": (CheckField("swa_mine", "{t}", "x"),),
                                         "counters": (), "reason": "found {peak}"})()
    with pytest.raises(ValueError, match="must format with"):
        checks.use_table(checks.CHECKS + (peak,))
    with pytest.raises(ValueError, match="declared by checks 'read' and 'twin'"):
        checks.use_table(checks.CHECKS + (type("Twin", (type(read),), {"name": "twin"})(),))
    assert [c.name for c in checks.CHECKS][-1] == "block_hashes"  # a refused table changes nothing


def test_a_replay_whose_samples_all_failed_exits_1_and_says_why():
    from types import SimpleNamespace

    from otel_swa.commands._replay_summary import verdict_of

    stats = SimpleNamespace(samples_taken=36, samples_delivered=0)
    verdict = verdict_of([], stats, interrupted=False)
    assert verdict.exit_status == 1
    assert verdict.reasons(5, 180) == [
        "the reporter took 36 sample(s) and delivered none: each was invalid (the errors above say why), so nothing "
        "was checked; exit status 1"]
    assert verdict_of([], SimpleNamespace(samples_taken=36, samples_delivered=1), interrupted=False).exit_status == 0
