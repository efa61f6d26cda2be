"""Scratch memory of the device computations: where the sample and the audit write their temporaries.

torch only. A :class:`Workspace` hands out 1-D buffers by name, so that every pass of the sample and
of the audit can write into memory it already has (``out=`` arguments) instead of allocating:

* on the CPU the buffers are kept and grown geometrically (to the largest batch seen, at least
  twice the previous size), so a steady run allocates nothing per sample. A fresh large allocation
  on the CPU costs a page fault per 4 KiB page touched (measured: ``benchmarks/bench_sample.py``
  shows it as several ns per token at millions of tokens) and, for sizes under glibc's dynamic mmap
  threshold, fragments the heap;
* on CUDA each request is a plain ``torch.empty`` from PyTorch's caching allocator: no host work, no
  device memory held between samples (an engine's memory stays the engine's).

Contents are never relied on between requests (every user writes before it reads), except the
``keep`` buffers (:meth:`Workspace.kept`), which keep their contents on every device.
"""

from __future__ import annotations

import torch

__all__ = ["Workspace"]


class Workspace:
    """Named scratch buffers on ``device`` (see the module docstring).

    Args:
        device: where the buffers live.
    """

    def __init__(self, device: "torch.device | str") -> None:
        self.device = torch.device(device)
        self.persistent = self.device.type == "cpu"
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``size`` elements on the device, contents undefined."""
        if not self.persistent:
            return torch.empty(size, dtype=dtype, device=self.device)
        return self.kept(name, size, dtype)

    def kept(self, name: str, size: int, dtype: torch.dtype, fill: "int | None" = None) -> torch.Tensor:
        """Like :meth:`get`, but kept on every device: values written stay until overwritten. A
        buffer made (or grown) here starts filled with ``fill``, or undefined when it is ``None``."""
        key = (name, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            grown = max(size, 64, 2 * buffer.numel() if buffer is not None else 0)
            if fill is None:
                buffer = torch.empty(grown, dtype=dtype, device=self.device)
            else:
                buffer = torch.full((grown,), fill, dtype=dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:size]

    def arange(self, size: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``torch.arange(size)`` in ``dtype``, from a kept buffer (made once per size class)."""
        key = ("arange", dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            grown = max(size, 64, 2 * buffer.numel() if buffer is not None else 0)
            buffer = torch.arange(grown, dtype=dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:size]

    def zeros(self, size: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A kept buffer of ``size`` zeros (made once per size class; callers never write to it)."""
        key = ("zeros", dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.zeros(max(size, 16), dtype=dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:size]

    def ones(self, size: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """A kept buffer of ``size`` ones (made once per size class; callers never write to it)."""
        key = ("ones", dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.ones(max(size, 64, 2 * buffer.numel() if buffer is not None else 0), dtype=dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:size]

    def constant(self, values: "tuple[int, ...]", dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A kept 1-D tensor holding ``values`` (made once per ``values``; callers never write to it)."""
        key = ("constant", values, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.tensor(values, dtype=dtype, device=self.device)
        return buffer

    def nbytes(self) -> int:
        """Bytes held by the kept buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer."""
        self._buffers.clear()
