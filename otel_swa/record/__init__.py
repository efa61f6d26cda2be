"""One SWA divergence sample and every line otel-swa writes or reads for it.

This package knows neither torch nor OpenTelemetry: the record is the only object that crosses from
the device side of the package to its telemetry side. Every line prefix otel-swa writes or reads is
spelled in one place, its prefix table (:mod:`otel_swa.record.prefixes`); each line kind has its
module (:mod:`~otel_swa.record.sglang_line`, :mod:`~otel_swa.record.audit_line`,
:mod:`~otel_swa.record.fault_line`, :mod:`~otel_swa.record.run_start_line`,
:mod:`~otel_swa.record.liveness_line`) and a row in the one table of line kinds the parser loops
over (:data:`otel_swa.record.kinds.LINE_KINDS`). The JSON after a prefix is decoded in
:mod:`~otel_swa.record.decoding`, the log prefix and rank before it read in
:mod:`~otel_swa.record.logtext`, the lines of a record attached to it in
:mod:`~otel_swa.record.pairing`. Everything public is imported from here.

**SGLang's line.** The format is the one SGLang's KV canary prints (sgl-project/sglang PR #26820,
``python/sglang/srt/kv_canary/runner/swa_divergence.py``)::

    kv_canary_swa_divergence={"forward_ct":40,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}

i.e. the prefix followed directly by compact JSON (separators ``","`` and ``":"``) of five integer
fields in this order. SGLang 0.5.23's parser (``SwaDivergenceLog.parse`` / ``find_all``) matches
``kv_canary_swa_divergence=(\\S+)`` and builds its record with ``cls(**json.loads(...))``. The
readers here (:meth:`SwaDivergenceRecord.parse`, :func:`iter_entries`, the ``find_*`` functions)
accept what that parser accepts and reject what it rejects, each rejection with its line number
and reason (:class:`MalformedRecordError`):

* rejected like SGLang: JSON with spaces (``json.dumps`` without ``separators``: SGLang reads only
  up to the first space), text that is not a JSON object, a missing field (except
  ``swa_out_of_window_tokens``, which SGLang defaults to 0), a key SGLang's record does not have
  (a ``TypeError`` there), a prefix with nothing after it (SGLang's regex skips it);
* accepted like SGLang: negative integers (SGLang's int32 verify counters wrap past 2**31 - 1;
  the CI judge then says why such a record fails) and keys in any order;
* accepted beyond SGLang: ANSI colour codes (removed), CRLF and bare CR line ends, and several
  records glued on one line (``...}kv_canary_swa_divergence={...``, two writers without a line
  end between them): every whole record is recovered, each with the rank of the nearest log
  prefix before it;
* refused though SGLang would take it: a value that is not a JSON integer (``1.5``, ``"3"``,
  ``true``), or an integer outside int64 (what OTLP carries; see :data:`INT64_MAX`).

**otel-swa's lines.** otel-swa logs the record after a tag, ``otel_swa[verify=attention]
kv_canary_swa_divergence={...}`` (:meth:`SwaDivergenceRecord.line`), and writes more lines of its
own prefixes, which SGLang's parser never matches (none of them contains SGLang's):

* the **SWA slot audit** of an audited record, right after its line, same tag, same
  ``forward_ct`` (:meth:`SwaDivergenceRecord.audit_line`)::

      otel_swa[verify=attention] otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,"swa_stale_tokens":0,"swa_shared_slots":0,"swa_pages_in_use":12,"swa_pages_referenced":12}

  compact JSON of ``forward_ct``, the record's micro-batch when known (``"micro_batch":1``, under
  pipeline parallelism), ``"divergence_applicable":false`` for an engine without a FULL-to-SWA
  mapping (vLLM: the line's divergence is a placeholder 0, which the CI judge then does not judge)
  and the audit fields (:data:`AUDIT_FIELDS`) present: the SWA slot audit's
  and the sliding-window check's (``swa_premature_evictions``, ``swa_late_held_slots``), each only
  when measured; a record with any of them (or with a micro-batch) writes the line. Keys this
  version does not know are ignored, so fields can be added later, and lines without the window
  fields read as before. It is attached back to the
  latest record of the same tag and log rank when that record has the same ``forward_ct``;
* the **provenance** line of a record whose engine checks the KV held in the slots, right after
  its audit line (right after its record when it has none), same tag, same ``forward_ct``
  (:meth:`SwaDivergenceRecord.provenance_line`)::

      otel_swa[verify=attention] otel_swa_provenance={"forward_ct":40,"kv_write_checks":16,"kv_write_mismatches":0,"kv_write_unchecked":0,"kv_stamp_checks":530,"kv_foreign_tokens":0,"kv_stamp_unchecked":12,"kv_checksum_checks":530,"kv_corrupt_tokens":0}

  compact JSON of ``forward_ct``, the micro-batch when known, and the provenance fields measured
  (:data:`PROVENANCE_FIELDS`: the write check's, the provenance stamps', the content checksum's,
  vLLM's block hashes'). An engine or configuration with provenance off writes none. Keys this
  version does not know are ignored. It is attached back to its record as the audit line is;
* a **fault** line per fault the sample shows, right after the provenance line, same tag, same
  ``forward_ct`` (:meth:`SwaDivergenceRecord.fault_lines`): the fault's first offender
  (:class:`Offender`: where in the batch, the pools or the layers the fault's mask was first
  true), attached back to its record as the audit line is::

      otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"swa_read_mismatches","request":"7","row":3,"position":17,"full_slot":130,"swa_slot":12,"swa_page":12,"layer":1}

  compact JSON of ``forward_ct``, ``fault`` (one of :data:`FAULT_FIELDS`) and the location keys
  known (:data:`OFFENDER_KEYS`); keys this version does not know are ignored. A provenance fault's
  offender also names the pool and what the slot's stamp was expected to say and says::

      otel_swa[verify=attention] otel_swa_fault={"forward_ct":40,"fault":"kv_foreign_tokens","request":"7","row":3,"position":17,"full_slot":130,"swa_slot":12,"pool":"swa","expected_token":42,"expected_position":17,"found_token":99,"found_position":17,"other_request":"8"}

  A fault line for a fault its record counts 0 is refused (not otel-swa's line);
* a **run start** marker, before the first record a line sink writes (:func:`run_start_line`)::

      otel_swa[verify=attention] otel_swa_run_start={"pid":4242}

  so that a log appended to by several runs shows where each began (unknown keys ignored);
* a **liveness warning**, when a reporter is on and delivers no sample (:class:`LivenessWarning`,
  :meth:`LivenessWarning.line`)::

      otel_swa[verify=attention] otel_swa_liveness={"pid":4242,"forward_ct":0,"steps":0,"samples_delivered":0,...,"cause":"no_forward_step"}

  (unknown keys ignored).

Text is read after removing ANSI colour codes and reading CRLF or bare CR as line ends, so that
coloured, CRLF and progress-bar-interleaved logs parse too. Line numbers count LF line ends only,
as ``grep -n`` and editors do: a record after a bare CR (a progress bar's redraw) has the number of
the line the CR stands on. The log prefix before a line (time,
SGLang's rank tokens) is read by :func:`parse_log_prefix`.
"""

from otel_swa.record.audit_line import AUDIT_FIELDS, AuditMatch
from otel_swa.record.decoding import MalformedRecordError
from otel_swa.record.fault_line import FAULT_FIELDS, OFFENDER_KEYS, OFFENDER_POOLS, FaultMatch, Offender
from otel_swa.record.kinds import LINE_KINDS, LineKind
from otel_swa.record.liveness_line import LIVENESS_CAUSES, LivenessMatch, LivenessWarning, liveness_summary
from otel_swa.record.logtext import LogPrefix, PrefixClaims, parse_log_prefix
from otel_swa.record.matches import LineMatch
from otel_swa.record.pairing import AuditPairing
from otel_swa.record.parser import Entry, FoundRecords, RecordGroup, find_all, find_last, iter_entries, iter_matches
from otel_swa.record.prefixes import (
    AUDIT_PREFIX,
    FAULT_PREFIX,
    LINE_PREFIX,
    LINE_TAG,
    LIVENESS_PREFIX,
    PROVENANCE_PREFIX,
    RUN_START_PREFIX,
    VERIFY_SOURCES,
)
from otel_swa.record.provenance_line import PROVENANCE_FAULTS, PROVENANCE_FIELDS, ProvenanceMatch
from otel_swa.record.run_start_line import RunStartMatch, run_start_line
from otel_swa.record.sglang_line import FIELDS, RecordMatch, SwaDivergenceRecord
from otel_swa.record.values import INT64_MAX, INT64_MIN, MICRO_BATCH_MAX

__all__ = [
    "LINE_PREFIX",
    "LINE_TAG",
    "AUDIT_PREFIX",
    "RUN_START_PREFIX",
    "FAULT_PREFIX",
    "LIVENESS_PREFIX",
    "PROVENANCE_PREFIX",
    "FIELDS",
    "AUDIT_FIELDS",
    "PROVENANCE_FIELDS",
    "PROVENANCE_FAULTS",
    "FAULT_FIELDS",
    "OFFENDER_KEYS",
    "OFFENDER_POOLS",
    "Offender",
    "MICRO_BATCH_MAX",
    "VERIFY_SOURCES",
    "INT64_MAX",
    "INT64_MIN",
    "MalformedRecordError",
    "SwaDivergenceRecord",
    "LogPrefix",
    "parse_log_prefix",
    "PrefixClaims",
    "LineMatch",
    "Entry",
    "RecordMatch",
    "AuditMatch",
    "ProvenanceMatch",
    "FaultMatch",
    "RunStartMatch",
    "LivenessMatch",
    "LineKind",
    "LINE_KINDS",
    "AuditPairing",
    "FoundRecords",
    "run_start_line",
    "LIVENESS_CAUSES",
    "LivenessWarning",
    "liveness_summary",
    "iter_entries",
    "RecordGroup",
    "iter_matches",
    "find_all",
    "find_last",
]
