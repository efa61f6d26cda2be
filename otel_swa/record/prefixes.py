"""The prefix table: every prefix otel-swa writes or reads, spelled here and nowhere else, and the
tag otel-swa writes before its own lines.

What a line of each prefix holds, and how it is read, is the business of its line kind's module
(:mod:`otel_swa.record.kinds` lists them).
"""

from __future__ import annotations

import re

__all__ = [
    "LINE_PREFIX",
    "AUDIT_PREFIX",
    "RUN_START_PREFIX",
    "FAULT_PREFIX",
    "LIVENESS_PREFIX",
    "PROVENANCE_PREFIX",
    "PREFIX_WORDS",
    "PREFIX_RE",
    "LINE_TAG",
    "VERIFY_SOURCES",
    "tagged",
]

#: The prefix SGLang prints before the JSON object. Existing CI greps search for it.
LINE_PREFIX = "kv_canary_swa_divergence="
#: The prefix of otel-swa's audit line (written after the record's line; never SGLang's).
AUDIT_PREFIX = "otel_swa_audit="
#: The prefix of otel-swa's run start marker (written before a line sink's first record).
RUN_START_PREFIX = "otel_swa_run_start="
#: The prefix of otel-swa's fault line: one fault's first offender (written after the audit and
#: provenance lines).
FAULT_PREFIX = "otel_swa_fault="
#: The prefix of otel-swa's liveness warning: a reporter that is on and delivers no sample
#: (:class:`~otel_swa.record.LivenessWarning`; never SGLang's).
LIVENESS_PREFIX = "otel_swa_liveness="
#: The prefix of otel-swa's provenance line: what the checks of the KV in the slots found (written
#: after the audit line, or after the record without one; never SGLang's).
PROVENANCE_PREFIX = "otel_swa_provenance="

#: Every prefix and what its line is called (in :class:`~otel_swa.record.MalformedRecordError`).
#: No prefix contains another, and none of otel-swa's contains SGLang's.
PREFIX_WORDS = {
    LINE_PREFIX: "record",
    AUDIT_PREFIX: "audit line",
    RUN_START_PREFIX: "run start line",
    FAULT_PREFIX: "fault line",
    LIVENESS_PREFIX: "liveness warning",
    PROVENANCE_PREFIX: "provenance line",
}

#: Any of the prefixes, wherever it stands.
PREFIX_RE = re.compile("|".join(re.escape(p) for p in PREFIX_WORDS))

#: What ``verify_full`` / ``verify_swa`` count, as carried by the tag (and
#: :attr:`~otel_swa.record.SwaDivergenceRecord.verify_source`): ``kv_canary``: the KV entries SGLang's
#: KV canary verified (its verify plans, SGLang's meaning of the fields); ``attention``: the KV entries
#: attention read at each forward step (``seq_len`` per request in the FULL pool, the tokens still held
#: in the window in the SWA pool), where no canary runs.
VERIFY_SOURCES = ("attention", "kv_canary")

#: Written before the record on otel-swa's own lines (``otel_swa[verify=kv_canary] kv_canary_swa_...``):
#: it tells otel-swa's line from SGLang's in one log and what the verify counts are, without touching
#: the JSON (SGLang's parser searches for the record prefix and ignores what stands before it).
LINE_TAG = "otel_swa[verify={}]"
# The tag wherever it stands, and the tag that ends the text before a line's prefix.
TAG_RE = re.compile(r"otel_swa\[verify=([a-z_]+)\] ?")
TAG_BEFORE_RE = re.compile(r"otel_swa\[verify=([a-z_]+)\] ?$")


def tagged(verify_source: str | None, body: str) -> str:
    """``body`` after the tag of ``verify_source`` (``otel_swa[verify=attention] <body>``), or
    ``body`` alone when the source is ``None``."""
    return body if verify_source is None else f"{LINE_TAG.format(verify_source)} {body}"
