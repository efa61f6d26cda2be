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
_DIFFERENT = 2  # gathered tokens with s != f (divergence is read from it: see read_sample)
_NONZERO = 3  # gathered tokens with s != 0
_LIVE = 4  # live tokens (dense path without host lengths; else the host knows)
_ROWS = 5  # 5, 6: min and max of req_pool_indices
_SLOTS = 7  # 7, 8: min and max of the live tokens' FULL slots
_LENS = 9  # 9, 10: entries whose seq_lens != seq_lens_cpu (host lengths) | min, max of seq_lens
_FILLER_SWA = 11  # dense: mapping[_FILLER], the SWA slot of the filler the masked positions got
_FULL_NONZERO = 12  # gathered tokens with f != 0 (f clamped into the mapping)
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


def _commit(out: torch.Tensor, totals: torch.Tensor, fields: dict[int, torch.Tensor], ws: Workspace,
            end: int = _AUDIT) -> None:
    """Write ``totals`` and ``fields`` (layout position -> 0-dim or 1-element tensor) into
    ``out[:end]`` in one ``cat``; positions not given get 0 (``end`` beyond :data:`_AUDIT`: the
    audit cells get 0 too, the audit writes its own later)."""
    zero = ws.zeros(1)
    parts = [totals]
    for position in range(_DIFFERENT, end):
        value = fields.get(position)
        parts.append(zero if value is None else value.reshape(1))
    torch.cat(parts, out=out[:end])
