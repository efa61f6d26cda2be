"""The sliding-window check of a sample: live tokens inside the window without an SWA slot
(premature eviction) and SWA slots still held by tokens well behind it (late eviction).

torch only; runs on the view's device, on the current stream, with no host synchronisation. Called
by :func:`otel_swa.device.sample.stage_sample` when the view gives its ``sliding_window``; without
one nothing here runs.

Definitions. ``window`` is the number of most recent positions attention reads, the current token
included: a request with ``seq_len`` live tokens reads positions ``seq_len - window .. seq_len -
1`` in the SWA layers. For every request ``i`` of the batch, with ``len_i`` live tokens and
eviction allowance ``a_i`` (tokens):

* ``w_i = min(len_i, window)`` positions are in the window: ``len_i - w_i .. len_i - 1``. Each of
  them must have an SWA slot (mapping != 0); one that has none was freed while attention still
  reads it, and the SWA layers read whatever the slot holds now (premature eviction, the bug class
  of sgl-project/sglang#29860). **premature** = the in-window tokens with mapping 0.
* ``o_i = max(0, len_i - window - a_i)`` positions are older than the window by more than the
  allowance: ``0 .. o_i - 1``. An SWA slot still held there is memory the window no longer needs
  (late eviction; many of them: runaway SWA usage). **late-held** = those tokens with mapping != 0.

Both counts are staged in three ``int64`` cells of the sample slot (see :data:`WINDOW_WIDTH`):
the in-window tokens that have an SWA slot, the late-held tokens and, on the dense path without
host lengths, the number of in-window tokens (``sum(w_i)``; otherwise the host knows it).
``premature = sum(w_i) - in-window tokens with a slot`` is taken on the host
(:func:`otel_swa.device.sample.read_sample`).

How they are computed:

* **live** (the flat vector of the live tokens' SWA slots, request ``i`` at ``start_i .. end_i -
  1``): the inclusive ``cumsum`` ``C`` of ``swa != 0`` with a leading 0, one gather of ``C`` at
  host-computed offsets ``end_i``, ``end_i - w_i``, ``start_i + o_i``, ``start_i``, one sum per
  offset kind and one subtraction: five device operations, work proportional to the live tokens.
* **dense** (``[batch, max_context_len]`` rows): the column index compared with per-row thresholds
  ``len_i - window`` and ``len_i - window - a_i`` (positions at or beyond ``len_i`` already masked).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from otel_swa.device.workspace import Workspace

__all__ = ["WINDOW_WIDTH", "window_spans", "stage_window_live", "stage_window_dense", "stage_window_empty"]

#: int64 cells a windowed sample stages: in-window tokens with an SWA slot, late-held tokens,
#: in-window tokens (dense path without host lengths only).
WINDOW_WIDTH = 3


def window_spans(lens: np.ndarray, window: int, allowance: "np.ndarray | int") -> tuple[np.ndarray, np.ndarray]:
    """Per request, the in-window positions ``w_i = min(len_i, window)`` and the positions older
    than the window plus the allowance ``o_i = max(0, len_i - window - a_i)`` (host ``int64``
    arrays, shape ``[batch]``; ``lens`` already clamped to ``[0, max_context_len]``)."""
    w = np.minimum(lens, window)
    o = np.maximum(lens - window - allowance, 0)
    return w, o


def stage_window_live(out: torch.Tensor, swa: torch.Tensor, offsets: torch.Tensor, live: int, ws: Workspace) -> None:
    """Live path: write [in-window tokens with a slot, late-held tokens] into ``out[0:2]``.

    Args:
        out: the slot's window cells (``int64 [WINDOW_WIDTH]`` on the device).
        swa: ``[live]`` SWA slots of the live tokens, request after request.
        offsets: ``int64 [4, batch]`` on the device: ``end_i``, ``end_i - w_i``, ``start_i + o_i``,
            ``start_i`` (indices into the cumsum with its leading 0).
        live: the number of live tokens.
        ws: the workspace.
    """
    csum = ws.kept("window.csum", live + 1, torch.int64, fill=0)  # [0] stays 0: only [1:] is written
    nonzero = torch.ne(swa, 0, out=ws.get("window.nonzero", live, torch.bool))
    torch.cumsum(nonzero, 0, out=csum[1:])
    batch = offsets.shape[1]
    gathered = torch.index_select(csum, 0, offsets.reshape(-1), out=ws.get("window.gathered", 4 * batch, torch.int64))
    sums = gathered.view(4, batch).sum(1)
    torch.sub(sums[0::2], sums[1::2], out=out[0:2])


def stage_window_dense(
    out: torch.Tensor,
    swa: torch.Tensor,
    beyond: torch.Tensor,
    lower: torch.Tensor,
    older: torch.Tensor,
    window_tokens: "torch.Tensor | None",
    ws: Workspace,
) -> None:
    """Dense path: write the window cells from whole rows.

    Args:
        out: the slot's window cells (``int64 [WINDOW_WIDTH]``).
        swa: ``[batch * width]`` SWA slots of the gathered rows.
        beyond: ``bool [batch, width]``, the positions at or beyond each ``seq_len`` (not counted).
        lower: ``[batch]`` first in-window position of each row (``len_i - window``, may be < 0).
        older: ``[batch]`` end of each row's late-held range (``len_i - window - a_i``, may be < 0).
        window_tokens: 0-dim ``sum(w_i)`` when the host does not know it, else ``None``.
        ws: the workspace.
    """
    batch, width = beyond.shape
    columns = ws.arange(width, lower.dtype)
    held = torch.ne(swa, 0, out=ws.get("window.held", batch * width, torch.bool)).view(batch, width)
    held.masked_fill_(beyond, False)
    in_window = torch.ge(columns, lower.unsqueeze(1), out=ws.get("window.in", batch * width, torch.bool).view(batch, width))
    in_window.logical_and_(held)
    late = torch.lt(columns, older.unsqueeze(1), out=ws.get("window.late", batch * width, torch.bool).view(batch, width))
    late.logical_and_(held)
    parts = [torch.count_nonzero(in_window), torch.count_nonzero(late)]
    parts.append(window_tokens if window_tokens is not None else ws.zeros(1).reshape(()))
    torch.stack(parts, out=out)


def stage_window_empty(out: torch.Tensor) -> None:
    """No live token: nothing in the window, nothing held."""
    out.zero_()


def host_allowance(allowance: "int | Sequence[int] | torch.Tensor", batch: int) -> "np.ndarray | int":
    """``allowance`` as an int or a host ``int64 [batch]`` array (already validated by the view)."""
    if isinstance(allowance, int):
        return allowance
    if isinstance(allowance, torch.Tensor):
        return allowance.detach().reshape(-1).to(torch.int64).numpy()
    return np.asarray(list(allowance), dtype=np.int64).reshape(batch)
