"""The layout of one staged sample (:func:`otel_swa.device.sample.stage_sample`) and the helpers its
paths share: the upload of host values, ``req_to_token`` as one flat vector, and the commit of the
core cells.

torch and numpy only.
"""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np
import torch

from otel_swa.device.audit import AUDIT_WIDTH
from otel_swa.device.window import WINDOW_WIDTH
from otel_swa.device.workspace import Workspace

__all__ = ["STAGE_WIDTH", "FUSED_CELLS"]

# Layout of one staged sample (all int64).
_VERIFY = 0  # 0, 1: the device part of verify_full, verify_swa (host ints are added at delivery)
# 2 - 5: the counts of the gathered tokens, in the order the live path computes them (one run)
_NONZERO = 2  # gathered tokens with s != 0
_DIFFERENT = 3  # gathered tokens with s != f (divergence is read from it: see read_sample)
_FULL_NONZERO = 4  # gathered tokens with f != 0 (f clamped into the mapping)
_LENS = 5  # 5, 6: entries whose seq_lens != seq_lens_cpu (host lengths) | min, max of seq_lens
_LIVE = 7  # live tokens (dense path without host lengths; else the host knows)
_ROWS = 8  # 8, 9: min and max of req_pool_indices
_SLOTS = 10  # 10, 11: min and max of the live tokens' FULL slots
_FILLER_SWA = 12  # dense: mapping[_FILLER], the SWA slot of the filler the masked positions got
_SLOT0_SWA = 13  # mapping[0], the SWA slot of every gathered token at FULL slot 0
_AUDIT = 14
_WINDOW = _AUDIT + AUDIT_WIDTH  # the window cells of otel_swa.device.window (windowed samples only)
_LITTLE_ENDIAN = sys.byteorder == "little"  # host and devices alike (CUDA devices are little-endian)
_FILLER = 1  # FULL slot given to masked positions of the dense path
#: int64 values the sample's core pass stages: the counts, the fault evidence, then the audit counts
#: of :func:`otel_swa.device.audit.audit_counts` (pages in use, pages referenced, leaked pages,
#: stale tokens, shared SWA slots) and their first offenders, then the sliding-window cells of
#: :mod:`otel_swa.device.window` (in-window tokens with an SWA slot, late-held tokens, in-window
#: tokens, the first premature eviction). The audit and window cells are written only when the view
#: asks for them (else left as they are, never read). The other checks' cells follow in the ring's
#: row (:mod:`otel_swa.sampling`).
STAGE_WIDTH = _WINDOW + WINDOW_WIDTH

#: The cells of the checks fused into the core pass (:data:`otel_swa.checks.CHECKS` whose ``fused``
#: is set), by check name: the SWA slot audit's and the window check's.
FUSED_CELLS = {"slot_audit": slice(_AUDIT, _WINDOW), "window": slice(_WINDOW, _WINDOW + WINDOW_WIDTH)}


def _flat_rows(req_to_token: torch.Tensor) -> "tuple[torch.Tensor, int]":
    """``req_to_token`` as a 1-D view and the stride between its rows (a copy only when its
    positions are not contiguous within a row)."""
    if req_to_token.stride(1) != 1:
        req_to_token = req_to_token.contiguous()
    rows, width = req_to_token.shape
    row_stride = req_to_token.stride(0) if rows > 1 else width
    span = (rows - 1) * row_stride + width if rows else 0
    return req_to_token.as_strided((span,), (1,)), row_stride


def _upload(upload: "Callable[[np.ndarray], torch.Tensor] | None", array: np.ndarray, device: torch.device) -> torch.Tensor:
    if upload is not None:
        return upload(array)
    host = torch.from_numpy(array)
    return host if device.type == "cpu" else host.to(device)


def _commit(out: torch.Tensor, totals: torch.Tensor, fields: "dict[int, torch.Tensor]", ws: Workspace,
            end: int = _AUDIT) -> None:
    """Write ``totals`` and ``fields`` (layout position -> a 0-dim tensor, or a 1-D run of cells
    from that position on) into ``out[:end]`` in one ``cat``; positions not given get 0 (``end``
    beyond :data:`_AUDIT`: the audit cells too when not given, the audit writes its own later).
    Each part of a ``cat`` costs about as much as a small operation on the CPU: runs and the zeros
    between them are one part each."""
    parts = [totals]
    position = 2  # the first cell after the totals
    for start in sorted(fields):
        if start >= end:
            continue
        value = fields[start].reshape(-1)
        if start > position:
            parts.append(ws.zeros(start - position))
        parts.append(value)
        position = start + value.numel()
    if end > position:
        parts.append(ws.zeros(end - position))
    torch.cat(parts, out=out[:end])
