"""What ``otel-swa replay`` checks before the run, so that a bad option fails at once with the
option, the value and why: the plot path, the log file, the pool sizes against this machine's
memory, an allocation that failed in the engine, and hints for the standard OTEL_* variables."""

from __future__ import annotations

import argparse
import errno
import os
import re
import stat
from pathlib import Path
from typing import Any

__all__ = [
    "check_plot",
    "check_log_file",
    "available_memory",
    "check_pool_memory",
    "is_allocation_error",
    "pool_too_large",
]


def check_plot(path: str, interval: int) -> Path:
    """Check ``--plot`` before the run: matplotlib imports, the suffix is an image format, the folder
    exists, and the reporter is on (else there is nothing to draw).

    Returns:
        the path the image will have (``.png`` appended when there is no suffix).

    Raises:
        PlotUnavailableError: matplotlib is not installed (the message gives the pip command).
        ValueError, OSError: the path cannot take an image, or the reporter is off.
    """
    from otel_swa.plot import check_image_path

    out = check_image_path(path)
    if interval == 0:
        raise ValueError(f"--plot {path!r} needs records, but the reporter is off (interval 0)")
    return out


def check_log_file(path: str) -> None:
    """Open ``--log-file`` for appending once, before the run, so a bad path fails at once. A named
    pipe is not opened (an open and close would end its reader's input before the run wrote a line,
    and the run's own open would then wait for a reader for ever): only whether it may be written.

    Raises:
        ValueError: the file cannot be opened (the message names the option, the path and why).
    """
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        fifo = False  # missing (the open below makes it), or the open below says why not
    try:
        if fifo:
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            return
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ValueError(f"--log-file {path!r} cannot be opened for appending: {exc.strerror or exc}") from None


#: Host bytes per slot of the reference engine's pools, besides the KV entries: a free-list entry
#: (a Python int in a deque, about 36 bytes) in each pool, plus the int64 full-to-SWA mapping (8
#: bytes) per FULL slot. A coarse figure, enough to refuse a size no machine can hold before the
#: engine starts filling its free lists.
_FREE_LIST_BYTES_PER_SLOT = 36
_MAPPING_BYTES_PER_FULL_SLOT = 8


def available_memory() -> int | None:
    """Bytes of host memory available now (``MemAvailable`` of /proc/meminfo, else the physical
    memory), or ``None`` when the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_pool_memory(config: Any, available: int | None) -> None:
    """Refuse pool sizes whose host memory alone exceeds what is available.

    Raises:
        ValueError: the message names the option that is too large, the estimate and what is available.
    """
    if available is None:
        return
    kv_bytes = 2 * 4 * config.num_heads * config.head_dim if config.run_model else 0  # float32 K and V
    need = {
        "--full-pool": config.full_pool_size * (_FREE_LIST_BYTES_PER_SLOT + _MAPPING_BYTES_PER_FULL_SLOT + kv_bytes),
        "--swa-pool": config.swa_pool_size * (_FREE_LIST_BYTES_PER_SLOT + kv_bytes),
    }
    if sum(need.values()) <= available:
        return
    option = max(need, key=need.__getitem__)
    slots = config.full_pool_size if option == "--full-pool" else config.swa_pool_size
    raise ValueError(
        f"{option} {slots} slots is too large for this machine's memory: the KV pools need about "
        f"{_gib(sum(need.values()))} of host memory, {_gib(available)} is available; lower {option}"
    )


def _gib(n_bytes: int) -> str:
    """``n_bytes`` in GiB, or in MiB below 1 GiB (one decimal)."""
    if n_bytes < 2**30:
        return f"{n_bytes / 2**20:,.1f} MiB"
    return f"{n_bytes / 2**30:,.1f} GiB"


def is_allocation_error(exc: BaseException) -> bool:
    """A host or device memory allocation failed (torch raises RuntimeError, or its subclass
    OutOfMemoryError, with "allocate" in the message; Python raises MemoryError)."""
    return isinstance(exc, MemoryError) or "allocate" in str(exc).lower()


def pool_too_large(args: argparse.Namespace, exc: BaseException) -> str:
    """One line naming the pool option that is too large for this machine's memory."""
    match = re.search(r"allocate (\d+) bytes", str(exc))
    tried = f" (an allocation of {int(match.group(1)):,} bytes failed)" if match else ""
    option, value = max((("--full-pool", args.full_pool), ("--swa-pool", args.swa_pool)), key=lambda item: item[1])
    return (f"cannot allocate the KV pools{tried}: {option} {value} slots is too large for this machine's memory; "
            f"lower {option}")
