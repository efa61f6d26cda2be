"""The live path of a sample (:func:`otel_swa.device.sample.stage_sample`): work proportional to
the live tokens, whose flat ``req_to_token`` index the host's lengths give.

torch and numpy only; no host synchronisation on a GPU.

Device operations (the reporter's sampled step on the SGLang path is counted by
``benchmarks/bench_sample_ops.py``):

* the flat index of every live token: one ``cumsum`` over a buffer of ones with each request's
  jump written at its first token (``int32`` when ``req_to_token`` has fewer than 2**31 cells:
  half the bytes of every pass), three operations;
* the FULL slots gathered (and their range), clamped into the mapping while widened into its dtype
  (on the CPU, where the range is read without a sync, only widened when every slot is in the
  mapping), and their SWA slots gathered: rows 1 and 2 of a buffer ``[0, s, f, 0]`` whose rows 0
  and 3 are zeros, so that **one** comparison of its rows 0..2 with its rows 1..3 gives ``s != 0``,
  ``s != f`` and ``f != 0`` at once;
* one comparison of the host lengths with ``seq_lens``;
* the counts from **one** inclusive ``cumsum`` ``C`` (``int32`` where it fits; a leading 0) over
  those masks laid end to end: a count of a segment ``[a, b)`` is ``C[b] - C[a]``, and the sliding
  window's per-request counts are differences of ``C`` at host offsets into the first segment
  (:mod:`otel_swa.device.window`). One gather of ``C`` at a host table ``[2, K, batch]`` (the
  offsets added and subtracted for each of the ``K`` counts, padded with offset 0, where ``C`` is
  0), one sum over the batch and one subtraction give the ``K`` counts; the table rides in the
  sample's one upload. Above :data:`TALLY_ALL_MAX` live tokens the cumsum covers ``s != 0`` only,
  and ``s != f``, ``f != 0`` and the lengths compared are each counted flat (three operations more,
  and less work than a cumsum over them);
* the core cells, the window's two counts and the audit's cells written by one ``cat``
  (:func:`otel_swa.device.sample_cells._commit`, after the audit), in runs of cells.
"""

from __future__ import annotations

import numpy as np
import torch

from otel_swa.device.sample_cells import (
    _AUDIT, _DIFFERENT, _FULL_NONZERO, _LENS, _LITTLE_ENDIAN, _NONZERO, _ROWS, _SLOT0_SWA, _SLOTS, _WINDOW,
    _flat_rows, _upload,
)
from otel_swa.device.window import stage_first_premature

__all__ = ["TALLY_ALL_MAX", "stage_live"]

# The counts of the live path, in the order of the host table's rows (window counts first when
# windowed): their cells in the staged slot.
_WINDOW_COUNTS = (_WINDOW, _WINDOW + 1)  # in-window tokens with an SWA slot, late-held tokens
_COUNTS = (_NONZERO, _DIFFERENT, _FULL_NONZERO, _LENS)  # consecutive cells: one part of the commit's cat
#: Live tokens up to which the masks ``s != f`` and ``f != 0`` and the lengths compared are counted by
#: the one cumsum with ``s != 0`` (fewer operations); above, each by a flat ``count_nonzero`` (three
#: operations more, and less work than a cumsum over them: measured on 2 CPU cores, 1 torch thread,
#: ``BENCHMARKS.md`` section 18).
TALLY_ALL_MAX = 1 << 12


def stage_live(out, totals, req_to_token, mapping, rows, host_rows, seq_lens, lens, given, live, upload, ws,
               spans=None, cells=None):
    """Stage the live path's work for ``out`` (``int64 [STAGE_WIDTH]``) and return ``((full, swa,
    None), fields, end)``: the live tokens' FULL slots (clamped into the mapping, in its dtype) and
    SWA slots, ``[live]`` each, as the audit takes them; the cells to commit (layout position ->
    0-dim or 1-element tensor) and the end of the cells the commit writes (:func:`_commit`, which
    the caller runs once the audit has given its cells). The first premature eviction is written
    into ``cells[3:7]`` here.

    ``lens`` (``int64 [batch]``, clamped), ``given`` (as given) and ``host_rows`` (``None`` when
    the rows are not known on the host) are host arrays; ``live = sum(lens) >= 1``. With
    ``spans`` (the window's ``(w, o)`` per request, :func:`otel_swa.device.window.window_spans`)
    the window cells ``cells`` (``out``'s) too."""
    batch = lens.shape[0]
    num_rows = req_to_token.shape[0]
    size = mapping.shape[0]
    flat, row_stride = _flat_rows(req_to_token)
    windowed = spans is not None
    # the masks s != f, f != 0 and the lengths' counted in the one cumsum (few live tokens: fewer
    # operations) or each by a flat count (many: a cumsum over them costs more than the counts)
    tallied = live <= TALLY_ALL_MAX
    counts = (_WINDOW_COUNTS if windowed else ()) + (_COUNTS if tallied else _COUNTS[:1])
    k = len(counts)
    # Token t of request i has flat index row_stride * row_i + (t - start_i): a run of +1 steps
    # with a jump at each start, jump_i = row_stride * (row_i - row_{i-1}) - len_{i-1} (row_{-1} = 0
    # and len_{-1} = 1 make the first jump land on row_0's first slot). Requests of length 0 share a
    # start with the next one: their jumps add up (accumulate) to the right one, and the jumps of
    # trailing empty requests land in a spare last cell.
    ends = np.cumsum(lens)
    host = np.zeros((3 + 2 * k, batch), dtype=np.int64)
    starts = host[0]
    starts[1:] = ends[:-1]
    host[1, 0] = -1
    host[1, 1:] = -lens[:-1]
    if host_rows is not None:  # the whole jump on the host
        host[1, 0] += row_stride * host_rows[0]
        host[1, 1:] += row_stride * np.diff(host_rows)
    host[2] = given  # as given: compared with the device's seq_lens
    # The offsets into C (masks: s != 0, s != f, f != 0, ``live`` each, then the lengths compared,
    # ``batch``), added (plus) and subtracted (minus), per count (the others are 0: C[0] = 0).
    plus, minus = host[3:3 + k], host[3 + k:]
    if windowed:  # the window's offsets into the first mask: see otel_swa.device.window
        plus[0], minus[0] = ends, ends - spans[0]
        plus[1], minus[1] = starts + spans[1], starts
    base = len(_WINDOW_COUNTS) if windowed else 0
    plus[base, 0] = live  # s != 0
    if tallied:
        plus[base + 1, 0], minus[base + 1, 0] = 2 * live, live  # s != f
        plus[base + 2, 0], minus[base + 2, 0] = 3 * live, 2 * live  # f != 0
        plus[base + 3, 0], minus[base + 3, 0] = 3 * live + batch, 3 * live  # the lengths
    up = _upload(upload, host, out.device)

    # The flat index in int32 when every cell of req_to_token has an int32 index (each partial
    # sum of the cumsum is one: a live token's cell); else int64.
    narrow = flat.numel() < 2**31
    dtype = torch.int32 if narrow else torch.int64
    fields: dict[int, torch.Tensor] = {}
    if host_rows is None:
        fields[_ROWS], fields[_ROWS + 1] = torch.aminmax(rows)
        rows_ext = ws.kept("live.rows", batch + 1, rows.dtype, fill=0)  # [0] stays 0: only [1:] is written
        torch.clamp(rows, 0, num_rows - 1, out=rows_ext[1:])
        jumps = torch.add(up[1], torch.sub(rows_ext[1:], rows_ext[:-1]), alpha=row_stride,
                          out=ws.get("live.jumps", batch, dtype))
    elif narrow and _LITTLE_ENDIAN:
        # Every jump lies within +-2**31 (it is a difference of two cells' indices): the low 32-bit
        # word of each int64 is the jump as int32, a view of the upload (no device operation).
        jumps = up[1].view(torch.int32)[0::2]
    else:
        jumps = up[1].to(dtype)
    steps = ws.get("live.steps", live + 1, dtype)
    steps.fill_(1)
    steps.scatter_add_(0, up[0], jumps)
    index = torch.cumsum(steps[:live], 0, out=ws.get("live.index", live, dtype))

    raw = torch.index_select(flat, 0, index, out=ws.get("count.raw", live, flat.dtype))
    # The range in the rows' dtype (int32 in the engines: half the bytes), then the clamp and the
    # widening into the mapping's dtype (a mixed-dtype comparison is several times slower than a
    # copy and a same-dtype one).
    fields[_SLOTS], fields[_SLOTS + 1] = low, high = torch.aminmax(raw)
    # rows 0 and 3 of the slots' buffer stay zeros (a kept buffer per power-of-two capacity, made
    # filled with zeros): rows 1 and 2 are written for the first `live` columns
    capacity = 1 << max(live - 1, 0).bit_length()
    slots = ws.kept(f"live.slots.{capacity}", 4 * capacity, mapping.dtype, fill=0).view(4, capacity)[:, :live]
    swa, full = slots[1], slots[2]
    if out.device.type == "cpu" and int(low.numpy()) >= 0 and int(high.numpy()) < size:
        full.copy_(raw)  # (host reads of CPU tensors: no sync) every FULL slot is in the mapping
    else:
        full.copy_(raw.clamp_(0, size - 1))
    torch.index_select(mapping, 0, full, out=swa)
    masks = ws.get("live.masks", 3 * live + batch, torch.bool)
    rows3 = masks[:3 * live].view(3, live)
    torch.ne(slots[0:3], slots[1:4], out=rows3)  # s != 0, s != f, f != 0
    lens_differ = torch.ne(up[2], seq_lens, out=masks[3 * live:])
    # the cumsum in int32 when its every partial sum is one (on the CPU several times faster than
    # int64: half the bytes written); the sums over the batch in int64
    span = 3 * live + batch if tallied else live
    wide = torch.int32 if span < 2**31 else torch.int64
    csum = ws.kept("live.csum", span + 1, wide, fill=0)  # [0] stays 0: only [1:] is written
    torch.cumsum(masks[:span], 0, out=csum[1:])
    picked = torch.index_select(csum, 0, up[3:].reshape(-1), out=ws.get("live.picked", 2 * k * batch, wide))
    sums = picked.view(2, k, batch).sum(2, dtype=torch.int64)
    counted = torch.sub(sums[0], sums[1], out=ws.get("live.counted", k, torch.int64))
    if not tallied:
        fields[_DIFFERENT], fields[_FULL_NONZERO] = torch.count_nonzero(rows3[1]), torch.count_nonzero(rows3[2])
        fields[_LENS] = torch.count_nonzero(lens_differ)
    if windowed:
        fields[_WINDOW] = counted[:2]  # in-window tokens with an SWA slot, late-held tokens
    fields[_NONZERO] = counted[base:]  # s != 0 (with all of them tallied: s != f, f != 0, the lengths)
    fields[_SLOT0_SWA] = mapping[0]
    if windowed:
        # on the CPU (a host read: no sync) the first premature eviction is looked for only when
        # there is one; on other devices always (fixed shapes, no host sync)
        window_tokens = int(spans[0].sum())
        if out.device.type != "cpu" or int(counted[0].numpy()) != window_tokens:
            per_request = picked.view(2, k, batch)
            in_window = up[3] - up[3 + k]
            stage_first_premature(cells[3:7], in_window, per_request[0, 0] - per_request[1, 0], up[3 + k],
                                  up[3 + k] - up[4 + k], swa, full, rows, int(spans[0].max()), ws)
    return (full, swa, None), fields, _WINDOW + 2 if windowed else _AUDIT
