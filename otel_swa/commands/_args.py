"""argparse value types shared by the subcommands: each error names the value and what was expected."""

from __future__ import annotations

import argparse
import math


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected an integer >= {minimum}") from None
    if value < minimum:
        below = "negative" if minimum == 0 else f"below {minimum}"
        raise argparse.ArgumentTypeError(f"{text!r} is {below}; expected an integer >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def _float_at_least(text: str, positive: bool, not_a_number: str, out_of_range: str) -> float:
    """``text`` as a finite float, > 0 (``positive``) or >= 0; else ``argparse.ArgumentTypeError``
    naming ``text`` and then saying ``not_a_number`` or ``out_of_range``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} {not_a_number}") from None
    if not (value > 0 if positive else value >= 0) or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} {out_of_range}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _float_at_least(text, True, "is not a number; expected a number > 0",
                           "is out of range; expected a finite number > 0")


def non_negative_int(text: str) -> int:
    """argparse type: a base-10 integer >= 0."""
    return _int_at_least(text, 0)


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    return _float_at_least(text, False, "is not a number; expected seconds >= 0",
                           "is not a finite number >= 0; expected seconds >= 0")


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is zero; expected seconds > 0")
    return value
