"""The check protocol (``otel_swa.checks``): the registered table, and a check added by one module and
one line in the table reaching every end — the reporter, its line, the parser, ``otel-swa check``, the
replay's summary and exit status, the metrics — with nothing else changed (``docs/checks.md``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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

# The one line in the table (run before otel_swa.record is imported), then the command line itself.
DRIVER = '''
import json, sys
sys.path.insert(0, sys.argv[1])
import otel_swa.checks as checks
import page_range
checks.use_table(checks.CHECKS + (page_range.CHECK,))
import otel_swa.cli
from otel_swa.record import find_all
from otel_swa.telemetry.metrics import INSTRUMENTS
log = sys.argv[2]
replay = otel_swa.cli.main(["replay", "--requests", "12", "--interval", "10", "--no-model", "--no-progress",
                            "--log-file", log])
check = otel_swa.cli.main(["check", log, "--min-divergence", "0", "--min-out-of-window", "0"])
records = list(find_all(open(log).read()))
print(json.dumps({"replay": replay, "check": check,
                  "fields": [[r.swa_pages_checked, r.swa_pages_out_of_range] for r in records],
                  "metric": any(i.name == "kv_cache.swa.pages.out_of_range" for i in INSTRUMENTS)}))
'''


def _run(tmp_path, divisor: int):
    (tmp_path / "page_range.py").write_text(PAGE_RANGE)
    log = tmp_path / f"run{divisor}.log"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(log)], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PAGE_RANGE_DIVISOR": str(divisor)})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, proc.stdout + proc.stderr, log.read_text()


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
    with pytest.raises(ValueError, match="declared by two checks"):
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
    clean, out, log = _run(tmp_path, 1)
    assert clean["replay"] == 0 and clean["check"] == 0, out
    assert clean["metric"] is True
    # every record carries the new fields, written on its audit line after the existing ones
    assert clean["fields"] and all(checked > 0 and bad == 0 for checked, bad in clean["fields"]), clean
    audit = next(line for line in log.splitlines() if "otel_swa_audit=" in line)
    assert audit.endswith(f',"swa_pages_checked":{clean["fields"][0][0]},"swa_pages_out_of_range":0}}')
    assert "page range" in out and "clean: peak 0 pages" in out
    # the same check with its bound halved: a fault the verdict and the replay's exit status take
    faulty, out, _ = _run(tmp_path, 2)
    assert any(bad > 0 for _, bad in faulty["fields"]), faulty
    assert faulty["replay"] == 1 and faulty["check"] == 1, out
    peak = max(bad for _, bad in faulty["fields"])
    assert f"the page range check found SWA pages beyond the pool (peak swa_pages_out_of_range={peak})" in out
    assert "SWA pages out of range: peak swa_pages_out_of_range=" in out
