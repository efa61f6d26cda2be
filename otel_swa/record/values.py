"""The values every line carries: their int64 bounds, the checks of a value given to a constructor
and of a value read from a log, and the compact JSON every line is written in."""

from __future__ import annotations

import json
from typing import Any, Callable

__all__ = ["INT64_MAX", "INT64_MIN", "MICRO_BATCH_MAX", "check_int", "check_optional_ints", "logged_int",
           "logged_counts", "compact"]

#: Bounds of every field: int64, what OTLP carries (an OTLP integer data point is an ``sfixed64``;
#: a larger Python int makes the whole metrics export fail with ``ValueError: Value out of range``).
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

#: The largest micro-batch index a record takes (micro-batches are a pipeline's few in-flight batches,
#: SGLang's ``mb_id`` in ``range(pp_loop_size)``; the bound keeps the metric attribute bounded).
MICRO_BATCH_MAX = 1023


def check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    """Check ``owner.name = value`` given to a constructor: a Python ``int`` (``bool`` refused) from
    ``minimum`` to :data:`INT64_MAX`.

    Raises:
        TypeError: not an int; ValueError: below ``minimum`` or above int64 (the message names the
            field and the value).
    """
    if type(value) is not int:  # noqa: E721 - bool and int subclasses are refused on purpose
        raise TypeError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise ValueError(
            f"{owner}.{name}={value} is above the int64 maximum 2**63 - 1 = {INT64_MAX} (OTLP carries int64)"
        )


def check_optional_ints(owner: str, obj: Any, names: tuple[str, ...]) -> None:
    """:func:`check_int` (minimum 0) on each attribute of ``obj`` named in ``names`` that is not
    ``None``."""
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            check_int(owner, name, value, 0)


def logged_int(name: str, value: Any, minimum: int) -> str | None:
    """Why ``value`` cannot be field ``name`` of a logged line, or ``None`` when it can."""
    if type(value) is int and minimum <= value <= INT64_MAX:  # noqa: E721 - the common case first
        return None
    if type(value) is not int:  # noqa: E721 - bool refused
        return f"{name}={json.dumps(value)} is not an integer"
    if value < minimum:
        return f"{name}={value} is negative"
    if not INT64_MIN <= value <= INT64_MAX:
        return f"{name}={value} is outside int64 (-2**63 .. 2**63 - 1, what OTLP carries)"
    return None


def logged_counts(data: dict, fail: Callable[[str], Exception], names: tuple[str, ...]) -> tuple[dict, int]:
    """``(counts, forward_ct)`` of the JSON object of a line that belongs to a record: its
    ``forward_ct`` (required), its ``micro_batch`` and the fields ``names`` present, each a
    non-negative int64 (``micro_batch`` up to :data:`MICRO_BATCH_MAX`); other keys are left out.

    Raises:
        MalformedRecordError (through ``fail``): ``forward_ct`` missing, a value out of its bounds.
    """
    if "forward_ct" not in data:
        raise fail("missing field forward_ct")
    counts: dict = {}
    for name in ("micro_batch",) + names:
        if name in data:
            value = data[name]
            if type(value) is not int or not 0 <= value <= INT64_MAX or (  # noqa: E721 - the common case inline
                    name == "micro_batch" and value > MICRO_BATCH_MAX):
                break
            counts[name] = value
    else:
        forward_ct = data["forward_ct"]
        if type(forward_ct) is int and 0 <= forward_ct <= INT64_MAX:  # noqa: E721
            return counts, forward_ct
    for name in ("forward_ct", "micro_batch") + names:  # a value out of its bounds: the first one's reason
        if name in data:
            reason = logged_int(name, data[name], 0)
            if reason is None and name == "micro_batch" and data[name] > MICRO_BATCH_MAX:
                reason = f"micro_batch={data[name]} is above {MICRO_BATCH_MAX}"
            if reason is not None:
                raise fail(reason)
    raise AssertionError("unreachable: a value out of bounds was found above")


def compact(value: Any) -> str:
    """``value`` as compact JSON (separators ``","`` and ``":"``, no spaces), as SGLang writes its
    line and every reader here requires."""
    return json.dumps(value, separators=(",", ":"))
