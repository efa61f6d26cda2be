"""A complete log file read once, in order, holding only the entries that the next lines are
expected to change: memory bounded by the log's ranks and one chunk, not by its length.

:func:`stream_log` reads the file in chunks (:class:`~otel_swa.logsource.LogFollower`, final read)
into an :class:`EntryWindow` and hands each entry to the caller, in log order, once no line is
expected to change it (:meth:`~otel_swa.logsource.LogFollower.settled` without ``waiting``: all
but the latest record of each tag and rank), then lets it go. A line that still belongs to an
entry already handed on (an audit or provenance line written far from its record, by a process
writing the log at once with others) stops the read with :class:`ReleasedEntryError`: such a log
is read whole. Otherwise the entries and their order are those of
:attr:`LogFollower.entries <otel_swa.logsource.LogFollower.entries>` after one final poll.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from otel_swa.logsource import LogFollower

__all__ = ["EntryWindow", "ReleasedEntryError", "stream_log", "STREAM_CHUNK_BYTES"]

#: How much of the file :func:`stream_log` reads at once (bytes): the entries of one chunk are
#: held until it is parsed (about 1,300 records with their audit and provenance lines).
STREAM_CHUNK_BYTES = 2**20


class ReleasedEntryError(IndexError):
    """An entry already let go (:meth:`EntryWindow.release`) was read or replaced."""


class EntryWindow:
    """A list of log entries of which only the tail is held: indices count every entry ever
    appended (as :class:`~otel_swa.record.AuditPairing` remembers them), :meth:`release` lets the
    oldest go. Supports what the log readers use: ``append``, ``len``, reading and replacing an
    entry still held, and ``window[start:]``.

    Raises:
        ReleasedEntryError: an entry already released is read or replaced.
        IndexError: an entry not yet appended is.
    """

    __slots__ = ("_held", "_base")

    def __init__(self) -> None:
        self._held: list = []
        self._base = 0

    def append(self, entry: Any) -> None:
        self._held.append(entry)

    def __len__(self) -> int:
        return self._base + len(self._held)

    def _at(self, index: int) -> int:
        at = index - self._base
        if at < 0:
            raise ReleasedEntryError(f"entry {index} was let go (held: {self._base} to {len(self) - 1})")
        if at >= len(self._held):
            raise IndexError(f"entry {index} is not held (held: {self._base} to {len(self) - 1})")
        return at

    def __getitem__(self, index: "int | slice") -> Any:
        if isinstance(index, slice):
            if index.stop is not None or index.step is not None:
                raise IndexError("only window[start:] is supported")
            return self._held[max((index.start or 0) - self._base, 0):]
        return self._held[self._at(index)]

    def __setitem__(self, index: int, entry: Any) -> None:
        self._held[self._at(index)] = entry

    def release(self, upto: int) -> list:
        """Let go of the entries before index ``upto``; return them, in order."""
        count = max(0, upto - self._base)
        out = self._held[:count]
        del self._held[:count]
        self._base += len(out)
        return out


def stream_log(path: "str | os.PathLike[str]", consume: Callable[[Any], None]) -> LogFollower:
    """Read the complete log file at ``path`` once (a final read: an unterminated last line that
    reads whole counts, a cut one is left out) and call ``consume`` with each entry
    (:class:`~otel_swa.logsource.LoggedRecord`, :class:`~otel_swa.logsource.LoggedRunStart`,
    :class:`~otel_swa.record.LivenessMatch`) in order, once it is final.

    Returns:
        the :class:`~otel_swa.logsource.LogFollower` that read it, for what reading found
        (``errors``, ``duplicates``, ``cut_line``, ``missing``, ``error``); its ``entries`` hold none.

    Raises:
        ReleasedEntryError: a line belongs to an entry already handed on (see the module
            docstring): read the log whole.
        whatever ``consume`` raises (the read stops there).
    """
    window = EntryWindow()
    follower = LogFollower(path, entries=window)

    def settle() -> None:
        for entry in window.release(follower.settled(waiting=False)):
            consume(entry)

    follower.poll(final=True, each_chunk=settle, chunk_bytes=STREAM_CHUNK_BYTES)
    for entry in window.release(len(window)):
        consume(entry)
    return follower
