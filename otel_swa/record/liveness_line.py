"""The liveness warning (:data:`~otel_swa.record.LIVENESS_PREFIX`): a reporter that is on and
delivers no sample (:class:`LivenessWarning`)::

    otel_swa[verify=attention] otel_swa_liveness={"pid":4242,"forward_ct":0,"steps":0,"samples_delivered":0,...,"cause":"no_forward_step"}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from otel_swa.record.matches import LineMatch
from otel_swa.record.prefixes import LIVENESS_PREFIX, VERIFY_SOURCES, tagged
from otel_swa.record.values import check_int, compact, logged_int

__all__ = ["LIVENESS_CAUSES", "LivenessWarning", "LivenessMatch", "liveness_summary", "decode_liveness"]

#: Why a reporter that is on delivered no sample (:attr:`LivenessWarning.cause`): ``no_forward_step``:
#: no forward step reached it, the engine's forward-step hook never fired (reported at process exit);
#: ``no_sample_delivered``: forward steps reached it and, for :attr:`LivenessWarning.steps` of them,
#: no sample was delivered (every view refused, sampling skipped).
LIVENESS_CAUSES = ("no_forward_step", "no_sample_delivered")
_LIVENESS_COUNTS = ("forward_ct", "steps", "samples_delivered", "samples_taken", "invalid_samples", "skipped_captures")


@dataclass(frozen=True, slots=True)
class LivenessWarning:
    """otel-swa on and not working: a reporter that delivered no sample, as SGLang's KV canary says
    "canary path is not executing" when a kernel's run counter is still 0 after its warm-up.

    Written by the line sinks as otel-swa's own line (:meth:`line`), after the run start marker::

        otel_swa[verify=attention] otel_swa_liveness={"pid":4242,"forward_ct":0,"steps":0,"samples_delivered":0,"samples_taken":0,"invalid_samples":0,"skipped_captures":0,"cause":"no_forward_step"}

    Attributes:
        cause: one of :data:`LIVENESS_CAUSES`.
        forward_ct: forward steps the reporter had seen.
        steps: forward steps since its last delivered sample (all of them when none was).
        samples_delivered: records it delivered in its life (0 when it never worked).
        samples_taken, invalid_samples, skipped_captures: its counts of the same names
            (``ReporterStats``): what explains the silence.
        verify_source: the reporter's tag (:data:`VERIFY_SOURCES`), or ``None``.
        pid: the process id, or ``None`` (then :meth:`line` writes this process's).
        hook: where the engine was expected to step the reporter (``"SGLang
            ModelRunner.forward"``), or ``None``.

    Raises:
        ValueError: an unknown ``cause`` or ``verify_source``; TypeError: a count that is no int,
            a ``hook`` that is no string.
    """

    cause: str
    forward_ct: int = 0
    steps: int = 0
    samples_delivered: int = 0
    samples_taken: int = 0
    invalid_samples: int = 0
    skipped_captures: int = 0
    verify_source: "str | None" = None
    pid: "int | None" = None
    hook: "str | None" = None

    def __post_init__(self) -> None:
        if self.hook is not None and not isinstance(self.hook, str):
            raise TypeError(f"LivenessWarning.hook must be None or a str, got {self.hook!r}")
        if self.cause not in LIVENESS_CAUSES:
            raise ValueError(f"LivenessWarning.cause must be one of {', '.join(LIVENESS_CAUSES)}, got {self.cause!r}")
        for name in _LIVENESS_COUNTS:
            check_int("LivenessWarning", name, getattr(self, name), 0)
        if self.verify_source is not None and self.verify_source not in VERIFY_SOURCES:
            raise ValueError(f"LivenessWarning.verify_source must be None or one of {', '.join(VERIFY_SOURCES)}, "
                             f"got {self.verify_source!r}")

    def to_dict(self) -> dict:
        """The line's JSON object: ``pid``, the counts, ``cause``."""
        fields: dict = {"pid": os.getpid() if self.pid is None else self.pid}
        fields.update((name, getattr(self, name)) for name in _LIVENESS_COUNTS)
        fields["cause"] = self.cause
        if self.hook is not None:
            fields["hook"] = self.hook
        return fields

    def line(self) -> str:
        """``otel_swa[verify=<source>] otel_swa_liveness={...}`` (compact JSON; no tag without a source)."""
        return tagged(self.verify_source, LIVENESS_PREFIX + compact(self.to_dict()))

    def summary(self) -> str:
        """The warning in words: ``instrumented, 0 samples in N steps: <why>``."""
        return liveness_summary(self.to_dict())


def liveness_summary(fields: dict) -> str:
    """:meth:`LivenessWarning.summary` of a liveness line's JSON object (missing counts read as 0)."""
    count = {name: fields.get(name) if type(fields.get(name)) is int else 0 for name in _LIVENESS_COUNTS}  # noqa: E721
    head = f"instrumented, {count['samples_delivered']} samples in {count['steps']} steps"
    if fields.get("cause") == "no_forward_step":
        hook = fields.get("hook")
        why = "no forward step reached the reporter (" + (
            f"the engine was to step it from {hook}" if isinstance(hook, str) else "the engine's forward-step hook never "
            "stepped it") + ")"
        if count["skipped_captures"]:
            why += f"; {count['skipped_captures']} step() call(s) during CUDA graph capture were ignored"
        return f"{head}: {why}"
    if count["samples_delivered"]:
        head = f"instrumented, 0 samples in the last {count['steps']} steps ({count['samples_delivered']} before)"
    reasons = []
    if count["samples_taken"] == 0:
        reasons.append("no sample was taken (every sampling step failed before its sample: a view the reporter refused?)")
    elif count["invalid_samples"]:
        reasons.append(f"{count['invalid_samples']} of {count['samples_taken']} sample(s) taken were refused (view "
                       "faults or invalid values: kv_cache.swa.reporter.view_faults)")
    if count["skipped_captures"]:
        reasons.append(f"{count['skipped_captures']} step() call(s) during CUDA graph capture were ignored")
    return f"{head}: " + ("; ".join(reasons) or "samples taken and not delivered")


class LivenessMatch(LineMatch):
    """One liveness warning found in a text (:class:`~otel_swa.record.LineMatch`); ``fields`` (its
    ``value``): its JSON object (unknown keys kept, never required)."""

    __slots__ = ()
    fields = LineMatch.value

    @property
    def summary(self) -> str:
        """The warning in words (:func:`liveness_summary`)."""
        return liveness_summary(self.fields)


def decode_liveness(data: dict, fail: Callable[[str], Exception], source: str | None) -> tuple[dict, None]:
    """``(fields, None)`` of a liveness warning's JSON object, its counts (non-negative int64) and
    words (strings) checked; unknown keys kept.

    Raises:
        MalformedRecordError (through ``fail``): a count or word of the wrong type.
    """
    for name in _LIVENESS_COUNTS:
        if name in data:
            reason = logged_int(name, data[name], 0)
            if reason is not None:
                raise fail(reason)
    for name in ("cause", "hook"):
        if name in data and not isinstance(data[name], str):
            raise fail(f"{name}={json.dumps(data[name])} is not a string")
    return data, None
