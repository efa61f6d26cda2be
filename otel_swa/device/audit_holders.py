"""The SWA slot audit's part of the sample's core pass (the audit is fused into it: it takes its
holders from the slots the core gathered for the batch): a pass of the
:class:`~otel_swa.device.audit.SwaAuditSweep` staged into the sample's audit cells.

torch only; called by :func:`otel_swa.device.sample.stage_sample`.
"""

from __future__ import annotations

import torch

from otel_swa.device.audit import holder_slots

__all__ = ["stage_fused_audit"]


def stage_fused_audit(out, mapping, swa_audit, gathered, with_batch, sweep, ws) -> bool:
    """The SWA slot audit of this sample through ``sweep`` (:class:`~otel_swa.device.audit.SwaAuditSweep`):
    whether its cells were staged. The holders are read only when a pass begins here."""
    swa_slots = (swa_audit.num_swa_pages + 1) * swa_audit.page_size

    def holders():
        listed = swa_audit.holder_full_slots
        if callable(listed):
            listed = listed()
            if listed is None:  # not all holders can be had now: no pass begins
                return None
            if not isinstance(listed, torch.Tensor) or listed.dtype not in (torch.int32, torch.int64) or listed.dim() != 1:
                raise TypeError(f"swa_audit.holder_full_slots() must return a 1-D int32/int64 tensor, got {listed!r:.80}")
        return _audit_holders(mapping, listed, gathered if with_batch else None, with_batch, swa_slots, ws)

    return sweep.stage(out, holders, swa_audit.swa_free_page_ids, swa_audit.num_swa_pages,
                       swa_audit.page_size, ws)


def _audit_holders(mapping, listed, gathered, with_batch, swa_slots, ws) -> "tuple[torch.Tensor, torch.Tensor]":
    """The audit's holders as ``(keys, slot)`` (:func:`otel_swa.device.audit.holder_slots`). With
    ``holders_include_batch`` the batch's live tokens come first, their FULL and SWA slots the
    sample's own gathers (``gathered``: ``(full, swa, beyond)`` from the live or dense path,
    ``beyond`` the dense path's positions past ``seq_len``, or ``None`` without a live token), then
    the listed holders, gathered here. Runs after the counts and the window cells: the sample's
    SWA buffer is taken over (clamped in place).

    A FULL slot of the batch outside the mapping makes the sample itself invalid
    (``full_slot_out_of_range``, never delivered), so the batch part needs no per-token check."""
    parts = []
    if with_batch and gathered is not None:
        full, swa, beyond = gathered
        slot = swa if swa.dtype == torch.int64 else swa.long()
        slot.clamp_(0, swa_slots)
        if beyond is not None:
            slot.masked_fill_(beyond, 0)  # runs of whole rows' tails: the fill never branches wrong
        parts.append((full, slot))
    if listed.numel() or not parts:
        parts.append(holder_slots(mapping, listed, swa_slots, ws))
    # the FULL slots as int32 when the mapping's every index is one (always, in the engines): the
    # audit's tables of FULL slots then take half the bytes (a random scatter into a table larger
    # than the caches costs 2-3x less)
    narrow = torch.int32 if mapping.shape[0] <= 2**31 else torch.int64
    if len(parts) == 1:
        keys, slot = parts[0]
        if keys.dtype != narrow:
            keys = ws.get("audit.narrow_keys", keys.numel(), narrow).copy_(keys)
        return keys, slot
    n = parts[0][1].numel() + parts[1][1].numel()
    keys = torch.cat([parts[0][0].to(narrow), parts[1][0].to(narrow)], out=ws.get("audit.all_keys", n, narrow))
    slot = torch.cat([parts[0][1], parts[1][1]], out=ws.get("audit.all_slots", n, torch.int64))
    return keys, slot
