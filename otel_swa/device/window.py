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
  1``): the inclusive ``cumsum`` ``C`` of ``swa != 0`` with a leading 0, gathered at host-computed
  offsets ``end_i``, ``end_i - w_i``, ``start_i + o_i``, ``start_i``, summed per offset kind and
  subtracted; work proportional to the live tokens. The sample's own counts share that one
  ``cumsum``, gather, sum and subtraction (:mod:`otel_swa.device.sample_live`).
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

from otel_swa.checks.window import PREMATURE_CELLS, WINDOW_WIDTH
from otel_swa.device.workspace import Workspace

__all__ = [
    "WINDOW_WIDTH",
    "PREMATURE_CELLS",
    "stage_first_premature",
    "window_spans",
    "dense_columns",
    "device_columns",
    "stage_window_dense",
    "stage_window_empty",
    "host_allowance",
    "host_reach",
]




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


def stage_first_premature(
    out: torch.Tensor,
    in_window: torch.Tensor,
    in_window_held: torch.Tensor,
    starts_flat: torch.Tensor,
    starts_pos: torch.Tensor,
    swa: torch.Tensor,
    full: torch.Tensor,
    rows: torch.Tensor,
    span: int,
    ws: Workspace,
) -> None:
    """Write the first premature eviction (:data:`PREMATURE_CELLS`) into ``out`` (``int64 [4]``)
    (the live path's caller: :func:`otel_swa.device.sample_live.stage_live`).

    The first request whose in-window tokens are not all held (``in_window_held < in_window``),
    then the first of its in-window positions whose SWA slot is 0: a search of ``span`` cells (the
    longest window of the batch), not of the live tokens. About 15 small device operations, fixed
    shapes, no host sync.

    Args:
        in_window, in_window_held: ``int64 [batch]``: each request's in-window tokens ``w_i`` and
            those of them with an SWA slot.
        starts_flat: ``int64 [batch]``: the index in ``swa`` / ``full`` of each request's first
            in-window token; ``starts_pos``: its position in the request.
        swa, full: the gathered SWA and FULL slots (flat: the live tokens, or the whole rows).
        rows: ``int [batch]``: each request's ``req_to_token`` row.
        span: the largest ``w_i`` (host int).
        ws: the workspace.
    """
    entry = _first_true(in_window_held < in_window).reshape(1)
    base = starts_flat.index_select(0, entry)
    steps = ws.arange(max(span, 1))
    last = max(swa.numel() - 1, 0)
    index = torch.add(steps, base).clamp_(0, last)
    zero = torch.eq(swa.index_select(0, index), 0).logical_and_(steps < in_window.index_select(0, entry))
    at = _first_true(zero).reshape(1)
    where = torch.add(base, at).clamp_(0, last)
    torch.cat([entry, rows.index_select(0, entry).long(), starts_pos.index_select(0, entry) + at,
               full.index_select(0, where).long()], out=out)


def _no_premature(out: torch.Tensor, in_window: "int | torch.Tensor | None") -> bool:
    """Whether, on the CPU, the in-window tokens with an SWA slot (``out[0]``, just written) are all
    the in-window tokens (``in_window``: a host int, or a 0-dim CPU tensor): then there is no first
    premature eviction to look for (its cells are read only when one is counted). Host reads of
    CPU tensors: no device operation, no sync. ``False`` on other devices (there the search always
    runs: fixed shapes, no host sync)."""
    if out.device.type != "cpu" or in_window is None:
        return False
    total = in_window if isinstance(in_window, int) else int(in_window.numpy())
    return int(out[0:1].numpy()[0]) == total


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """0-dim ``int64``: the first index where the bool ``mask`` is True (0 when none or empty)."""
    if mask.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=mask.device)
    return torch.max(mask, 0).indices


def stage_window_dense(
    out: torch.Tensor,
    swa: torch.Tensor,
    shape: tuple[int, int],
    columns: torch.Tensor,
    weights: torch.Tensor,
    window_tokens: "torch.Tensor | None",
    ws: Workspace,
    full: "torch.Tensor | None" = None,
    rows: "torch.Tensor | None" = None,
    span: int = 0,
    known_window_tokens: "int | None" = None,
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
        full, rows, span: ``full`` the gathered rows' FULL slots (``[batch * width]``), ``rows``
            (``int [batch]``) their ``req_to_token`` rows, ``span`` the largest ``w_i`` (host int);
            the first premature eviction is staged when given (:func:`stage_first_premature`).
        known_window_tokens: ``sum(w_i)`` when the host knows it: on the CPU the first premature
            eviction is then looked for only when there is one.
    """
    batch, width = shape
    held = torch.ne(swa, 0, out=ws.get("window.held", batch * width, torch.bool)).view(batch, width)
    csum = torch.cumsum(held, 1, out=ws.get("window.rows", batch * width, torch.int64).view(batch, width))
    picked = torch.gather(csum, 1, columns, out=ws.get("window.picked", batch * 3, torch.int64).view(batch, 3))
    sums = picked.mul_(weights).sum(0)
    torch.sub(sums[0:1], sums[1:2], out=out[0:1])
    out[1:2].copy_(sums[2:3])
    out[2:3].copy_(window_tokens.reshape(1) if window_tokens is not None else ws.zeros(1))
    if full is not None and rows is not None and not _no_premature(out, window_tokens if window_tokens is not None
                                                                     else known_window_tokens):
        # a row's window starts at column len - w: col1 + weight1 (col1 = len - w - 1, or 0 with
        # weight 0 when the window reaches position 0); w = (col0 + weight0) - that
        starts = columns[:, 1] + weights[:, 1]
        in_window = columns[:, 0] + weights[:, 0] - starts
        flat = starts + ws.arange(batch) * width
        stage_first_premature(out[3:7], in_window, picked[:, 0] - picked[:, 1], flat, starts, swa, full, rows,
                              min(span, width), ws)


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
