"""The rank sequences of one writer's records while a log is read, for
:mod:`otel_swa.testing.runs` (its module docstring has the rules): each rank's state, which
sequence a record continues, and the names given to the sequences at the end from the log
prefixes' votes (:class:`NameVotes`).

This module does not import pytest.
"""

from __future__ import annotations

from typing import Any

from otel_swa.record import SwaDivergenceRecord

__all__ = ["RankState", "WriterState", "LEFT_OUT", "attribute", "continues", "totals_dropped", "NameVotes"]


class RankState:
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


class WriterState:
    """One writer's rank sequences while its lines are read.

    Args:
        partial: :attr:`named` is learned while the log is read (not known for the whole log
            first): a step that would look at ranks still to come sets :attr:`unsure`.
    """

    __slots__ = ("run", "ranks", "named", "records", "partial", "unsure")

    def __init__(self, partial: bool = False) -> None:
        self.run = 0
        self.ranks: dict[str | None, RankState] = {}
        self.named: tuple = ()  # the ranks the writer's lines name, in order of first appearance
        self.records = 0
        self.partial = partial
        self.unsure = False  # with partial names: a step looked at the ranks to come

    def rehome(self, rank: Any) -> None:
        """A sure line of ``rank`` begins its run: when the rank's current run began by a guess
        (another process's line taken for it), that run goes to a rank that has not begun yet."""
        rs = self.ranks.get(rank)
        if rs is None or not rs.guessed or not self.began(rank):
            return
        if self.partial:
            self.unsure = True  # the ranks that have not begun include those still to come
        others = [r for r in self.named if r != rank and not self.began(r)]
        others += [r for r in self.named if r != rank and self.began(r) and not self.ranks[r].run_records]
        other = others[0] if others else None  # a rank that has not begun, or whose run has only its marker
        if other is not None:
            self.ranks[other], self.ranks[rank] = rs, RankState()
        elif rs.run_records == 0:  # only a marker taken for this rank's: this line's supersedes it
            fresh = self.ranks[rank] = RankState()
            fresh.run, fresh.last, fresh.last_ct, fresh.before_last_ct = rs.run - 1, rs.last, rs.last_ct, rs.before_last_ct

    def began(self, rank: Any) -> bool:
        """Whether ``rank`` has begun its run in the latest run of the log (a record or a marker)."""
        rs = self.ranks.get(rank)
        return rs is not None and rs.run == self.run and self.run > 0 and (rs.run_records > 0 or rs.marker)


def totals_dropped(last: SwaDivergenceRecord, record: SwaDivergenceRecord) -> bool:
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
    if last is None or record.forward_ct <= last.forward_ct or (not relaxed and totals_dropped(last, record)):
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


def continues(rs: "RankState", record: SwaDivergenceRecord, relaxed: bool = False) -> float | None:
    """:func:`_distance` of ``record`` from the rank sequence ``rs``, at its usual step."""
    step = rs.last_ct - rs.before_last_ct if rs.before_last_ct is not None and rs.run_records > 1 else None
    return _distance(rs.last, record, step, relaxed)


def can_continue(rs: "RankState", record: SwaDivergenceRecord) -> bool:
    """Whether :func:`continues` gives ``record`` a distance from ``rs`` (not ``None``), without
    its arithmetic where that cannot fail (every record of a rank's steady sequence asks)."""
    last = rs.last
    if last is None or record.forward_ct <= last.forward_ct or totals_dropped(last, record):
        return False
    step = rs.last_ct - rs.before_last_ct if rs.before_last_ct is not None and rs.run_records > 1 else None
    if record.forward_ct - last.forward_ct > _MAX_STEPS * (step if step else last.forward_ct):
        return False
    return last.forward_ct != 0 or continues(rs, record) is not None  # it divides by last.forward_ct


LEFT_OUT = object()


def attribute(state: WriterState, hint: str | None, sure: bool, record: SwaDivergenceRecord,
               whole: bool = False) -> Any:
    """The rank sequence ``record`` belongs to (the module docstring's rule), by the name it has
    while the log is read (the final names come from the prefixes: :func:`_name_sequences`), or
    ``LEFT_OUT``; a 1-tuple ``(rank,)`` for a record that goes there without starting a run.

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
        if own is not None and not own.marker and can_continue(own, record):
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
        return hint if hint is not None else LEFT_OUT
    best = _closest(state, hint, record, relaxed=True)
    return (best,) if best is not None else LEFT_OUT


def _interval(state: WriterState, record: SwaDivergenceRecord) -> int:
    """The writer's sampling interval as its ranks' sequences show it (the smallest rise in
    ``forward_ct``, or first ``forward_ct``); ``record``'s ``forward_ct`` when none shows one."""
    steps = [rs.last_ct - rs.before_last_ct if rs.before_last_ct is not None and rs.run_records > 1 else rs.last_ct
             for rs in state.ranks.values() if rs.last is not None]
    steps = [step for step in steps if step > 0]
    return min(steps) if steps else record.forward_ct


def _closest(state: WriterState, hint: str | None, record: SwaDivergenceRecord, exclude: Any = LEFT_OUT,
             relaxed: bool = False) -> Any:
    """The rank whose sequence ``record`` continues most closely (``hint`` when as close), or
    ``None``; ``relaxed``: its totals may be below the rank's last ones."""
    best = None
    for rank in state.named:
        rs = state.ranks.get(rank)
        if rank == exclude or rs is None or (rs.marker and rank != hint):
            continue
        distance = continues(rs, record, relaxed)
        if distance is None:
            continue
        key = (distance, rank != hint)
        if best is None or key < best[0]:
            best = (key, rank)
    return None if best is None else best[1]


def _waiting_ranks(state: WriterState) -> list:
    """The ranks whose next line may begin their run: those with a run start marker and no record
    since, then those that have not written in the run of the log yet."""
    started = [rank for rank in state.named if rank in state.ranks and state.ranks[rank].marker]
    return started + [rank for rank in state.named if not state.began(rank) and rank not in started]



#: A name whose prefixes' share is at least this fraction of the chosen name's is shown beside it.
_CLOSE_VOTES = 0.8


class NameVotes:
    """The votes that name one writer's rank sequences run by run after the log prefixes of their
    records (a permutation of the names within a run): a record whose prefix is sure votes for its
    rank, one read while several prefixes waited gives each a share, so that the rank present
    every time wins. Its size grows with the runs, sequences and names, not with the records."""

    def __init__(self) -> None:
        self.votes: dict[int, dict] = {}  # run -> (sequence, name) -> votes
        self.current: dict[tuple, Any] = {}  # sequence -> the rank its last record was given
        self.hints: dict[tuple, int] = {}  # (sequence, the rank its prefix named) -> records
        self._chains: dict[tuple, RankState] = {}  # keeps each sequence's state (its id is its key)

    def add(self, run: int, chain: RankState, rank: Any, hint: Any, candidates: "tuple | None") -> None:
        """A record of sequence ``chain`` in ``run``, given ``rank``, whose log prefix named
        ``hint`` (``candidates``: the ranks of the prefixes waiting when it was read, or ``None``
        when its prefix was sure)."""
        key = (run, id(chain))
        self.current[key] = rank
        self._chains[key] = chain
        counts = self.votes.setdefault(run, {})
        # the record's own prefix is one of those waiting when it was read: each gets a share, and
        # the one it was read with (the nearest before it, or the one it claimed) a little more, to break ties
        for name in ((hint,) if candidates is None else candidates):
            if name is not None:
                share = 1 / (1 if candidates is None else len(candidates)) + (0.001 if name == hint else 0)
                counts[(key, name)] = counts.get((key, name), 0) + share
        hinted = (key, hint)
        self.hints[hinted] = self.hints.get(hinted, 0) + 1

    def names(self) -> dict[tuple, Any]:
        """Each sequence's name, by ``(run, id(state))``."""
        votes, current = self.votes, self.current
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
        return names

    def moved(self, names: dict[tuple, Any]) -> int:
        """How many records carry another name than their prefix's under ``names``."""
        return sum(count for (key, hint), count in self.hints.items() if names.get(key, self.current[key]) != hint)

    def uncertain(self, names: dict[tuple, Any]) -> dict[tuple, tuple]:
        """``(run, name) -> names``: the other names the prefixes of a sequence pointed to nearly
        as often as to its name (lines of several processes written at once): its name is a guess."""
        out: dict[tuple, tuple] = {}
        for key, name in names.items():
            got = self.votes.get(key[0], {})
            mine = got.get((key, name), 0)
            others = sorted(((v, n) for (k, n), v in got.items() if k == key and n != name and n is not None
                             and v >= _CLOSE_VOTES * mine), reverse=True)
            if others:
                out[(key[0], name)] = tuple(n for _, n in others[:3])
        return out
