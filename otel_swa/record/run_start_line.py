"""The run start marker (:data:`~otel_swa.record.RUN_START_PREFIX`), written before the first
record a line sink writes, so that a log appended to by several runs shows where each began::

    otel_swa[verify=attention] otel_swa_run_start={"pid":4242}
"""

from __future__ import annotations

import os
from typing import Callable

from otel_swa.record.matches import LineMatch
from otel_swa.record.prefixes import RUN_START_PREFIX, VERIFY_SOURCES, tagged
from otel_swa.record.values import compact

__all__ = ["RunStartMatch", "run_start_line", "decode_run_start"]


def run_start_line(verify_source: str | None, pid: int | None = None) -> str:
    """otel-swa's run start marker: ``otel_swa[verify=<source>] otel_swa_run_start={"pid":N}``.

    A line sink writes it once, before the first record it writes, so a log that several runs
    append to shows where each began. ``pid`` defaults to this process's id.

    Raises:
        ValueError: ``verify_source`` is not ``None`` nor one of :data:`~otel_swa.record.VERIFY_SOURCES`.
    """
    if verify_source is not None and verify_source not in VERIFY_SOURCES:
        raise ValueError(f"verify_source must be None or one of {', '.join(VERIFY_SOURCES)}, got {verify_source!r}")
    return tagged(verify_source, RUN_START_PREFIX + compact({"pid": os.getpid() if pid is None else pid}))


class RunStartMatch(LineMatch):
    """One run start marker found in a text (:class:`~otel_swa.record.LineMatch`); ``fields`` (its
    ``value``): its JSON object (``{"pid": 4242}``; unknown keys kept, never required)."""

    __slots__ = ()
    fields = LineMatch.value

    @property
    def pid(self) -> int | None:
        """The process id the marker names, or ``None``."""
        pid = self.fields.get("pid")
        return pid if type(pid) is int else None  # noqa: E721


def decode_run_start(data: dict, fail: Callable[[str], Exception], source: str | None) -> tuple[dict, None]:
    """``(fields, None)``: a run start marker's JSON object is taken as it is."""
    return data, None
