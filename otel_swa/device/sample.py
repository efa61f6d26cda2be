"""The sample computation: divergence and out-of-window counts over the live tokens of a batch.

torch only; runs on the view's device, on the current stream, with no host synchronisation.

Definitions (SGLang's SWA divergence reporter, sgl-project/sglang PR #26820): for every live token of
the batch — row ``req_to_token[req_pool_indices[i]]``, positions ``0 .. seq_lens[i] - 1`` — take its
FULL slot ``f`` and its SWA slot ``s = full_to_swa_index_mapping[f]``;

* divergence counts the tokens with ``s != 0 and s != f`` (the SWA allocator really remapped);
* out-of-window counts the tokens with ``s == 0`` (slot freed because the token left the window;
  slot 0 is the reserved "none").

A FULL slot outside ``[0, len(mapping))`` is counted as out-of-window rather than read
out of bounds, so a bad engine state can never fault the device.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from otel_swa.device.audit import AUDIT_WIDTH, audit_counts

__all__ = ["live_full_slots", "count_divergence", "stage_sample", "STAGE_WIDTH"]

#: Layout of one staged sample (all int64): verify_full, verify_swa, divergence, out_of_window,
#: then the audit counts of :func:`otel_swa.device.audit.audit_counts` (pages in use, pages
#: referenced, leaked pages, stale tokens, shared SWA slots), or ``-1`` there when not audited.
STAGE_WIDTH = 4 + AUDIT_WIDTH


def _host_lengths(seq_lens_cpu: "torch.Tensor | Sequence[int]") -> torch.Tensor:
    if isinstance(seq_lens_cpu, torch.Tensor):
        if seq_lens_cpu.device.type != "cpu":
            raise ValueError(f"seq_lens_cpu must be a host tensor, got one on {seq_lens_cpu.device}")
        return seq_lens_cpu.to(torch.int64)
    return torch.tensor(list(seq_lens_cpu), dtype=torch.int64)


def live_full_slots(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None,
    upload: "Callable[[torch.Tensor], torch.Tensor] | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FULL slots of the live tokens of a batch.

    Args:
        req_to_token: ``int32``/``int64`` ``[num_req_slots, max_context_len]``.
        req_pool_indices: ``int32``/``int64`` ``[batch]``.
        seq_lens: ``int32``/``int64`` ``[batch]`` on the same device.
        seq_lens_cpu: the same lengths known on the host, or ``None``.
        upload: how the host lengths reach the device (``int64 [batch]`` CPU tensor -> device
            tensor); default a plain ``.to(device)``, which on CUDA waits for the stream. The
            reporter passes its ring's pinned, non-blocking upload.

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
        lens_host = _host_lengths(seq_lens_cpu).clamp(0, width)
        total = int(lens_host.sum())
        lens = upload(lens_host) if upload is not None else lens_host.to(device)
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
    swa_audit: Any = None,
    upload: "Callable[[torch.Tensor], torch.Tensor] | None" = None,
) -> None:
    """Write one sample into ``out`` (``int64 [STAGE_WIDTH]`` on the device), in stream order.

    ``out`` receives ``totals[0]`` (verify_full), ``totals[1]`` (verify_swa), the divergence count,
    the out-of-window count and, when ``swa_audit`` (an ``otel_swa.views.SwaAuditInputs``) is
    given, the audit counts (else ``-1``). The tensors are read now, at the sampled forward step:
    later changes to them by the engine cannot leak into this sample.
    """
    slots, mask = live_full_slots(req_to_token, req_pool_indices, seq_lens, seq_lens_cpu, upload)
    divergence, out_of_window = count_divergence(slots, mask, full_to_swa_index_mapping)
    out[0:2].copy_(totals)
    out[2].copy_(divergence)
    out[3].copy_(out_of_window)
    if swa_audit is None:
        out[4:].fill_(-1)
    else:
        audit_counts(
            out[4:], full_to_swa_index_mapping, swa_audit.swa_free_page_ids, swa_audit.num_swa_pages,
            swa_audit.page_size, swa_audit.holder_full_slots,
        )
