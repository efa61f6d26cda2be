"""The sliding-window check of a sample: live tokens inside the window without an SWA slot
(premature eviction) and SWA slots still held by tokens well behind it (late eviction).

torch only; runs on the view's device, on the current stream, with no host synchronisation. Called
by :func:`otel_swa.device.sample.stage_sample` when the view gives its ``sliding_window``; without
one nothing here runs.

Definitions. ``window`` is the number of most recent positions one query reads, the current one
included: a query at position ``q`` reads ``q - window + 1 .. q`` in the SWA layers. A forward step
computes the last ``e_i`` positions of request ``i`` (its new tokens: ``e_i = 1`` in a decode step,
the chunk's length in an extend, i.e. prefill or chunked-prefill, step); its first query, at ``len_i -
e_i``, reads from ``len_i - e_i - window + 1``, so the step reads the last ``r_i = window + e_i - 1``
positions (the reach). For every request ``i`` of the batch, with ``len_i`` live tokens and eviction
allowance ``a_i`` (tokens):

* ``w_i = min(len_i, r_i)`` positions are in the window: ``len_i - w_i .. len_i - 1``. Each of
  them must have an SWA slot (mapping != 0); one that has none was freed while attention still
  reads it, and the SWA layers read whatever the slot holds now (premature eviction, the bug class
  of sgl-project/sglang#29860; in a chunked prefill, the previous chunk's tail freed before this
  chunk's first queries read it: sgl-project/sglang#8649, #23982). **premature** = the in-window
  tokens with mapping 0.
* ``o_i = max(0, len_i - r_i - a_i)`` positions are older than the window by more than the
  allowance: ``0 .. o_i - 1``. An SWA slot still held there is memory the window no longer needs
  (late eviction; many of them: runaway SWA usage). **late-held** = those tokens with mapping != 0.

Without extend lengths every ``e_i`` is 1 (``r_i = window``).

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
* **dense** (``[batch, max_context_len]`` rows): the row-wise inclusive ``cumsum`` ``R`` of ``swa !=
  0``, gathered at three columns per row, ``len_i - 1``, ``len_i - w_i - 1`` and ``o_i - 1``
  (a column below 0 stands for 0: its weight is 0), weighted, summed per column, the first two
  subtracted: two passes over the rows (positions at or beyond ``len_i`` are never read, so the
  masked ones need no care); the columns and weights come from the host with the sample's one
  upload, or from ``seq_lens`` on the device (then the per-request reaches and allowances, when
  not one int, come with the sample's one upload).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from otel_swa.device.workspace import Workspace

__all__ = [
    "WINDOW_WIDTH",
    "window_spans",
    "dense_columns",
    "device_columns",
    "stage_window_live",
    "stage_window_dense",
    "stage_window_empty",
    "host_allowance",
    "host_reach",
]

#: int64 cells a windowed sample stages: in-window tokens with an SWA slot, late-held tokens,
#: in-window tokens (dense path without host lengths only).
WINDOW_WIDTH = 3


def window_spans(lens: np.ndarray, reach: "np.ndarray | int", allowance: "np.ndarray | int") -> tuple[np.ndarray, np.ndarray]:
    """Per request, the in-window positions ``w_i = min(len_i, r_i)`` and the positions older
    than the reach plus the allowance ``o_i = max(0, len_i - r_i - a_i)`` (host ``int64`` arrays,
    shape ``[batch]``; ``lens`` already clamped to ``[0, max_context_len]``; ``reach`` from
    :func:`host_reach`)."""
    w = np.minimum(lens, reach)
    o = np.maximum(lens - reach - allowance, 0)
    return w, o


def dense_columns(lens: np.ndarray, reach: "np.ndarray | int", allowance: "np.ndarray | int") -> np.ndarray:
    """Host ``int64 [6, batch]``: the three cumsum columns of each row (clamped to >= 0) and their
    weights (1, or 0 where the column is below 0: a count of nothing) for :func:`stage_window_dense`."""
    w, o = window_spans(lens, reach, allowance)
    columns = np.stack([lens - 1, lens - w - 1, o - 1])
    out = np.empty((6, lens.shape[0]), dtype=np.int64)
    np.maximum(columns, 0, out=out[:3])
    out[3:] = columns >= 0
    return out


def device_columns(
    lens: torch.Tensor, reach: "torch.Tensor | int", allowance: "torch.Tensor | int"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dense_columns` on the device from ``lens`` (``int64 [batch]``, clamped to ``[0,
    width]``; ``reach`` and ``allowance`` ints or ``int64 [batch]`` on the device):
    ``(columns [batch, 3], weights [batch, 3], sum(w_i) as a 0-dim tensor)``."""
    in_window = torch.clamp(lens, max=reach) if isinstance(reach, int) else torch.minimum(lens, reach)
    older = torch.clamp(lens - reach - allowance, min=0)
    columns = torch.stack([lens, lens - in_window, older], 1).sub_(1)
    weights = columns.ge(0)
    return columns.clamp_(min=0), weights, in_window.sum()


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
    shape: tuple[int, int],
    columns: torch.Tensor,
    weights: torch.Tensor,
    window_tokens: "torch.Tensor | None",
    ws: Workspace,
) -> None:
    """Dense path: write the window cells from whole rows.

    Args:
        out: the slot's window cells (``int64 [WINDOW_WIDTH]``).
        swa: ``[batch * width]`` SWA slots of the gathered rows (any value beyond a row's length).
        shape: ``(batch, width)``.
        columns: ``int64 [batch, 3]`` (strided views allowed), see :func:`dense_columns`.
        weights: ``[batch, 3]`` 0/1 (``int64`` or ``bool``), the same.
        window_tokens: 0-dim ``sum(w_i)`` when the host does not know it, else ``None``.
        ws: the workspace.
    """
    batch, width = shape
    held = torch.ne(swa, 0, out=ws.get("window.held", batch * width, torch.bool)).view(batch, width)
    csum = torch.cumsum(held, 1, out=ws.get("window.rows", batch * width, torch.int64).view(batch, width))
    picked = torch.gather(csum, 1, columns, out=ws.get("window.picked", batch * 3, torch.int64).view(batch, 3))
    sums = picked.mul_(weights).sum(0)
    torch.sub(sums[0:1], sums[1:2], out=out[0:1])
    out[1:2].copy_(sums[2:3])
    out[2:3].copy_(window_tokens.reshape(1) if window_tokens is not None else ws.zeros(1))


def stage_window_empty(out: torch.Tensor) -> None:
    """No live token: nothing in the window, nothing held."""
    out.zero_()


def host_reach(window: int, extend_lens: "int | Sequence[int] | torch.Tensor | None", batch: int) -> "np.ndarray | int":
    """The positions each request's queries read in this step, ``r_i = window + e_i - 1``: an int
    when ``extend_lens`` is ``None`` (every ``e_i = 1``: ``window``) or an int, else a host
    ``int64 [batch]`` array (``extend_lens`` already validated by the view: ints >= 1 on the host)."""
    if extend_lens is None:
        return window
    if isinstance(extend_lens, int):
        return window + extend_lens - 1
    return host_allowance(extend_lens, batch) + (window - 1)


def host_allowance(allowance: "int | Sequence[int] | torch.Tensor", batch: int) -> "np.ndarray | int":
    """``allowance`` as an int or a host ``int64 [batch]`` array (already validated by the view)."""
    if isinstance(allowance, int):
        return allowance
    if isinstance(allowance, torch.Tensor):
        return allowance.detach().reshape(-1).to(torch.int64).numpy()
    return np.asarray(list(allowance), dtype=np.int64).reshape(batch)
