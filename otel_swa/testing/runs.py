"""Which records belong together: the writer of a line, its rank, and the run it belongs to.

A log can hold more than one run (``--log-file`` appends; an engine restarted under one log
file), more than one rank (each tensor/data/pipeline-parallel scheduler writes its own lines with
its rank in the log prefix), and two writers for the same forward steps: otel-swa's tagged lines
(``otel_swa[verify=...]``) and SGLang's own KV canary lines (no tag). :func:`split_runs` gives
every record its writer, rank and run, so that the CI judge (:mod:`otel_swa.testing.judge`) can
judge one run, rank by rank, and ``otel-swa records`` / ``plot`` can label runs.

The rules, per writer (otel-swa's lines and SGLang's are two streams: one never starts or ends a
run of the other):

* **a rank's runs.** Within one rank, a new run starts at a record whose ``forward_ct`` is not
  above the previous record's (a reporter starts counting from 0 again), and at the first record
  after a run start marker of that rank (``otel_swa_run_start=``, written by otel-swa's line sinks
  before their first record; it also catches a new run whose first ``forward_ct`` happens to be
  above the last one of the run before, such as a larger interval).
* **runs across ranks.** Run *n* of the log is the set of rank runs that began while it was the
  latest: a rank run begins a new run of the log when its rank already has a run in the latest
  one, and joins the latest one otherwise (ranks of one engine run start together, each at its
  own pace; a rank that is silent in one run simply has no records in it).
* **interleaved runs.** When a rank's ``forward_ct`` goes back and the next record goes above the
  value before the drop (``40, 20, 60``), two runs are writing that rank's lines at the same time
  (or every line was logged twice); the record that continued the earlier series is marked
  (:attr:`RunRecord.back_and_forth`), and the judge refuses to tell such runs apart. A drop at a
  run start marker is a new run, not a mark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from otel_swa.record import SwaDivergenceRecord

__all__ = ["OTEL_SWA_LINES", "SGLANG_LINES", "WRITERS", "RunRecord", "RunRecords", "writer_of", "split_runs"]

#: Writer of the lines otel-swa tagged (``otel_swa[verify=...]``).
OTEL_SWA_LINES = "otel-swa"
#: Writer of untagged lines: SGLang's own KV canary (or any other writer of SGLang's bare line).
SGLANG_LINES = "sglang"
WRITERS = (OTEL_SWA_LINES, SGLANG_LINES)


def writer_of(verify_source: str | None) -> str:
    """:data:`OTEL_SWA_LINES` for a tagged line (``verify_source`` known), else :data:`SGLANG_LINES`."""
    return OTEL_SWA_LINES if verify_source is not None else SGLANG_LINES


@dataclass(frozen=True, slots=True)
class RunRecord:
    """A record with what the judge needs to know about where it belongs.

    Attributes:
        record: the record.
        run: 1-based run number within its writer (and part), see the module docstring.
        rank: SGLang's rank tokens of its log prefix (``"TP1"``, ``"DP1 TP0"``), ``None`` without.
        writer: :data:`OTEL_SWA_LINES` or :data:`SGLANG_LINES`.
        line_no: 1-based line of the log it was found on, ``None`` when it did not come from a log.
        part: which of several places it came from (the capture's ``sink``, ``logging``, a
            followed file...), ``None`` for a single source.
        back_and_forth: it continued an earlier series of its rank right after ``forward_ct`` went
            back (interleaved runs, or lines logged twice).
    """

    record: SwaDivergenceRecord
    run: int
    rank: str | None
    writer: str
    line_no: int | None = None
    part: str | None = None
    back_and_forth: bool = False


class _RankState:
    __slots__ = ("last_ct", "before_last_ct", "marker", "started_at_marker", "run")

    def __init__(self) -> None:
        self.run = 0  # the run of the log the rank's current run belongs to
        self.last_ct: int | None = None
        self.before_last_ct: int | None = None
        self.marker = False  # a run start marker came after this rank's last record
        self.started_at_marker = False  # the rank's last record began a run at a marker


class _WriterState:
    __slots__ = ("run", "ranks_in_run", "ranks")

    def __init__(self) -> None:
        self.run = 0
        self.ranks_in_run: set = set()
        self.ranks: dict[str | None, _RankState] = {}


class RunRecords(list):
    """The :class:`RunRecord` items of :func:`split_runs` (a ``list``), and where run start markers
    were written: :attr:`started_ranks`, ``(part, writer, rank)`` of every marker (a rank may have
    started and written no record: an otel-swa reporter that took no sample, a rank that died), and
    :attr:`started`, the writers among them."""

    def __init__(self, items: Iterable[RunRecord] = (), started_ranks: Iterable[tuple] = ()) -> None:
        super().__init__(items)
        self.started_ranks = frozenset(started_ranks)
        self.started = frozenset(writer for _, writer, _ in self.started_ranks)


def split_runs(entries: Iterable[Any], *, part: str | None = None, line_numbers: bool = True) -> RunRecords:
    """Give each record of ``entries`` its writer, rank and run (rules in the module docstring).

    Args:
        entries: in log order: :class:`~otel_swa.logsource.LoggedRecord` and
            :class:`~otel_swa.logsource.LoggedRunStart` (a log),
            :class:`~otel_swa.record.RecordMatch` and :class:`~otel_swa.record.RunStartMatch`
            (``find_all(text).entries``; audit and fault matches are skipped), or plain
            :class:`~otel_swa.record.SwaDivergenceRecord` (a sink: no rank, no line number).
        part: copied to every :attr:`RunRecord.part`.
        line_numbers: keep the entries' line numbers (``False`` for text that is not one log,
            such as logging messages captured one by one).

    Returns:
        one :class:`RunRecord` per record, in the order given, as :class:`RunRecords` (with the
        writers that wrote a run start marker).

    Raises:
        TypeError: an entry is none of these.
    """
    writers: dict[str, _WriterState] = {}
    out = RunRecords()
    started: set[str] = set()
    for entry in entries:
        if isinstance(entry, SwaDivergenceRecord):
            record, rank, line_no = entry, None, None
        else:
            record = getattr(entry, "record", None)
            rank = getattr(entry, "rank", None)
            line_no = getattr(entry, "line_no", None) if line_numbers else None
            if record is None:
                if hasattr(entry, "pid") and hasattr(entry, "verify_source"):  # a run start marker
                    state = writers.setdefault(writer_of(entry.verify_source), _WriterState())
                    state.ranks.setdefault(rank, _RankState()).marker = True
                    started.add((part, writer_of(entry.verify_source), rank))
                    continue
                if (hasattr(entry, "audit") or hasattr(entry, "offender")) and hasattr(entry, "forward_ct"):
                    # an audit or fault line, already attached
                    continue
                raise TypeError(f"expected log entries or SwaDivergenceRecord items, got {type(entry).__name__}: {entry!r}")
            if not isinstance(record, SwaDivergenceRecord):
                raise TypeError(f"expected a SwaDivergenceRecord in {type(entry).__name__}, got {type(record).__name__}")
        writer = writer_of(record.verify_source)
        state = writers.setdefault(writer, _WriterState())
        rs = state.ranks.setdefault(rank, _RankState())
        ct = record.forward_ct
        at_marker = rs.marker
        back_and_forth = (
            not at_marker
            and not rs.started_at_marker
            and rs.last_ct is not None
            and rs.before_last_ct is not None
            and rs.last_ct <= rs.before_last_ct
            and ct > rs.before_last_ct
        )
        new_run = rs.last_ct is None or at_marker or ct <= rs.last_ct
        if new_run:
            if state.run == 0 or rank in state.ranks_in_run:
                state.run += 1
                state.ranks_in_run = set()
            state.ranks_in_run.add(rank)
            rs.run = state.run
            rs.started_at_marker = at_marker
        else:
            rs.started_at_marker = False
        rs.marker = False
        rs.before_last_ct, rs.last_ct = rs.last_ct, ct
        out.append(RunRecord(record, rs.run, rank, writer, line_no, part, back_and_forth))
    return RunRecords(out, started)
