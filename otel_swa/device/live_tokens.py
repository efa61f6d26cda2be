"""The live tokens of a batch on the host and on the device: the host lengths (``seq_lens_cpu``) as
numpy, and the FULL slots of the live tokens with the divergence and out-of-window counts over them
(helpers for host-side checks such as :func:`otel_swa.views.sglang.audit_sglang_swa_slots`; the
reporter's sample computes the same counts in fewer device passes,
:func:`otel_swa.device.sample.stage_sample`).

torch and numpy only.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["host_lengths", "live_full_slots", "count_divergence"]


def host_lengths(seq_lens_cpu: "torch.Tensor | Sequence[int]") -> np.ndarray:
    """``seq_lens_cpu`` as an ``int64`` numpy array (a view of a CPU ``int64`` tensor: no copy).

    Raises:
        ValueError: a tensor on another device than the CPU, or values that are not integers.
        TypeError: an entry is not a number.
    """
    if isinstance(seq_lens_cpu, torch.Tensor):
        if seq_lens_cpu.device.type != "cpu":
            raise ValueError(f"seq_lens_cpu must be a host tensor, got one on {seq_lens_cpu.device}")
        if seq_lens_cpu.dtype.is_floating_point or seq_lens_cpu.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(f"seq_lens_cpu must hold integers, got dtype {seq_lens_cpu.dtype}")
        return seq_lens_cpu.detach().reshape(-1).to(torch.int64).numpy()
    values = np.asarray(seq_lens_cpu if isinstance(seq_lens_cpu, (list, tuple, np.ndarray)) else list(seq_lens_cpu))
    if values.size == 0:
        return np.zeros(0, dtype=np.int64)
    if values.dtype.kind not in "iu":
        raise ValueError(f"seq_lens_cpu must hold integers, got {values.dtype} values such as {values.reshape(-1)[0]!r}")
    return values.astype(np.int64, copy=False).reshape(-1)



def live_full_slots(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None,
    upload: "Callable[[torch.Tensor], torch.Tensor] | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FULL slots of the live tokens of a batch (a helper for host-side checks such as
    :func:`otel_swa.views.sglang.audit_sglang_swa_slots`; the reporter's sample uses
    :func:`stage_sample`, which needs fewer device passes).

    Args:
        req_to_token: ``int32``/``int64`` ``[num_req_slots, max_context_len]``.
        req_pool_indices: ``int32``/``int64`` ``[batch]``.
        seq_lens: ``int32``/``int64`` ``[batch]`` on the same device.
        seq_lens_cpu: the same lengths known on the host, or ``None``.
        upload: how the host lengths reach the device (``int64 [batch]`` numpy array -> device
            tensor); default a plain ``.to(device)``, which on CUDA waits for the stream.

    Returns:
        ``(slots, mask)``, both of one shape, ``slots`` ``int64`` and ``mask`` ``bool`` (the tokens
        to count). With ``seq_lens_cpu`` the shape is ``[sum(seq_lens_cpu)]``: exactly the live
        tokens, work proportional to them; the host lengths are then the authoritative ones (they
        size the gather) and ``seq_lens`` is not read. Without it the shape is ``[batch,
        max_context_len]``: a dense masked gather, still with no host sync.

    Lengths are clamped to ``[0, max_context_len]`` and a row index outside ``req_to_token`` selects
    no token, so a corrupt batch can never make the device read out of bounds.
    """
    num_rows, width = req_to_token.shape
    device = req_to_token.device
    rows = req_pool_indices.long()
    valid_row = (rows >= 0) & (rows < num_rows)
    rows = torch.where(valid_row, rows, 0)
    if seq_lens_cpu is not None:
        lens_host = torch.from_numpy(host_lengths(seq_lens_cpu)).clamp(0, width)
        total = int(lens_host.sum())
        lens = upload(lens_host.numpy()) if upload is not None else lens_host.to(device)
        # Token t of the flattened batch belongs to batch entry i = owner[t], at position
        # t - start[i]; output_size keeps repeat_interleave free of a device-to-host sync, and it
        # equals the sum of `lens` by construction.
        owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens, output_size=total)
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(total, device=device) - starts.index_select(0, owner)
        slots = req_to_token[rows.index_select(0, owner), positions].long()
        return slots, valid_row.index_select(0, owner)
    lens = torch.where(valid_row, seq_lens.long().clamp(0, width), 0)
    slots = req_to_token.index_select(0, rows).long()
    mask = torch.arange(width, device=device).unsqueeze(0) < lens.unsqueeze(1)
    return slots, mask


def count_divergence(
    full_slots: torch.Tensor, mask: torch.Tensor | None, full_to_swa_index_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Divergence and out-of-window counts (0-dim ``int64`` device tensors) for ``full_slots``.

    ``mask`` (same shape, ``bool``) selects the tokens to count; ``None`` counts all. A FULL slot
    outside the mapping is counted as out of window (never read out of bounds).
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
