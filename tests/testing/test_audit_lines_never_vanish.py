"""An SWA slot audit line that cannot be read or attached never lets a run pass its audit."""

from __future__ import annotations

import pytest

from otel_swa.record import SwaDivergenceRecord, find_all
from otel_swa.testing.judge import judge

PREFIX = "[2026-01-01 00:00:00 TP0] "


def _good(ct: int) -> SwaDivergenceRecord:
    return SwaDivergenceRecord(ct, 100 * ct, 50 * ct, 7, 30, verify_source="attention",
                               swa_leaked_slots=0, swa_stale_tokens=0, swa_shared_slots=0)


def _log(*lines: str) -> str:
    return "".join(PREFIX + line + "\n" for line in lines)


def _verdict(text: str):
    found = find_all(text)
    return judge(found.matches, errors=found.errors, source="log")


def test_a_clean_log_passes_its_audit():
    lines = [line for ct in (20, 40) for line in _good(ct).lines()]
    assert _verdict(_log(*lines)).ok


@pytest.mark.parametrize("bad_audit", [
    # leaked slots reported for a forward_ct no record has
    'otel_swa[verify=attention] otel_swa_audit={"forward_ct":99,"swa_leaked_slots":3,"swa_stale_tokens":0,"swa_shared_slots":0}',
    # a negative count: not an audit otel-swa writes
    'otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":-1,"swa_stale_tokens":0,"swa_shared_slots":0}',
], ids=["unattached", "negative"])
def test_an_audit_line_that_cannot_be_read_or_attached_fails_the_audit(bad_audit):
    text = _log(*_good(20).lines(), _good(40).line(), bad_audit)
    verdict = _verdict(text)
    assert not verdict.ok and "audit" in verdict.failed
    assert any("could not be read or attached" in f.reason and "line 4" in f.reason for f in verdict.failures)
    # without the audit rule, the other signals still pass
    found = find_all(text)
    assert judge(found.matches, errors=found.errors, source="log", require_clean_audit=False).ok


def test_an_audit_glued_after_its_record_on_one_line_is_attached_and_judged():
    leaky = _good(40).replace(swa_leaked_slots=9)
    glued = leaky.line() + "otel_swa_audit=" + leaky.audit_line().split("otel_swa_audit=", 1)[1]
    found = find_all(_log(*_good(20).lines(), glued))
    assert [r.swa_leaked_slots for r in found] == [0, 9] and not found.errors
    verdict = judge(found.matches, errors=found.errors, source="log")
    assert not verdict.ok and "audit" in verdict.failed
