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

__all__ = [
    "OTEL_SWA_LINES", "SGLANG_LINES", "WRITERS", "RunRecord", "RunRecords", "SilentRun", "writer_of", "split_runs",
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


class _RankState:
    __slots__ = ("last", "last_ct", "before_last_ct", "marker", "started_at_marker", "run", "run_records",
                 "marker_line", "warning", "warning_line", "records_seen", "marker_sure", "guessed")

    def __init__(self) -> None:
        self.run = 0  # the run of the log the rank's current run belongs to
        self.last: SwaDivergenceRecord | None = None
        self.last_ct: int | None = None
        self.before_last_ct: int | None = None
        self.marker = False  # a run start marker came after this rank's last record
        self.started_at_marker = False  # the rank's last record began a run at a marker
        self.run_records = 0  # records of the rank's current run
        self.marker_line: int | None = None
        self.warning: str | None = None  # a liveness warning since the marker, no record yet
        self.warning_line: int | None = None
        self.records_seen = 0  # records of any rank of the writer when the marker came
        self.marker_sure = True  # the marker's log prefix was sure (never a guess)
        self.guessed = False  # its current run began at a line whose log prefix was a guess


class _WriterState:
    __slots__ = ("run", "ranks", "named", "records")

    def __init__(self) -> None:
        self.run = 0
        self.ranks: dict[str | None, _RankState] = {}
        self.named: tuple = ()  # the ranks the writer's lines name, in order of first appearance
        self.records = 0

    def rehome(self, rank: Any) -> None:
        """A sure line of ``rank`` begins its run: when the rank's current run began by a guess
        (another process's line taken for it), that run goes to a rank that has not begun yet."""
        rs = self.ranks.get(rank)
        if rs is None or not rs.guessed or not self.began(rank):
            return
        others = [r for r in self.named if r != rank and not self.began(r)]
        others += [r for r in self.named if r != rank and self.began(r) and not self.ranks[r].run_records]
        other = others[0] if others else None  # a rank that has not begun, or whose run has only its marker
        if other is not None:
            self.ranks[other], self.ranks[rank] = rs, _RankState()
        elif rs.run_records == 0:  # only a marker taken for this rank's: this line's supersedes it
            fresh = self.ranks[rank] = _RankState()
            fresh.run, fresh.last, fresh.last_ct, fresh.before_last_ct = rs.run - 1, rs.last, rs.last_ct, rs.before_last_ct

    def began(self, rank: Any) -> bool:
        """Whether ``rank`` has begun its run in the latest run of the log (a record or a marker)."""
        rs = self.ranks.get(rank)
        return rs is not None and rs.run == self.run and self.run > 0 and (rs.run_records > 0 or rs.marker)


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


def _totals_dropped(last: SwaDivergenceRecord, record: SwaDivergenceRecord) -> bool:
    """A cumulative total below the previous record's (a restart); a negative one is a wrap."""
    return (0 <= record.verify_full < last.verify_full) or (0 <= record.verify_swa < last.verify_swa)


#: The most sampling intervals one rank's consecutive records may be apart (samples refused between them).
_MAX_STEPS = 4


def _distance(last: SwaDivergenceRecord | None, record: SwaDivergenceRecord,
              step: int | None = None, relaxed: bool = False) -> float | None:
    """How far ``record`` is from continuing a rank whose last record is ``last`` (smaller: closer),
    or ``None`` when it cannot (``forward_ct`` not above, a total below): the relative distance of
    its totals from where the rank's own pace (totals per forward step so far) puts them at its
    ``forward_ct``, plus how far its rise in ``forward_ct`` is from the rank's last one (``step``;
    the sampling interval, unless samples were lost)."""
    if last is None or record.forward_ct <= last.forward_ct or (not relaxed and _totals_dropped(last, record)):
        return None
    steps = record.forward_ct - last.forward_ct
    usual = step if step else last.forward_ct
    if steps > _MAX_STEPS * usual:
        return None  # a rank skips a few samples (refused ones), not many
    off = abs(steps - usual) / usual
    for now, before in ((record.verify_full, last.verify_full), (record.verify_swa, last.verify_swa)):
        expected = before + max(0, before) * steps / last.forward_ct
        off += abs(now - expected) / max(expected, 1)
    return round(off, 9)


def _continues(rs: "_RankState", record: SwaDivergenceRecord, relaxed: bool = False) -> float | None:
    """:func:`_distance` of ``record`` from the rank sequence ``rs``, at its usual step."""
    step = rs.last_ct - rs.before_last_ct if rs.before_last_ct is not None and rs.run_records > 1 else None
    return _distance(rs.last, record, step, relaxed)


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


_LEFT_OUT = object()


def _attribute(state: _WriterState, hint: str | None, sure: bool, record: SwaDivergenceRecord,
               whole: bool = False) -> Any:
    """The rank sequence ``record`` belongs to (the module docstring's rule), by the name it has
    while the log is read (the final names come from the prefixes: :func:`_name_sequences`), or
    ``_LEFT_OUT``; a 1-tuple ``(rank,)`` for a record that goes there without starting a run.

    The sequence it continues most closely (its prefix's rank when as close); else a new run of its
    prefix's rank when that prefix is sure; else, when it looks like a run's first sample (its
    forward_ct within two sampling intervals), a new run of a rank that has not begun (its prefix's
    first), else of its prefix's rank; else the sequence whose pace it fits best with its
    forward_ct above (an earlier guess gave that sequence a record of another); else it is left
    out. In a log whose lines are all whole (``whole``: every record after one prefix, its own),
    a record stays with its prefix's rank whenever that rank's sequence can take it (``forward_ct``
    above, totals not below): the ranks of a data-parallel engine carry different loads, so another
    rank's pace may fit a record better than its own rank's, and only a contradiction outweighs the
    prefix its own line gave it."""
    if whole and sure and hint is not None:
        own = state.ranks.get(hint)
        if own is not None and not own.marker and _continues(own, record) is not None:
            return hint
    best = _closest(state, hint, record)
    if best is not None:
        return best
    if sure and hint is not None:
        if record.forward_ct <= 2 * _interval(state, record):
            state.rehome(hint)
        return hint
    if record.forward_ct <= 2 * _interval(state, record):
        waiting = _waiting_ranks(state)
        if waiting:
            return hint if hint in waiting else waiting[0]
        return hint if hint is not None else _LEFT_OUT
    best = _closest(state, hint, record, relaxed=True)
    return (best,) if best is not None else _LEFT_OUT


def _interval(state: _WriterState, record: SwaDivergenceRecord) -> int:
    """The writer's sampling interval as its ranks' sequences show it (the smallest rise in
    ``forward_ct``, or first ``forward_ct``); ``record``'s ``forward_ct`` when none shows one."""
    steps = [rs.last_ct - rs.before_last_ct if rs.before_last_ct is not None and rs.run_records > 1 else rs.last_ct
             for rs in state.ranks.values() if rs.last is not None]
    steps = [step for step in steps if step > 0]
    return min(steps) if steps else record.forward_ct


def _closest(state: _WriterState, hint: str | None, record: SwaDivergenceRecord, exclude: Any = _LEFT_OUT,
             relaxed: bool = False) -> Any:
    """The rank whose sequence ``record`` continues most closely (``hint`` when as close), or
    ``None``; ``relaxed``: its totals may be below the rank's last ones."""
    best = None
    for rank in state.named:
        rs = state.ranks.get(rank)
        if rank == exclude or rs is None or (rs.marker and rank != hint):
            continue
        distance = _continues(rs, record, relaxed)
        if distance is None:
            continue
        key = (distance, rank != hint)
        if best is None or key < best[0]:
            best = (key, rank)
    return None if best is None else best[1]


def _waiting_ranks(state: _WriterState) -> list:
    """The ranks whose next line may begin their run: those with a run start marker and no record
    since, then those that have not written in the run of the log yet."""
    started = [rank for rank in state.named if rank in state.ranks and state.ranks[rank].marker]
    return started + [rank for rank in state.named if not state.began(rank) and rank not in started]


#: A name whose prefixes' share is at least this fraction of the chosen name's is shown beside it.
_CLOSE_VOTES = 0.8


def _name_sequences(out: list, chains: list, hints: list, sures: list, uncertain: dict) -> int:
    """Name each rank sequence of ``out`` (one writer's records; ``chains[i]``: the sequence of
    ``out[i]``) run by run after the log prefixes of its records (a permutation of the names
    within a run): a record whose prefix is sure votes for its rank, one read while several
    prefixes waited (``sures[i]``: their ranks) gives each a share, so that the rank present every
    time wins; return how many records now carry another name than their prefix (``hints``)."""
    votes: dict[int, dict] = {}  # run -> (sequence, name) -> votes
    current: dict[tuple, Any] = {}
    for item, chain, hint, candidates in zip(out, chains, hints, sures):
        key = (item.run, id(chain))
        current[key] = item.rank
        counts = votes.setdefault(item.run, {})
        # the record's own prefix is one of those waiting when it was read: each gets a share, and
        # the one it was read with (the nearest before it, or the one it claimed) a little more, to break ties
        for name in ((hint,) if candidates is None else candidates):
            if name is not None:
                share = 1 / (1 if candidates is None else len(candidates)) + (0.001 if name == hint else 0)
                counts[(key, name)] = counts.get((key, name), 0) + share
    names: dict[tuple, Any] = {}
    for run in {key[0] for key in current}:
        keys = [key for key in current if key[0] == run]
        used: set = set()
        for (key, name), _ in sorted(votes.get(run, {}).items(), key=lambda kv: -kv[1]):
            if key not in names and name not in used:
                names[key] = name
                used.add(name)
        for key in keys:  # a sequence no prefix named keeps its name when that is free
            if key not in names and current[key] not in used:
                names[key] = current[key]
                used.add(current[key])
        free = sorted({n for n in current.values() if n is not None} - used)
        for key in keys:
            if key not in names:
                names[key] = free.pop(0) if free else current[key]
    moved = 0
    for index, (item, chain) in enumerate(zip(out, chains)):
        name = names.get((item.run, id(chain)), item.rank)
        if name != item.rank:
            out[index] = dataclasses.replace(item, rank=name)
        if hints[index] != name:
            moved += 1
    for key, name in names.items():  # names other prefixes supported nearly as well: the name is a guess
        got = votes.get(key[0], {})
        mine = got.get((key, name), 0)
        others = sorted(((v, n) for (k, n), v in got.items() if k == key and n != name and n is not None
                         and v >= _CLOSE_VOTES * mine), reverse=True)
        if others:
            uncertain[(key[0], name)] = tuple(n for _, n in others[:3])
    return moved


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
    writers: dict[str, _WriterState] = {}
    for entry, kind in items:  # the ranks each writer's lines name
        if kind == "record" and not isinstance(entry, SwaDivergenceRecord):
            writer, rank = writer_of(entry.record.verify_source), getattr(entry, "rank", None)
        elif kind in ("start", "liveness"):
            writer, rank = writer_of(entry.verify_source), getattr(entry, "rank", None)
        else:
            continue
        state = writers.setdefault(writer, _WriterState())
        if rank is not None and rank not in state.named:
            state.named += (rank,)
    out: list[RunRecord] = []
    hints: list = []
    sures: list[bool] = []
    chains: list[_RankState] = []
    started: set = set()
    silent: list[SilentRun] = []
    warnings: list[RunWarning] = []
    left_out: list = []

    def join_log_run(state: _WriterState, rank: Any) -> int:
        if state.run == 0 or state.began(rank):
            state.run += 1
        return state.run

    def close_silent(writer: str, rank: Any, rs: _RankState) -> None:
        # a marker whose rank was a guess (processes starting at once) makes no silent run alone
        if rs.marker and rs.run_records == 0 and rs.run and (rs.marker_sure or rs.warning is not None):
            silent.append(SilentRun(writer, rank, rs.run, rs.marker_line, part, rs.warning, rs.warning_line))

    for entry, kind in items:
        if kind == "audit":
            continue
        line_no = getattr(entry, "line_no", None) if line_numbers else None
        if kind in ("start", "liveness"):
            writer, rank = writer_of(entry.verify_source), getattr(entry, "rank", None)
            state = writers.setdefault(writer, _WriterState())
            sure = getattr(entry, "rank_sure", True) and (rank is not None or not state.named)
            if not sure:  # its prefix was a guess: the first line of a rank that has not written yet
                waiting = [r for r in state.named if not state.began(r)]
                if not waiting and kind == "start":
                    continue  # a marker whose rank cannot be told (every rank has begun)
                rank = rank if (rank in waiting or not waiting) else waiting[0]
            if sure and kind == "start":
                state.rehome(rank)
            rs = state.ranks.setdefault(rank, _RankState())
            if kind == "liveness":
                if not rs.marker and rs.run_records:  # samples stopped in a run that has records
                    warnings.append(RunWarning(writer, rank, rs.run, line_no, part, entry.summary))
                    continue
                if not rs.marker:  # a warning without a marker before it (a sink): it begins the run
                    rs.run, rs.records_seen = join_log_run(state, rank), state.records
                    rs.marker, rs.marker_line, rs.run_records, rs.marker_sure = True, line_no, 0, sure
                if rs.warning is None:
                    rs.warning, rs.warning_line = entry.summary, line_no
                continue
            started.add((part, writer, rank))
            if rs.marker and rs.records_seen == state.records and rs.warning is None:
                continue  # markers of one rank back to back: one start
            if rs.marker:
                close_silent(writer, rank, rs)
            rs.run, rs.records_seen = join_log_run(state, rank), state.records
            rs.marker, rs.marker_line, rs.warning, rs.warning_line = True, line_no, None, None
            rs.run_records, rs.marker_sure, rs.guessed = 0, sure, not sure
            continue
        hint_votes: tuple = ()
        if isinstance(entry, SwaDivergenceRecord):
            record, hint, sure = entry, None, True
        else:
            record, hint, sure = entry.record, getattr(entry, "rank", None), getattr(entry, "rank_sure", True)
            if not sure:
                hint_votes = getattr(entry, "rank_candidates", ())
        writer = writer_of(record.verify_source)
        state = writers.setdefault(writer, _WriterState())
        rank = _attribute(state, hint, sure, record, whole) if state.named else hint
        if rank is _LEFT_OUT:
            left_out.append(line_no)
            continue
        repaired = isinstance(rank, tuple)  # taken by the rank whose pace it fits, though below its totals
        if repaired:
            rank = rank[0]
        state.records += 1
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
        new_run = rs.last is None or at_marker or ct <= rs.last_ct or (not repaired and _totals_dropped(rs.last, record))
        if new_run:
            if not at_marker:  # a marker already placed the rank's new run in the log's runs
                rs.run = join_log_run(state, rank)
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
        out.append(RunRecord(record, rs.run, rank, writer, line_no, part, back_and_forth))
        hints.append(hint)
        sures.append(hint_votes if not sure else None)
        chains.append(rs)
    for writer, state in writers.items():
        for rank, rs in state.ranks.items():
            close_silent(writer, rank, rs)
    moved = 0
    uncertain: dict = {}
    if any(state.named for state in writers.values()):
        by_writer: dict[str, list[int]] = {}
        for index, item in enumerate(out):
            by_writer.setdefault(item.writer, []).append(index)
        for writer, indices in by_writer.items():
            if writers[writer].named:
                sub = [out[i] for i in indices]
                moved += _name_sequences(sub, [chains[i] for i in indices], [hints[i] for i in indices],
                                         [sures[i] for i in indices], uncertain.setdefault(writer, {}))
                for i, item in zip(indices, sub):
                    out[i] = item
    silent.sort(key=lambda run: (run.line_no is None, run.line_no or 0))
    names = {(part, writer, run, rank): others for writer, got in uncertain.items() for (run, rank), others in got.items()}
    return RunRecords(out, started, silent, warnings, left_out, moved, names)
