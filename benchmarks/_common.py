"""What every benchmark here shares: the machine line, interleaved rounds, median and spread.

Rules the figures follow: variants measured side by side in one process (or, for whole-process
figures, one child process per run), rounds interleaved (every variant once per round, in turn, so
a machine that speeds up or slows down moves all of them), torch on one thread, and each figure
printed as the median over the rounds with the spread (min - max). A ratio is taken round by round
(variant A of round r over variant B of round r), then its median and spread.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Callable, Sequence

__all__ = ["machine_line", "load_line", "interleaved", "ratios", "fmt", "print_table", "one_thread"]


def one_thread() -> None:
    """torch on one intra-op thread (the benchmarks' rule on a small shared machine)."""
    import torch

    torch.set_num_threads(1)


def load_line() -> str:
    """The machine's load average (1, 5, 15 minutes): figures taken above about 1.5 on 2 cores are
    not to be trusted (other processes share the cores)."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux
        return "load average n/a"
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def machine_line() -> str:
    """Date (UTC), CPU, cores, Python, torch and OpenTelemetry SDK versions, CUDA device if any, and
    the load average when the benchmark started (:func:`load_line`)."""
    import torch

    try:
        from opentelemetry.sdk.version import __version__ as sdk
    except Exception:  # pragma: no cover - the SDK is a dependency
        sdk = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    return (
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC | {cpu}, {os.cpu_count()} cores | "
        f"Python {sys.version.split()[0]} | torch {torch.__version__} ({torch.get_num_threads()} thread) | "
        f"opentelemetry-sdk {sdk} | {device} | {load_line()}"
    )


def interleaved(variants: dict[str, Callable[[], float]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every variant once per round, in turn, ``rounds`` times after ``warmup`` rounds; each
    call returns its own measurement (seconds, or any unit). Returns name -> measurements."""
    results: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(warmup + rounds):
        for name, measure in variants.items():
            value = measure()
            if round_index >= warmup:
                results[name].append(value)
    return results


def timed(fn: Callable[[], object], number: int = 1, sync: Callable[[], None] = lambda: None) -> Callable[[], float]:
    """A measurement: seconds per call of ``fn`` over ``number`` calls (``sync`` before and after)."""

    def measure() -> float:
        sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        return (time.perf_counter() - start) / number

    return measure


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Round-by-round ratios ``a[r] / b[r]``."""
    return [x / y for x, y in zip(a, b) if y]


def fmt(values: Sequence[float], scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """``median (min - max)`` of ``values`` times ``scale``."""
    if not values:
        return "n/a"
    med, low, high = statistics.median(values) * scale, min(values) * scale, max(values) * scale
    return f"{med:.{digits}f}{unit} ({low:.{digits}f} - {high:.{digits}f})"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A plain aligned table with a title line."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(title)
    print("  ".join(str(cell).ljust(width) for cell, width in zip(header, widths)).rstrip())
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    print()


def report_child(got: dict, *providers) -> None:
    """A child process's last words: shut the OpenTelemetry ``providers`` down, then print ``got`` as
    one JSON line for the parent (``_revisions.run_child``)."""
    import json

    for provider in providers:
        provider.shutdown()
    print(json.dumps(got))
