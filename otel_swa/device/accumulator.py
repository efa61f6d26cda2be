"""The device accumulator behind ``observe``: cumulative KV entries checked per pool.

torch only. Nothing here synchronises with the host or allocates device memory after construction,
so ``add`` is safe inside CUDA graph capture.
"""

from __future__ import annotations

import enum

import torch

from otel_swa.record import INT64_MAX

__all__ = ["KVPool", "PoolAccumulator", "pool_index"]


class KVPool(enum.IntEnum):
    """The two KV pools of a hybrid model; the value is the index in the accumulator (SGLang's order)."""

    FULL = 0
    SWA = 1


_POOL_INDEX: dict[object, int] = {
    KVPool.FULL: 0,
    KVPool.SWA: 1,
    "full": 0,
    "swa": 1,
    "FULL": 0,
    "SWA": 1,
}


def pool_index(pool: object) -> int:
    """Index of ``pool`` (``KVPool``, ``0``/``1`` or ``"full"``/``"swa"``) in the accumulator.

    Raises:
        ValueError: ``pool`` names no pool.
    """
    try:
        return _POOL_INDEX[pool]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV pool {pool!r}; expected KVPool.FULL, KVPool.SWA, 'full' or 'swa'") from None


class PoolAccumulator:
    """Cumulative number of KV entries checked (read) per pool: the device part and the host part.

    A count given as a device tensor is added on the device, in place (no host sync, safe inside
    CUDA graph capture); a count given as a Python int is added to a host int (no device operation,
    no allocation: the engine's host counts never become a kernel launch). A sample stages the
    device part and carries the host part with it; the record's totals are their sum.

    Attributes:
        totals: ``int64`` tensor of shape ``[2]`` on ``device``, the device part; index 0 the FULL
            pool, 1 the SWA pool (the layout of SGLang's ``verify`` counters). Allocated once.
        host: ``[full, swa]``, the host part (Python ints).
    """

    __slots__ = ("totals", "host", "_cells", "_on_cuda")

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        self.totals = torch.zeros(2, dtype=torch.int64, device=device)
        self.host = [0, 0]
        # 0-dim views made once, so that a tensor add does no indexing work at all.
        self._cells = (self.totals[0], self.totals[1])
        self._on_cuda = device.type == "cuda"

    def add(self, pool: object, count: "int | torch.Tensor") -> None:
        """Add ``count`` entries to ``pool``'s total.

        Args:
            pool: see :func:`pool_index`.
            count: a Python ``int`` (added on the host) or a 0-dim integer tensor on the
                accumulator's device (added in place on the device). Inside CUDA graph capture a
                Python int is added on the device, as a constant captured into the graph (every
                replay adds it): pass a device tensor there.

        Raises:
            ValueError: unknown pool; a Python int ``count`` that is negative, or that would take
                the pool's host total above int64 (:data:`otel_swa.record.INT64_MAX`, what the
                record and OTLP carry): refused, the total unchanged (a tensor's value is not read:
                that would synchronise).
            TypeError: ``count`` is neither an ``int`` nor a 0-dim integer tensor (a float, a
                bool, a tensor of another shape or dtype); only metadata is checked.
        """
        if type(count) is int:
            try:
                index = _POOL_INDEX[pool]
            except (KeyError, TypeError):
                index = pool_index(pool)  # raises the ValueError
            if count < 0:
                raise ValueError(f"count of KV entries must be >= 0, got {count} for pool {pool!r}")
            if count > INT64_MAX - self.host[index]:
                raise ValueError(
                    f"count of KV entries {count} for pool {pool!r} would take its total "
                    f"{self.host[index]} above the int64 maximum 2**63 - 1 = {INT64_MAX} (records and OTLP "
                    "carry int64); refused, the total is unchanged"
                )
            if self._on_cuda and torch.cuda.is_current_stream_capturing():
                self._cells[index].add_(count)
                return
            self.host[index] += count
            return
        if not (
            isinstance(count, torch.Tensor)
            and count.dim() == 0
            and not count.dtype.is_floating_point
            and not count.dtype.is_complex
            and count.dtype is not torch.bool
        ):
            shown = f"tensor of shape {tuple(count.shape)} and dtype {count.dtype}" if isinstance(count, torch.Tensor) else repr(count)
            raise TypeError(f"count of KV entries must be an int or a 0-dim integer tensor, got {shown} for pool {pool!r}")
        self._cells[pool_index(pool)].add_(count)

    def combined(self) -> torch.Tensor:
        """Device part plus host part, a new ``int64 [2]`` tensor on the device (reads nothing back)."""
        return self.totals + torch.tensor(self.host, dtype=torch.int64).to(self.totals.device)

    def reset(self) -> None:
        """Set both parts to zero (device op, no sync)."""
        self.totals.zero_()
        self.host = [0, 0]
