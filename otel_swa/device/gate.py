"""The sampling decision on the device: what lets the in-forward checks live inside a CUDA graph.

torch only. A forward step replayed from a CUDA graph runs no Python: a check that decides on the
host whether this step is sampled (as the read check did) is either absent from the graph or fixed
at what it was when the graph was captured. The :class:`SamplingGate` moves the decision onto the
device:

* ``flag``: a 0-dim ``bool`` tensor on the KV cache's device, True while the forward now running is
  a sampling step. The reporter writes it before each forward (``reporter.before_forward()``, one
  tiny device write, and none at all while the decision does not change: at interval 1 the flag
  stays True, at interval 20 it is written twice per 20 steps).
* ``due``: the same decision on the host, for eager forwards.

Each in-forward check (:mod:`otel_swa.device.read_check`, :mod:`otel_swa.device.write_check`, the
checksum writes of :mod:`otel_swa.device.provenance`) has one device path with fixed shapes and no
host read, and two ways to run it:

* **eager** (no capture under way): the check runs only at sampling steps (``due``), and counts
  in full;
* **recorded** (the current CUDA stream is capturing a graph, or :attr:`SamplingGate.force_recorded`
  is set, which tests on the CPU use to drive the graph's path): the check always runs, since the
  graph must hold it, and its effect at each replay is decided by ``flag``:

  - ``graph_mode="masked"`` (default): every count is multiplied by the flag (the first offender is
    kept only where the flag is set). Cost at every replayed step, sampled or not: the check's
    whole device work (about 15 - 40 small kernels per check; ``benchmarks/gpu_figures.py``
    measures it at three model shapes);
  - ``graph_mode="conditional"``: the check's kernels are captured into a CUDA graph conditional
    node (``CUDAGraph.begin_capture_to_if_node``, the mechanism of ``torch.cond`` under capture;
    CUDA 12.4 or later) that runs them only when the flag is set. Cost at a non-sampled replayed
    step: one conditional node. It falls back to ``masked`` where torch has no conditional nodes.

Either way a replayed sampled step is checked exactly as an eager one: the CPU tests drive the
recorded path with the flag set and unset and compare with eager counts; the ``gpu`` tests capture
and replay a graph (``tests/core/test_gpu_provenance.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["GRAPH_MODES", "SamplingGate", "masked"]

#: How a recorded check's effect is decided at each replay (module docstring).
GRAPH_MODES = ("masked", "conditional")


def masked(values: torch.Tensor, mask: "torch.Tensor | None") -> torch.Tensor:
    """``values`` where ``mask`` is set, else 0 (``mask``: the gate's 0-dim ``bool`` flag, or
    ``None`` on the eager path: ``values`` as they are, no device operation)."""
    return values if mask is None else values * mask


class SamplingGate:
    """The sampling flag on ``device`` and the choice of path (module docstring).

    Args:
        device: the KV cache's device.
        graph_mode: :data:`GRAPH_MODES`.

    Raises:
        ValueError: an unknown ``graph_mode``.
    """

    def __init__(self, device: "torch.device | str", *, graph_mode: str = GRAPH_MODES[0]) -> None:
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {graph_mode!r}")
        self.device = torch.device(device)
        self.graph_mode = graph_mode
        #: ``bool`` 0-dim on ``device``: the forward now running is a sampling step (read by recorded checks).
        self.flag = torch.zeros((), dtype=torch.bool, device=self.device)
        #: the same decision on the host (eager checks run only when it holds).
        self.due = False
        #: run every check on its recorded path even eagerly (tests; an engine that wants one path).
        self.force_recorded = False
        #: check calls made on the recorded path so far (host): > 0 once a graph holds a check.
        self.recorded_calls = 0
        self._written = False  # the value ``flag`` holds (the host's copy of it)
        self._cuda = self.device.type == "cuda"

    def set(self, due: bool) -> None:
        """Say whether the next forward is a sampling step: ``due`` on the host, and ``flag`` on the
        device when it changes (one ``fill_`` in stream order; nothing when it does not change).
        Never call it inside a capture (the write would be captured as a constant)."""
        due = bool(due)
        self.due = due
        if due != self._written:
            self.flag.fill_(due)
            self._written = due

    def capturing(self) -> bool:
        """Whether the current CUDA stream is capturing a graph now (never on the CPU): a tensor made
        now is the graph's temporary, not to be kept. Host work only."""
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def recording(self) -> bool:
        """Whether a check called now runs on the recorded path: the current CUDA stream is capturing
        a graph, or :attr:`force_recorded` is set. Host work only."""
        return self.force_recorded or (self._cuda and torch.cuda.is_current_stream_capturing())

    def wanted(self) -> bool:
        """Whether a check called now should run at all: a sampling step, or the recorded path."""
        return self.due or self.recording()

    @contextlib.contextmanager
    def region(self) -> Iterator["torch.Tensor | None"]:
        """The scope of one check's device work; yields the mask its counts take (:func:`masked`):
        ``None`` on the eager path and inside a conditional node, the flag on the masked path."""
        if not self.recording():
            yield None
            return
        self.recorded_calls += 1
        graph = None
        if self.graph_mode == "conditional" and self.capturing():
            current = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
            graph = current() if current is not None else None
            if graph is not None and not hasattr(graph, "begin_capture_to_if_node"):
                graph = None
        if graph is None:
            yield self.flag
            return
        graph.begin_capture_to_if_node(self.flag)
        try:
            yield None
        finally:
            graph.end_capture_to_conditional_node()
