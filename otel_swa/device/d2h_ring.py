"""The delayed device-to-host path: a preallocated ring of staging slots, copied asynchronously.

torch only. Everything is allocated once, at construction:

* ``stage``: ``int64 [slots, width]`` on the device, where a sample is computed on the current stream;
* ``host``: ``int64 [slots, width]`` on the CPU, pinned when the device is CUDA;
* on CUDA, one side stream and one event per slot.

``start_copy(slot)`` makes the side stream wait for the current stream (so the copy sees the sample
just computed), enqueues a non-blocking copy of ``stage[slot]`` into ``host[slot]`` on the side stream
and records the slot's event there. ``ready(slot)`` polls that event (``event.query()``, never
blocks); ``wait(slot)`` blocks on it and is only used when every slot is in flight or on flush.

On a CPU device no CUDA API is touched, ever: the choice is made once in ``__init__`` and the copy is a
plain synchronous copy, so a slot is ready as soon as it was started.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DeviceToHostRing"]


class DeviceToHostRing:
    """A fixed ring of device staging slots and their host (pinned) mirrors.

    Args:
        slots: number of slots (>= 1).
        width: ``int64`` values per slot.
        device: where samples are computed.

    Raises:
        ValueError: ``slots`` < 1 or ``width`` < 1.
    """

    def __init__(self, slots: int, width: int, device: torch.device) -> None:
        if type(slots) is not int or slots < 1:
            raise ValueError(f"ring slots must be an int >= 1, got {slots!r}")
        if type(width) is not int or width < 1:
            raise ValueError(f"ring width must be an int >= 1, got {width!r}")
        self.device = torch.device(device)
        self.slots = slots
        self.is_cuda = self.device.type == "cuda"
        self.stage = torch.zeros(slots, width, dtype=torch.int64, device=self.device)
        # Pinned host buffers for what a sample uploads (the batch's host lengths and offsets; the
        # provenance verification's slots), per slot and name, grown on demand: the upload never
        # blocks the host.
        self._uploads: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        if self.is_cuda:
            self.host = torch.zeros(slots, width, dtype=torch.int64, pin_memory=True)
            self._stream = torch.cuda.Stream(device=self.device)
            self._events = [torch.cuda.Event() for _ in range(slots)]
        else:
            # Same-device copy on CPU: keep a separate host buffer so that delivery reads a
            # snapshot, exactly as on CUDA.
            self.host = torch.zeros(slots, width, dtype=torch.int64)
            self._stream = None
            self._events = None

    def upload(self, slot: int, values: np.ndarray, name: str = "sample") -> torch.Tensor:
        """``values`` (a host ``int64`` numpy array, any shape) as a tensor on the device, for the
        sample staged in ``slot`` (one upload per ``name`` and sample: each name has its buffer).

        On CUDA the values go through the slot's pinned buffer and one non-blocking copy on the
        current stream, so the host never waits for the queued forward (a copy from pageable memory
        would). The buffer is rewritten only when the slot is reused, after its sample was delivered,
        i.e. after this copy completed. On CPU the array is wrapped, not copied.
        """
        if not self.is_cuda:
            return torch.from_numpy(values)
        count = values.size
        buffer = self._uploads[slot].get(name)
        if buffer is None or buffer.numel() < count:
            size = max(count, 64, 2 * (buffer.numel() if buffer is not None else 0))
            buffer = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._uploads[slot][name] = buffer
        staged = buffer[:count]
        staged.numpy()[:] = values.reshape(-1)  # host memory write: no torch operation
        return staged.view(values.shape).to(self.device, non_blocking=True)

    def start_copy(self, slot: int) -> None:
        """Start copying ``stage[slot]`` to ``host[slot]``; returns without waiting on CUDA."""
        if not self.is_cuda:
            self.host[slot].copy_(self.stage[slot])
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.host[slot].copy_(self.stage[slot], non_blocking=True)
            self._events[slot].record(stream)

    def ready(self, slot: int) -> bool:
        """Whether ``host[slot]`` holds the finished copy; never blocks."""
        return not self.is_cuda or self._events[slot].query()

    def wait(self, slot: int) -> None:
        """Block until ``host[slot]`` holds the finished copy."""
        if self.is_cuda:
            self._events[slot].synchronize()

    def reset_after_fork(self) -> None:
        """Forget copies in flight in a forked child (nothing to release: a forked child cannot use
        the parent's CUDA context, and on CPU no copy is ever in flight)."""

    def read(self, slot: int) -> list[int]:
        """The host values of ``slot`` as Python ints (call only once ``ready``/``wait``)."""
        return self.host[slot].tolist()
