"""The sample computation: divergence and out-of-window counts over the live tokens of a batch.

torch only; runs on the view's device, on the current stream, with no host synchronisation.

Definitions (SGLang's SWA divergence reporter, sgl-project/sglang PR #26820): for every live token of
the batch — row ``req_to_token[req_pool_indices[i]]``, positions ``0 .. seq_lens[i] - 1`` — take its
FULL slot ``f`` and its SWA slot ``s = full_to_swa_index_mapping[f]``;

* divergence counts the tokens with ``s != 0 and s != f`` (the SWA allocator really remapped);
* out-of-window counts the tokens with ``s == 0`` (slot freed because the token left the window;
  slot 0 is the reserved "none").

A FULL slot outside ``[0, len(mapping))`` (a corrupt row) is counted as out-of-window rather than read
out of bounds, so a bad engine state can never fault the device.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["live_full_slots", "count_divergence", "stage_sample", "STAGE_WIDTH"]

#: Layout of one staged sample: verify_full, verify_swa, divergence, out_of_window (all int64).
STAGE_WIDTH = 4


def _host_total(seq_lens_cpu: "torch.Tensor | Sequence[int]") -> int:
    if isinstance(seq_lens_cpu, torch.Tensor):
        if seq_lens_cpu.device.type != "cpu":
            raise ValueError(f"seq_lens_cpu must be a host tensor, got one on {seq_lens_cpu.device}")
        return int(seq_lens_cpu.sum())
    return int(sum(seq_lens_cpu))


def live_full_slots(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The FULL slots of the live tokens of a batch.

    Args:
        req_to_token: ``int32``/``int64`` ``[num_req_slots, max_context_len]``.
        req_pool_indices: ``int32``/``int64`` ``[batch]``.
        seq_lens: ``int32``/``int64`` ``[batch]`` on the same device.
        seq_lens_cpu: the same lengths known on the host, or ``None``.

    Returns:
        ``(slots, mask)``. With ``seq_lens_cpu``: ``slots`` is ``int64 [sum(seq_lens)]`` holding
        exactly the live tokens and ``mask`` is ``None`` (work proportional to live tokens). Without
        it: ``slots`` is ``int64 [batch, max_context_len]`` and ``mask`` the ``bool`` tensor of the
        same shape selecting live positions (a dense masked gather; still no host sync).
    """
    rows = req_pool_indices.long()
    if seq_lens_cpu is not None:
        total = _host_total(seq_lens_cpu)
        lens = seq_lens.long()
        if total == 0:
            return torch.zeros(0, dtype=torch.int64, device=req_to_token.device), None
        # Token t of the flattened batch belongs to request i = token_req[t] at position
        # t - start[i]; output_size keeps repeat_interleave free of a device-to-host sync.
        token_req = torch.repeat_interleave(rows, lens, output_size=total)
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(total, device=lens.device) - torch.repeat_interleave(starts, lens, output_size=total)
        return req_to_token[token_req, positions].long(), None
    width = req_to_token.shape[1]
    slots = req_to_token.index_select(0, rows).long()
    mask = torch.arange(width, device=req_to_token.device).unsqueeze(0) < seq_lens.long().unsqueeze(1)
    return slots, mask


def count_divergence(
    full_slots: torch.Tensor, mask: torch.Tensor | None, full_to_swa_index_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Divergence and out-of-window counts (0-dim ``int64`` device tensors) for ``full_slots``.

    ``mask`` (same shape, ``bool``) selects the tokens to count; ``None`` counts all.
    """
    size = full_to_swa_index_mapping.shape[0]
    in_range = (full_slots >= 0) & (full_slots < size)
    flat = torch.where(in_range, full_slots, 0).reshape(-1)
    swa = full_to_swa_index_mapping.index_select(0, flat).reshape(full_slots.shape)
    # An out-of-range FULL slot is counted as out of window, whatever mapping[0] holds.
    evicted = (swa == 0) | ~in_range
    remapped = ~evicted & (swa != full_slots)
    if mask is not None:
        evicted &= mask
        remapped &= mask
    return remapped.sum(), evicted.sum()


def stage_sample(
    out: torch.Tensor,
    totals: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None,
) -> None:
    """Write one sample into ``out`` (``int64 [STAGE_WIDTH]`` on the device), in stream order.

    ``out`` receives ``totals[0]`` (verify_full), ``totals[1]`` (verify_swa), the divergence count and
    the out-of-window count. The batch tensors are read now, at the sampled forward step: later
    changes to them by the engine cannot leak into this sample.
    """
    slots, mask = live_full_slots(req_to_token, req_pool_indices, seq_lens, seq_lens_cpu)
    divergence, out_of_window = count_divergence(slots, mask, full_to_swa_index_mapping)
    out[0:2].copy_(totals)
    out[2].copy_(divergence)
    out[3].copy_(out_of_window)
