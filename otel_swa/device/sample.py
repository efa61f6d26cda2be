"""The sample computation: divergence and out-of-window counts over the live tokens of a batch.

torch only; runs on the view's device, on the current stream, with no host synchronisation.

Definitions (SGLang's SWA divergence reporter, sgl-project/sglang PR #26820): for every live token of
the batch — row ``req_to_token[req_pool_indices[i]]``, positions ``0 .. seq_lens[i] - 1`` — take its
FULL slot ``f`` and its SWA slot ``s = full_to_swa_index_mapping[f]``;

* divergence counts the tokens with ``s != 0 and s != f`` (the SWA allocator really remapped);
* out-of-window counts the tokens with ``s == 0`` (slot freed because the token left the window;
  slot 0 is the reserved "none").

How one sample is computed (:func:`stage_sample`):

* **live** (the host knows the lengths, ``seq_lens_cpu``, and the batch is not nearly full): the
  flat ``req_to_token`` index of every live token comes from one ``cumsum`` over a buffer of ones
  with each request's jump written at its first token (``int32`` when ``req_to_token`` has fewer
  than 2**31 cells: half the bytes of every pass), then two gathers (``req_to_token``, the
  mapping), one comparison giving ``s != 0``, ``s != f`` and ``f != 0``, and every count (the
  window's too) from one ``cumsum`` over the masks (:mod:`otel_swa.device.sample_live`). Work
  proportional to the live tokens.
* **dense** (no host lengths, or a fill ratio ``sum(seq_lens) / (batch * max_context_len)`` at or
  above :data:`DENSE_FILL_RATIO`): the rows are gathered whole, positions at or beyond ``seq_len``
  are masked. At a high fill this costs less than the index computation of the live path (both
  ways are measured side by side in ``benchmarks/bench_sample.py``, which sets the ratio).

The choice is made on the host, per sample, from what the host already knows; both give the same
counts. When the view gives its ``sliding_window``, either path also stages the window check
(premature evictions, late-held SWA slots: :mod:`otel_swa.device.window`) from the SWA slots it
gathered, in the same slot, its host offsets in the same one upload. Every temporary is written with ``out=`` into a :class:`~otel_swa.device.workspace.Workspace`
(kept on the CPU, the caching allocator on CUDA), and the results reach the staged slot through one
``cat``.

Bad views are never plausible numbers: the sample also stages what it needs to
tell that the view was unusable, without a host sync: the range of ``req_pool_indices``, the range
of the live tokens' FULL slots, the number of batch entries whose ``seq_lens`` differs from
``seq_lens_cpu`` and, without host lengths, the range of ``seq_lens``; negative lengths and lengths
beyond ``max_context_len`` in ``seq_lens_cpu`` are seen on the host. :func:`read_sample` turns them
into :data:`FAULTS`. Every index is clamped before it is used, so a bad view never makes the device
read out of bounds; its counts are not trusted (the reporter delivers no record for it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from otel_swa.device.audit import (
    AUDIT_COUNTS,
    AUDIT_OFFENDER_CELLS,
    AUDIT_WIDTH,
    SwaAuditSweep,
)
from otel_swa.device.audit_holders import stage_fused_audit
from otel_swa.device.window import (
    PREMATURE_CELLS,
    WINDOW_WIDTH,
    dense_columns,
    device_columns,
    host_allowance,
    host_reach,
    stage_window_dense,
    stage_window_empty,
    window_spans,
)
from otel_swa.device.live_tokens import count_divergence, host_lengths, live_full_slots
from otel_swa.device.sample_cells import (
    _AUDIT, _DIFFERENT, _FILLER, _FILLER_SWA, _FULL_NONZERO, _LENS, _LIVE, _NONZERO, _ROWS, _SLOT0_SWA, _SLOTS,
    _VERIFY, _WINDOW, FUSED_CELLS, STAGE_WIDTH, _commit, _upload,
)
from otel_swa.device.sample_live import stage_live
from otel_swa.device.workspace import Workspace

__all__ = [
    "STAGE_WIDTH",
    "FUSED_CELLS",
    "DENSE_FILL_RATIO",
    "FAULTS",
    "SampleMeta",
    "SampleReading",
    "stage_sample",
    "read_sample",
    "host_lengths",
    "live_full_slots",
    "count_divergence",
]

#: Fill ratio (live tokens / (batch x max_context_len)) from which a sample with host lengths is
#: computed dense rather than live: measured crossover on 2 CPU cores, 1 torch thread (see
#: ``BENCHMARKS.md``, "live vs dense").
DENSE_FILL_RATIO = 0.95

#: The faults :func:`read_sample` can report, in this order.
FAULTS = (
    "req_pool_index_out_of_range",  # a batch entry names a row outside req_to_token
    "full_slot_out_of_range",  # a live token's FULL slot is negative or beyond the mapping
    "seq_len_beyond_width",  # a seq_len above max_context_len
    "negative_seq_len",  # a seq_len below 0
    "seq_lens_cpu_mismatch",  # seq_lens_cpu differs from seq_lens
)


@dataclass(frozen=True)
class SampleMeta:
    """What the host knew when it staged a sample; :func:`read_sample` needs it to read the values.

    Attributes:
        path: ``"live"``, ``"dense"`` or ``"empty"`` (no live token: nothing gathered).
        live_tokens: live tokens when the host knows them (host lengths), else ``None``.
        batch: entries of the batch.
        num_rows: rows of ``req_to_token``.
        width: ``max_context_len``, the columns of ``req_to_token``.
        mapping_size: entries of the mapping.
        host_faults: faults seen on the host (from ``seq_lens_cpu``).
        host_lengths: whether ``seq_lens_cpu`` was given.
        audited: whether the audit counts were staged (with an ``audit_sweep``: whether a pass of
            the sweep ended at this sample; its counts are those of the pool at the pass's first
            sample).
        audit_started: whether a pass of the audit began at this sample (the holders it audits are
            this sample's: the batch's tokens first with ``holders_include_batch``).
        host_rows: whether the rows were known on the host (then checked there).
        window: the sliding window the window cells were staged for, ``None`` when not staged.
        window_tokens: ``sum(min(len_i, window + extend_len_i - 1))`` when the host knows it, else
            ``None`` (staged).
    """

    @property
    def gathered(self) -> int:
        """Positions the sample gathered: the live tokens, or ``batch x width`` when dense."""
        return self.batch * self.width if self.path == "dense" else (self.live_tokens or 0)

    path: str
    live_tokens: "int | None"
    batch: int
    num_rows: int
    width: int
    mapping_size: int
    host_faults: tuple[str, ...] = ()
    host_lengths: bool = True
    audited: bool = False
    host_rows: bool = False
    window: "int | None" = None
    window_tokens: "int | None" = None
    audit_started: bool = False


@dataclass(frozen=True)
class SampleReading:
    """A staged sample read on the host (all ints).

    Attributes:
        verify_full, verify_swa: the device totals staged (without the host ints).
        divergence, out_of_window: the counts (meaningful only when ``faults`` is empty).
        faults: the :data:`FAULTS` shown, in that order.
        audit: the five audit counts, or ``None`` when not audited.
        audit_where: the audit's first offenders by name
            (:data:`otel_swa.device.audit.AUDIT_OFFENDER_CELLS`), ``None`` when not audited.
        premature: live tokens inside the sliding window whose SWA mapping is 0, ``None`` when the
            view gave no window (see :mod:`otel_swa.device.window`).
        late_held: live tokens older than the window plus the allowance that still hold an SWA
            slot, ``None`` when the view gave no window.
        premature_where: the first premature eviction (:data:`otel_swa.device.window.PREMATURE_CELLS`:
            batch entry, row, position, FULL slot), ``None`` when there is none.
    """

    verify_full: int
    verify_swa: int
    divergence: int
    out_of_window: int
    faults: tuple[str, ...]
    audit: "tuple[int, int, int, int, int] | None"
    audit_where: "dict[str, int] | None" = None
    premature: "int | None" = None
    late_held: "int | None" = None
    premature_where: "dict[str, int] | None" = None


def stage_sample(
    out: torch.Tensor,
    totals: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None,
    swa_audit: Any = None,
    upload: "Callable[[np.ndarray], torch.Tensor] | None" = None,
    *,
    req_pool_indices_cpu: "torch.Tensor | Sequence[int] | None" = None,
    workspace: Workspace | None = None,
    dense_fill_ratio: float = DENSE_FILL_RATIO,
    sliding_window: "int | None" = None,
    swa_eviction_allowance: "int | Sequence[int] | torch.Tensor | None" = None,
    extend_lens_cpu: "int | Sequence[int] | torch.Tensor | None" = None,
    audit_sweep: "SwaAuditSweep | None" = None,
) -> SampleMeta:
    """Write one sample into ``out`` (``int64 [STAGE_WIDTH]`` on the device), in stream order.

    Args:
        out: the staging slot.
        totals: the device totals, ``int64 [2]`` (FULL, SWA), staged as they are now.
        req_to_token, full_to_swa_index_mapping, req_pool_indices, seq_lens, seq_lens_cpu,
            swa_audit, req_pool_indices_cpu: the view's tensors (see
            :class:`otel_swa.views.SwaBatchView`). With ``req_pool_indices_cpu`` (and
            ``seq_lens_cpu``) the rows are known on the host: their checks and the per-request
            index jumps are computed there, and ``req_pool_indices`` is not read.
        upload: how a host ``int64`` numpy array reaches the device; default ``torch.from_numpy``
            then ``.to(device)`` (on CUDA the reporter passes its ring's pinned, non-blocking copy).
        workspace: where the temporaries go (default: a new one, allocating as it goes).
        dense_fill_ratio: see the module docstring.
        sliding_window: the view's window (tokens attention reads, current one included; int >=
            1), or ``None``: then the window cells are not staged. See :mod:`otel_swa.device.window`.
        swa_eviction_allowance: tokens older than the window an SWA slot may still be held for
            without counting as late-held: an int >= 0 or one per batch entry (host); default the
            audit's page size when ``swa_audit`` is given, else 0. Counted from the oldest position
            this step reads (see :mod:`otel_swa.device.window`).
        extend_lens_cpu: the new tokens (queries) of each request in this forward step, an int >= 1
            or one per batch entry on the host; ``None``: 1 each (a decode step). The window check
            counts the positions the step's first query reads onwards, ``window + extend_len - 1``
            of them; read only with ``sliding_window``.
        audit_sweep: the reporter's :class:`~otel_swa.device.audit.SwaAuditSweep`: the SWA slot
            audit then runs as its passes (work bounded by the holders and the sweep's budget; the
            audit cells are staged at the last sample of each pass, ``SampleMeta.audited``).
            ``None``: the whole audit at this sample (its work grows with the SWA pool).

    Returns:
        The :class:`SampleMeta` to give :func:`read_sample` with the staged values.

    The tensors are read now, at the sampled forward step: later changes to them by the engine
    cannot leak into this sample. Only metadata and the host lengths are read on the host.

    Shapes, dtypes and devices are not checked here (the reporter checks them first, with
    :func:`otel_swa.views.validate_view`): a direct caller gives ``req_pool_indices``, ``seq_lens``
    and the host sequences one entry per batch entry, or the counts are not those of the batch.

    Raises:
        ValueError: ``seq_lens_cpu`` is not a sequence of integers on the host.
    """
    ws = workspace if workspace is not None else Workspace(out.device)
    mapping = full_to_swa_index_mapping
    num_rows, width = req_to_token.shape
    size = mapping.shape[0]
    rows = req_pool_indices
    batch = rows.shape[0]
    audited = swa_audit is not None
    window = sliding_window
    reach: "np.ndarray | int" = 0
    if window is not None:
        if swa_eviction_allowance is None:
            allowance: "np.ndarray | int" = swa_audit.page_size if audited else 0
        else:
            allowance = host_allowance(swa_eviction_allowance, batch)
        reach = host_reach(window, extend_lens_cpu, batch)
    else:
        allowance = 0
    cells = out[_WINDOW:_WINDOW + WINDOW_WIDTH] if window is not None else None
    with_batch = audited and bool(getattr(swa_audit, "holders_include_batch", False))
    if audited and audit_sweep is None:
        audit_sweep = SwaAuditSweep(out.device, budget=sys.maxsize)  # the whole audit, at this sample
    gathered = None
    if seq_lens_cpu is not None:
        given = host_lengths(seq_lens_cpu)
        host_rows = None
        if req_pool_indices_cpu is not None:
            host_rows = host_lengths(req_pool_indices_cpu)
            if host_rows.size and (host_rows.min() < 0 or host_rows.max() >= num_rows):
                row_fault: tuple[str, ...] = ("req_pool_index_out_of_range",)
                host_rows = host_rows.clip(0, max(num_rows - 1, 0))
            else:
                row_fault = ()
        faults = tuple(
            name for name, bad in (("seq_len_beyond_width", given > width), ("negative_seq_len", given < 0)) if bad.any()
        )
        lens = given.clip(0, width) if faults else given
        if host_rows is not None:
            faults = row_fault + faults
        live = int(lens.sum())
        rows_known = host_rows is not None
        spans = window_spans(lens, reach, allowance) if window is not None else None
        window_tokens = int(spans[0].sum()) if spans is not None else None
        if batch == 0 or live == 0 or width == 0 or num_rows == 0 or size == 0:
            _stage_empty(out, totals, rows, seq_lens, given, upload, ws, rows_known)
            if window is not None:
                stage_window_empty(cells)
            path = "empty"
        elif live < dense_fill_ratio * batch * width:
            gathered, fields, end = stage_live(out, totals, req_to_token, mapping, rows, host_rows, seq_lens, lens,
                                               given, live, upload, ws, spans, cells)
            path = "live"
        else:
            gathered = _stage_dense(out, totals, req_to_token, mapping, rows, host_rows, seq_lens, lens, given, upload,
                                    ws, window, allowance, cells, reach)
            path = "dense"
        audit_cells: "torch.Tensor | list" = [] if path == "live" else out[_AUDIT:_WINDOW]
        done = audited and stage_fused_audit(audit_cells, mapping, swa_audit, gathered if with_batch else None, with_batch,
                                             audit_sweep, ws)
        if path == "live":  # the live path's cells and the audit's in one cat
            if done:
                fields.update(zip(range(_AUDIT, _WINDOW), audit_cells))
                end = max(end, _WINDOW)
            _commit(out, totals, fields, ws, end)
        return SampleMeta(path, live, batch, num_rows, width, size, faults, True, done, rows_known,
                          window, window_tokens, audited and audit_sweep.started)
    if batch == 0 or width == 0 or num_rows == 0 or size == 0:
        _stage_empty(out, totals, rows, seq_lens, None, upload, ws)
        if window is not None:
            stage_window_empty(cells)
        done = audited and stage_fused_audit(out[_AUDIT:_WINDOW], mapping, swa_audit, None, with_batch, audit_sweep, ws)
        return SampleMeta("empty", 0, batch, num_rows, width, size, (), False, done, False,
                          window, 0 if window is not None else None, audited and audit_sweep.started)
    gathered = _stage_dense(out, totals, req_to_token, mapping, rows, None, seq_lens, None, None, upload, ws,
                            window, allowance, cells, reach)
    done = audited and stage_fused_audit(out[_AUDIT:_WINDOW], mapping, swa_audit, gathered if with_batch else None, with_batch,
                                    audit_sweep, ws)
    return SampleMeta("dense", None, batch, num_rows, width, size, (), False, done, False, window, None,
                      audited and audit_sweep.started)


def _stage_empty(out, totals, rows, seq_lens, lens, upload, ws, rows_known=False) -> None:
    """No live token: the totals and, with a batch, its row range and length checks."""
    fields: dict[int, torch.Tensor] = {}
    if rows.shape[0]:
        if not rows_known:
            fields[_ROWS], fields[_ROWS + 1] = torch.aminmax(rows)
        if lens is not None:
            host = _upload(upload, np.ascontiguousarray(lens), out.device)
            fields[_LENS] = torch.count_nonzero(host - seq_lens)
        else:
            fields[_LENS], fields[_LENS + 1] = torch.aminmax(seq_lens)
    _commit(out, totals, fields, ws)


def _count(out, totals, flat, mapping, index, live, ws, fields) -> "tuple[torch.Tensor, torch.Tensor]":
    """Gather the FULL slots at ``index`` (``int32``/``int64 [live]`` into ``flat``), then their
    SWA slots, count, and commit with ``fields``; return the FULL slots (clamped into the mapping,
    in its dtype) and the SWA slots gathered.

    Counted: ``s != f``, ``s != 0`` and ``f != 0``; with ``mapping[0]`` they give the divergence
    (``s != f and s != 0``) on the host (:func:`read_sample`): one comparison into bytes and
    three counts, which move less memory than a product such as ``(s - f) * s`` (two passes
    writing int64, one of them a 64-bit multiplication)."""
    size = mapping.shape[0]
    if index is None:  # dense: the gathered rows themselves
        raw = flat
    else:
        raw = torch.index_select(flat, 0, index, out=ws.get("count.raw", live, flat.dtype))
    # The range and the clamp in the rows' dtype (int32 in the engines: half the bytes), then
    # one widening copy when the mapping's dtype differs (a mixed-dtype comparison is several
    # times slower than a copy and a same-dtype one).
    fields[_SLOTS], fields[_SLOTS + 1] = torch.aminmax(raw)
    raw.clamp_(0, size - 1)
    if raw.dtype == mapping.dtype:
        full = raw
    else:
        full = ws.get("count.full", live, mapping.dtype)
        full.copy_(raw)
    swa = torch.index_select(mapping, 0, full, out=ws.get("count.swa", live, mapping.dtype))
    fields[_DIFFERENT] = torch.count_nonzero(torch.ne(swa, full, out=ws.get("count.differs", live, torch.bool)))
    fields[_NONZERO] = torch.count_nonzero(swa)
    fields[_FULL_NONZERO] = torch.count_nonzero(raw)  # raw is clamped: the zeros of full
    fields[_SLOT0_SWA] = mapping[0]
    _commit(out, totals, fields, ws)
    return full, swa


def _stage_dense(out, totals, req_to_token, mapping, rows, host_rows, seq_lens, lens, given, upload, ws,
                 window=None, allowance=0, cells=None, reach=0) -> None:
    """The dense path: whole rows of ``req_to_token``; positions at or beyond ``seq_len`` are set
    to FULL slot 1 (a valid index) and their contribution, known from ``mapping[1]`` and their
    number, is taken off on the host (:func:`read_sample`). With a ``window``, the window cells
    too (per-row thresholds from the same one upload, or from ``seq_lens`` on the device with the
    per-request reaches and allowances, when not ints, in the one upload)."""
    num_rows, width = req_to_token.shape
    batch = rows.shape[0]
    fields: dict[int, torch.Tensor] = {}
    up = None
    per_request = [value for value in (reach, allowance) if not isinstance(value, int)]
    # the longest window of the batch, where the first premature eviction is looked for (host)
    if lens is not None:
        span = int(np.minimum(lens, reach).max()) if batch else 0
    else:
        span = int(np.max(reach)) if batch and not isinstance(reach, int) else int(reach) if batch else 0
    if lens is not None:
        rows_at = 2 if host_rows is not None else None
        windows_at = (3 if host_rows is not None else 2) if window is not None else None
        host = np.empty((2 + (rows_at is not None) + 6 * (window is not None), batch), dtype=np.int64)
        host[0], host[1] = lens, given
        if rows_at is not None:
            host[rows_at] = host_rows
        if windows_at is not None:
            host[windows_at:] = dense_columns(lens, reach, allowance)
        up = _upload(upload, host, out.device)
    elif window is not None and per_request:
        up_window = _upload(upload, np.stack(np.broadcast_arrays(np.asarray(reach, np.int64), np.asarray(allowance, np.int64))), out.device)
    if host_rows is None:
        fields[_ROWS], fields[_ROWS + 1] = torch.aminmax(rows)
        rows_c = torch.clamp(rows, 0, num_rows - 1, out=ws.get("dense.rows", batch, rows.dtype))
    else:
        rows_c = up[2]
    block = torch.index_select(req_to_token, 0, rows_c, out=ws.get("dense.block", batch * width, req_to_token.dtype).view(batch, width))
    if up is not None:
        device_lens = up[0]
        fields[_LENS] = torch.count_nonzero(up[1] - seq_lens)
    else:
        fields[_LENS], fields[_LENS + 1] = torch.aminmax(seq_lens)
        device_lens = torch.clamp(seq_lens, 0, width, out=ws.get("dense.lens", batch, seq_lens.dtype))
        fields[_LIVE] = device_lens.sum()
    beyond = torch.ge(ws.arange(width, device_lens.dtype), device_lens.unsqueeze(1), out=ws.get("dense.mask", batch * width, torch.bool).view(batch, width))
    block.masked_fill_(beyond, _FILLER if mapping.shape[0] > _FILLER else 0)
    fields[_FILLER_SWA] = mapping[min(_FILLER, mapping.shape[0] - 1)]
    full, swa = _count(out, totals, block.view(-1), mapping, None, batch * width, ws, fields)
    gathered = (full, swa, beyond.view(-1))
    if window is None:
        return gathered
    if up is not None:
        columns, weights, window_tokens = up[windows_at:windows_at + 3].t(), up[windows_at + 3:windows_at + 6].t(), None
    else:
        lens64 = device_lens.long()
        if per_request:
            reach = up_window[0] if not isinstance(reach, int) else reach
            allowance = up_window[1] if not isinstance(allowance, int) else allowance
        columns, weights, window_tokens = device_columns(lens64, reach, allowance)
    stage_window_dense(cells, swa, (batch, width), columns, weights, window_tokens, ws, full, rows_c, span,
                       int(np.minimum(lens, reach).sum()) if lens is not None else None)
    return gathered


def read_sample(values: Sequence[int], meta: SampleMeta, fused: bool = True) -> SampleReading:
    """Read a staged sample (``values``: the ``STAGE_WIDTH`` ints of its slot) with ``meta``.

    The faults (:data:`FAULTS`) come from the staged ranges and counts and from
    ``meta.host_faults``; the counts are those of SGLang's definition when there is none.
    ``fused``: also read the cells of the checks fused into the core pass (the audit's and the
    window's; the reporter leaves them to those checks' own reading, :mod:`otel_swa.checks`).
    """
    faults = set(meta.host_faults)
    live = meta.live_tokens
    divergence = out_of_window = 0
    if meta.batch:
        if not meta.host_rows and (values[_ROWS] < 0 or values[_ROWS + 1] >= meta.num_rows):
            faults.add("req_pool_index_out_of_range")
        if meta.host_lengths:
            if values[_LENS]:
                faults.add("seq_lens_cpu_mismatch")
        else:
            if values[_LENS] < 0:
                faults.add("negative_seq_len")
            if values[_LENS + 1] > meta.width:
                faults.add("seq_len_beyond_width")
        if meta.path == "empty" and meta.mapping_size == 0 and meta.width and meta.num_rows:
            # a mapping of no entry (nothing gathered): every live token's FULL slot lies beyond it
            if (live if meta.host_lengths else values[_LENS + 1]) > 0:
                faults.add("full_slot_out_of_range")
    if meta.path != "empty":
        slot_low, slot_high = values[_SLOTS], values[_SLOTS + 1]
        if slot_low < 0 or slot_high >= meta.mapping_size:
            faults.add("full_slot_out_of_range")
        if live is None:
            live = values[_LIVE]
        gathered = meta.gathered if meta.path == "dense" else live
        different, nonzero = values[_DIFFERENT], values[_NONZERO]
        # Divergence is s != f and s != 0: the tokens with s != f less those with s == 0 and
        # f != 0, i.e. all with s == 0 less those with f == 0 that map to 0 (mapping[0] is the
        # SWA slot of every token at FULL slot 0).
        full_zero = (gathered - values[_FULL_NONZERO]) if values[_SLOT0_SWA] == 0 else 0
        divergence = different - (gathered - nonzero) + full_zero
        if meta.path == "dense":  # take off the masked positions (FULL slot `filler` each)
            masked = gathered - live
            filler = _FILLER if meta.mapping_size > _FILLER else 0
            filler_swa = values[_FILLER_SWA]
            nonzero -= masked * (filler_swa != 0)
            divergence -= masked * (filler_swa != 0 and filler_swa != filler)
        out_of_window = live - nonzero
    audit = tuple(values[_AUDIT:_AUDIT + AUDIT_COUNTS]) if meta.audited and fused else None
    audit_where = dict(zip(AUDIT_OFFENDER_CELLS, values[_AUDIT + AUDIT_COUNTS:_AUDIT + AUDIT_WIDTH])) if audit else None
    premature = late_held = premature_where = None
    if meta.window is not None and fused:
        window_tokens = meta.window_tokens if meta.window_tokens is not None else values[_WINDOW + 2]
        premature = window_tokens - values[_WINDOW]
        late_held = values[_WINDOW + 1]
        if premature > 0:
            premature_where = dict(zip(PREMATURE_CELLS, values[_WINDOW + 3:_WINDOW + 3 + len(PREMATURE_CELLS)]))
    return SampleReading(
        verify_full=values[_VERIFY],
        verify_swa=values[_VERIFY + 1],
        divergence=divergence,
        out_of_window=out_of_window,
        faults=tuple(name for name in FAULTS if name in faults),
        audit=audit,
        audit_where=audit_where,
        premature=premature,
        late_held=late_held,
        premature_where=premature_where,
    )
