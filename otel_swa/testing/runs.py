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
* **runs from the totals.** ``verify_full`` and ``verify_swa`` are cumulative: a record whose
  ``verify_full`` or ``verify_swa`` is below the previous record's of its rank starts a new run,
  whatever ``forward_ct`` does (a restart whose ``forward_ct`` goes on upward, at a larger interval
  or from a count that continues). A negative total is a 32-bit counter that wrapped, not a
  restart (the judge's verify lag rule says so).
* **lines written by several processes at once.** Processes that write one log file in several
  parts per line (log prefix, message, line end as separate writes, unbuffered) interleave those
  parts: a record can stand after another process's log prefix (it then names the wrong rank),
  glued after another rank's record, or at the start of a line without any prefix (an orphan).
  Each rank's records form one sequence in which ``forward_ct`` rises and the totals never fall,
  so in a log whose lines name ranks and show such interleaving (a record after two prefixes or
  none) a record is given to the rank whose sequence it continues most closely (the smallest rise
  in ``forward_ct``, then in the totals), its log prefix's rank when several are as close. In a log
  whose every record stands after one prefix, a record stays with its prefix's rank whenever that
  rank's sequence can take it (data-parallel ranks carry different loads: a pace alone would take
  one rank's records for another's, and a clean log would seem to restart). A record that continues no rank starts a new run of its prefix's
  rank, or, when that rank has just written the same ``forward_ct`` (its prefix was taken by the
  record of a rank that has not written yet), of a rank that has not yet written in the run of
  the log; a record that still fits no rank (its forward_ct not below its prefix rank's) is left
  out. Where the sequences cannot tell two ranks apart (their records equal, as on the tensor
  parallel ranks of one engine) the prefixes name them: at the end, each run's ranks are named by
  the prefixes most of their records carried. An orphan that continues no rank is left out
  (:attr:`RunRecords.left_out`); it is never a group of its own.
* **silent runs.** A run start marker, or a liveness warning (``otel_swa_liveness=``: the
  reporter was on and delivered no sample), of a rank that then writes no record before its next
  marker or the end of the log is a run of that rank without records
  (:attr:`RunRecords.silent`), which the judge fails. Markers of one rank written back to back
  (no record of any rank between them: processes starting at once, their prefixes interleaved)
  count once.
* **interleaved runs.** When a rank's ``forward_ct`` goes back and the next record goes above the
  value before the drop (``40, 20, 60``), two runs are writing that rank's lines at the same time
  (or every line was logged twice); the record that continued the earlier series is marked
  (:attr:`RunRecord.back_and_forth`), and the judge refuses to tell such runs apart. A drop at a
  run start marker is a new run, not a mark.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from otel_swa.record import LivenessMatch, SwaDivergenceRecord
from otel_swa.testing.sequences import (
    LEFT_OUT,
    NameVotes,
    RankState,
    WriterState,
    attribute,
    totals_dropped,
)

__all__ = [
    "OTEL_SWA_LINES", "SGLANG_LINES", "WRITERS", "RunRecord", "RunRecords", "SilentRun", "writer_of", "split_runs",
    "RunSplitter",
]

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


@dataclass(frozen=True, slots=True)
class SilentRun:
    """A run of one rank with a run start marker or a liveness warning and no record.

    Attributes:
        writer, rank, part: as in :class:`RunRecord`.
        run: the run of the log it belongs to (it began at its marker).
        line_no: the line of its marker (or of its warning without a marker), ``None`` off a log.
        warning: the liveness warning in words (``instrumented, 0 samples in N steps: ...``), or
            ``None`` when the run wrote only its marker.
        warning_line_no: the warning's line, or ``None``.
    """

    writer: str
    rank: str | None
    run: int
    line_no: int | None = None
    part: str | None = None
    warning: str | None = None
    warning_line_no: int | None = None


@dataclass(frozen=True, slots=True)
class RunWarning:
    """A liveness warning of a rank run that has records too (samples stopped for a while)."""

    writer: str
    rank: str | None
    run: int
    line_no: int | None
    part: str | None
    warning: str


class RunRecords(list):
    """The :class:`RunRecord` items of :func:`split_runs` (a ``list``), and what else the log showed.

    Attributes:
        started_ranks: ``(part, writer, rank)`` of every run start marker (a rank may have started
            and written no record: an otel-swa reporter that took no sample, a rank that died).
        started: the writers among them.
        silent: the :class:`SilentRun` of every rank run without records.
        warnings: the :class:`RunWarning` of liveness warnings in rank runs that have records.
        left_out: line numbers of records without a rank prefix, in a log whose lines name ranks,
            that continue no rank's sequence (left out of every run).
        reattributed: records given to another rank than their log prefix names (or to a rank
            when they had no prefix).
        other_names: ``(part, writer, run, rank) -> names``: the other ranks a rank run's log
            prefixes pointed to nearly as often as to its name (lines of several processes written
            at once): its name is a guess among them.
    """

    def __init__(self, items: Iterable[RunRecord] = (), started_ranks: Iterable[tuple] = (),
                 silent: Iterable[SilentRun] = (), warnings: Iterable[RunWarning] = (),
                 left_out: Iterable[int | None] = (), reattributed: int = 0, other_names: dict | None = None) -> None:
        super().__init__(items)
        self.started_ranks = frozenset(started_ranks)
        self.started = frozenset(writer for _, writer, _ in self.started_ranks)
        self.silent = tuple(silent)
        self.warnings = tuple(warnings)
        self.left_out = tuple(left_out)
        self.reattributed = reattributed
        self.other_names = dict(other_names or {})

    def derive(self, items: Iterable[RunRecord], parts: Any = None, part: Any = ...) -> "RunRecords":
        """Other items with what else this log showed: only of ``parts`` when given (a set of
        parts), all moved to ``part`` when given (``None``: a single place, no part labels)."""
        keep = (lambda p: True) if parts is None else (lambda p: p in parts)
        move = (lambda x: x) if part is ... else (lambda x: dataclasses.replace(x, part=part))
        return RunRecords(
            items,
            ((p if part is ... else part, w, r) for p, w, r in self.started_ranks if keep(p)),
            (move(x) for x in self.silent if keep(x.part)),
            (move(x) for x in self.warnings if keep(x.part)),
            self.left_out if parts is None else (),
            self.reattributed,
            {((k[0] if part is ... else part),) + k[1:]: v for k, v in self.other_names.items() if keep(k[0])},
        )

    @classmethod
    def merge(cls, parts: Iterable["RunRecords"], items: Iterable[RunRecord]) -> "RunRecords":
        """``items`` with what else each of ``parts`` (one :class:`RunRecords` per place) showed."""
        parts = list(parts)
        return cls(
            items,
            (x for p in parts for x in p.started_ranks),
            (x for p in parts for x in p.silent),
            (x for p in parts for x in p.warnings),
            (x for p in parts for x in p.left_out),
            sum(p.reattributed for p in parts),
            {k: v for p in parts for k, v in p.other_names.items()},
        )


def _entry_kind(entry: Any) -> str:
    if isinstance(entry, SwaDivergenceRecord):
        return "record"
    if isinstance(entry, LivenessMatch):
        return "liveness"
    record = getattr(entry, "record", None)
    if record is None:
        if hasattr(entry, "pid") and hasattr(entry, "verify_source"):
            return "start"
        if getattr(entry, "per_record", False):
            return "audit"  # a line of a record (audit, fault...), already attached
        raise TypeError(f"expected log entries or SwaDivergenceRecord items, got {type(entry).__name__}: {entry!r}")
    if not isinstance(record, SwaDivergenceRecord):
        raise TypeError(f"expected a SwaDivergenceRecord in {type(entry).__name__}, got {type(record).__name__}")
    return "record"


def split_runs(entries: Iterable[Any], *, part: str | None = None, line_numbers: bool = True) -> RunRecords:
    """Give each record of ``entries`` its writer, rank and run (rules in the module docstring).

    Args:
        entries: in log order: :class:`~otel_swa.logsource.LoggedRecord`,
            :class:`~otel_swa.logsource.LoggedRunStart` and
            :class:`~otel_swa.record.LivenessMatch` (a log), :class:`~otel_swa.record.RecordMatch`
            and :class:`~otel_swa.record.RunStartMatch` (``find_all(text).entries``; audit
            and fault matches are skipped), or plain :class:`~otel_swa.record.SwaDivergenceRecord` (a sink:
            no rank, no line number).
        part: copied to every :attr:`RunRecord.part`.
        line_numbers: keep the entries' line numbers (``False`` for text that is not one log,
            such as logging messages captured one by one).

    Returns:
        one :class:`RunRecord` per record, in the order given (less the orphans left out), as
        :class:`RunRecords` (with the run start markers, silent runs and liveness warnings).

    Raises:
        TypeError: an entry is none of these.
    """
    items = [(entry, _entry_kind(entry)) for entry in entries]
    # whole lines: no record stands after another process's prefix, after two, or after none
    whole = all(isinstance(entry, SwaDivergenceRecord)
                or (getattr(entry, "rank_sure", True) and getattr(entry, "rank", None) is not None)
                for entry, kind in items if kind == "record")
    splitter = RunSplitter(part=part, line_numbers=line_numbers, whole=whole)
    for entry, kind in items:  # the ranks each writer's lines name
        splitter.name(entry, kind)
    for entry, kind in items:
        splitter.add(entry, kind)
    return splitter.finish()


class RunSplitter:
    """:func:`split_runs` one entry at a time.

    Given the whole log first (``whole`` known, every line's rank named with :meth:`name` before
    the first :meth:`add`), it keeps every record and gives them their final names at
    :meth:`finish`, as :func:`split_runs` does. Given ``whole=None`` (a log read once, in order:
    :meth:`add` names each line's rank as it comes), it keeps no record: :meth:`add` returns each
    :class:`RunRecord` at once, and :attr:`unsure` says at :meth:`finish` when the log needed what
    only the whole log shows (a record after another process's log prefix or none, a rank's run
    that began by a guess, names that the prefixes' votes change): then read it again whole.

    Args:
        part, line_numbers: as :func:`split_runs`.
        whole: whether every record of the log stands after one log prefix, its own; ``None``:
            not known (read once, in order).
    """

    def __init__(self, *, part: str | None = None, line_numbers: bool = True, whole: bool | None = None) -> None:
        self.part = part
        self.line_numbers = line_numbers
        self.streaming = whole is None
        self.whole = True if whole is None else whole
        self.writers: dict[str, WriterState] = {}
        self.out: list[RunRecord] = []
        self.hints: list = []
        self.sures: list = []
        self.chains: list[RankState] = []
        self.votes: dict[str, NameVotes] = {}  # by writer, while streaming
        self.started: set = set()
        self.silent: list[SilentRun] = []
        self.warnings: list[RunWarning] = []
        self.left_out: list = []
        self._unsure = False
        self._not_whole = False  # a record after another process's log prefix, or none
        self._rankless: set = set()  # writers with a line read before any of their lines named a rank

    def _writer(self, writer: str) -> WriterState:
        state = self.writers.get(writer)
        if state is None:
            state = self.writers[writer] = WriterState(partial=self.streaming)
        return state

    def name(self, entry: Any, kind: str) -> None:
        """Note the rank the log prefix of ``entry`` names (before the first :meth:`add` when the
        whole log is known; :meth:`add` does it while streaming)."""
        if kind == "record" and not isinstance(entry, SwaDivergenceRecord):
            writer, rank = writer_of(entry.record.verify_source), getattr(entry, "rank", None)
        elif kind in ("start", "liveness"):
            writer, rank = writer_of(entry.verify_source), getattr(entry, "rank", None)
        else:
            return
        state = self._writer(writer)
        if rank is not None and rank not in state.named:
            state.named += (rank,)

    @property
    def unsure(self) -> bool:
        """While streaming: a split that may differ from :func:`split_runs` on the whole log."""
        named = [writer for writer, state in self.writers.items() if state.named]
        return self._unsure or any(state.unsure for state in self.writers.values()) or bool(named) and (
            self._not_whole or any(writer in self._rankless for writer in named))

    def _join_log_run(self, state: WriterState, rank: Any) -> int:
        if state.run == 0 or state.began(rank):
            state.run += 1
        return state.run

    def _close_silent(self, writer: str, rank: Any, rs: RankState) -> None:
        # a marker whose rank was a guess (processes starting at once) makes no silent run alone
        if rs.marker and rs.run_records == 0 and rs.run and (rs.marker_sure or rs.warning is not None):
            self.silent.append(SilentRun(writer, rank, rs.run, rs.marker_line, self.part, rs.warning, rs.warning_line))

    def add(self, entry: Any, kind: str | None = None) -> RunRecord | None:
        """Read the next entry (``kind``: what :func:`_entry_kind` says, found when ``None``);
        return its :class:`RunRecord` when it is a record that was not left out.

        Raises:
            TypeError: an entry of no accepted kind (see :func:`split_runs`).
        """
        kind = _entry_kind(entry) if kind is None else kind
        if kind == "audit":
            return None
        if self.streaming:
            self.name(entry, kind)
        part = self.part
        line_no = getattr(entry, "line_no", None) if self.line_numbers else None
        if kind in ("start", "liveness"):
            writer, rank = writer_of(entry.verify_source), getattr(entry, "rank", None)
            state = self._writer(writer)
            sure = getattr(entry, "rank_sure", True) and (rank is not None or not state.named)
            if self.streaming and (not sure or not state.named):
                self._rankless.add(writer)  # the ranks named later would change how it is read
            if not sure:  # its prefix was a guess: the first line of a rank that has not written yet
                waiting = [r for r in state.named if not state.began(r)]
                if not waiting and kind == "start":
                    return None  # a marker whose rank cannot be told (every rank has begun)
                rank = rank if (rank in waiting or not waiting) else waiting[0]
            if sure and kind == "start":
                state.rehome(rank)
            rs = state.ranks.setdefault(rank, RankState())
            if kind == "liveness":
                if not rs.marker and rs.run_records:  # samples stopped in a run that has records
                    self.warnings.append(RunWarning(writer, rank, rs.run, line_no, part, entry.summary))
                    return None
                if not rs.marker:  # a warning without a marker before it (a sink): it begins the run
                    rs.run, rs.records_seen = self._join_log_run(state, rank), state.records
                    rs.marker, rs.marker_line, rs.run_records, rs.marker_sure = True, line_no, 0, sure
                if rs.warning is None:
                    rs.warning, rs.warning_line = entry.summary, line_no
                return None
            self.started.add((part, writer, rank))
            if rs.marker and rs.records_seen == state.records and rs.warning is None:
                return None  # markers of one rank back to back: one start
            if rs.marker:
                self._close_silent(writer, rank, rs)
            rs.run, rs.records_seen = self._join_log_run(state, rank), state.records
            rs.marker, rs.marker_line, rs.warning, rs.warning_line = True, line_no, None, None
            rs.run_records, rs.marker_sure, rs.guessed = 0, sure, not sure
            return None
        hint_votes: tuple = ()
        if isinstance(entry, SwaDivergenceRecord):
            record, hint, sure = entry, None, True
            self._unsure = self._unsure or self.streaming
        else:
            record, hint, sure = entry.record, getattr(entry, "rank", None), getattr(entry, "rank_sure", True)
            if not sure:
                hint_votes = getattr(entry, "rank_candidates", ())
            if self.streaming and (not sure or hint is None):
                self._not_whole = True  # not a log of whole lines: read whole when any line names a rank
        writer = writer_of(record.verify_source)
        state = self._writer(writer)
        rank = attribute(state, hint, sure, record, self.whole) if state.named else hint
        if rank is LEFT_OUT:
            self.left_out.append(line_no)
            return None
        repaired = isinstance(rank, tuple)  # taken by the rank whose pace it fits, though below its totals
        if repaired:
            rank = rank[0]
        state.records += 1
        rs = state.ranks.setdefault(rank, RankState())
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
        new_run = rs.last is None or at_marker or ct <= rs.last_ct or (not repaired and totals_dropped(rs.last, record))
        if new_run:
            if not at_marker:  # a marker already placed the rank's new run in the log's runs
                rs.run = self._join_log_run(state, rank)
                rs.guessed = True
            rs.started_at_marker = at_marker
            rs.run_records = 0
        else:
            rs.started_at_marker = False
        if sure and hint == rank:
            rs.guessed = False
        rs.marker = False
        rs.warning = None
        rs.run_records += 1
        rs.last = record
        rs.before_last_ct, rs.last_ct = rs.last_ct, ct
        item = RunRecord(record, rs.run, rank, writer, line_no, part, back_and_forth)
        candidates = hint_votes if not sure else None
        if self.streaming:
            votes = self.votes.get(writer)
            if votes is None:
                votes = self.votes[writer] = NameVotes()
            votes.add(item.run, rs, rank, hint, candidates)
        else:
            self.out.append(item)
            self.hints.append(hint)
            self.sures.append(candidates)
            self.chains.append(rs)
        return item

    def finish(self) -> RunRecords:
        """The end of the log: the silent runs closed and the sequences named; every record (none
        while streaming) as :class:`RunRecords` with what else the log showed."""
        for writer, state in self.writers.items():
            for rank, rs in state.ranks.items():
                self._close_silent(writer, rank, rs)
        out, part = self.out, self.part
        moved = 0
        uncertain: dict = {}
        if any(state.named for state in self.writers.values()):
            if self.streaming:
                for writer, votes in self.votes.items():
                    if not self.writers[writer].named:
                        continue
                    names = votes.names()
                    if any(name != votes.current[key] for key, name in names.items()):
                        self._unsure = True  # the prefixes' votes rename a sequence its records already left
                    moved += votes.moved(names)
                    uncertain[writer] = votes.uncertain(names)
            else:
                by_writer: dict[str, list[int]] = {}
                for index, item in enumerate(out):
                    by_writer.setdefault(item.writer, []).append(index)
                for writer, indices in by_writer.items():
                    if self.writers[writer].named:
                        votes = NameVotes()
                        for i in indices:
                            votes.add(out[i].run, self.chains[i], out[i].rank, self.hints[i], self.sures[i])
                        names = votes.names()
                        for i in indices:
                            item = out[i]
                            name = names.get((item.run, id(self.chains[i])), item.rank)
                            if name != item.rank:
                                out[i] = dataclasses.replace(item, rank=name)
                        moved += votes.moved(names)
                        uncertain[writer] = votes.uncertain(names)
        self.silent.sort(key=lambda run: (run.line_no is None, run.line_no or 0))
        names = {(part, writer, run, rank): others for writer, got in uncertain.items() for (run, rank), others in got.items()}
        return RunRecords(out, self.started, self.silent, self.warnings, self.left_out, moved, names)
