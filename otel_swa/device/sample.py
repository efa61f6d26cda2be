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
  mapping), one comparison and three ``count_nonzero``. Work proportional to the live tokens.
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
    holder_slots,
)
from otel_swa.device.block_audit import BLOCK_WIDTH, block_audit_fields, stage_block_audit
from otel_swa.device.provenance import PROVENANCE_WIDTH, ProvenanceMeta, ProvenanceReading
from otel_swa.device.read_check import READ_WIDTH, ReadCheck, read_counts, read_offender_fields
from otel_swa.device.window import (
    PREMATURE_CELLS,
    WINDOW_WIDTH,
    dense_columns,
    device_columns,
    host_allowance,
    host_reach,
    stage_window_dense,
    stage_window_empty,
    stage_window_live,
    window_spans,
)
from otel_swa.device.workspace import Workspace
from otel_swa.device.write_check import WRITE_WIDTH, WriteCheck, write_counts, write_offender_fields

__all__ = [
    "STAGE_WIDTH",
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
_READ = _WINDOW + WINDOW_WIDTH  # the read check's cells of otel_swa.device.read_check (when it runs)
_BLOCK = _READ + READ_WIDTH  # the KV block audit's cells of otel_swa.device.block_audit (block pools)
_WRITE = _BLOCK + BLOCK_WIDTH  # the write check's cells of otel_swa.device.write_check (when it runs)
_PROV = _WRITE + WRITE_WIDTH  # the provenance verification's cells of otel_swa.device.provenance
_LITTLE_ENDIAN = sys.byteorder == "little"  # host and devices alike (CUDA devices are little-endian)
_FILLER = 1  # FULL slot given to masked positions of the dense path
#: int64 values per staged sample: the counts, the fault evidence, then the audit counts of
#: :func:`otel_swa.device.audit.audit_counts` (pages in use, pages referenced, leaked pages,
#: stale tokens, shared SWA slots), then the sliding-window cells of :mod:`otel_swa.device.window`
#: (in-window tokens with an SWA slot, late-held tokens, in-window tokens), then the read check's
#: cells (:data:`otel_swa.device.read_check.READ_CELLS`), then the KV block audit's
#: (:data:`otel_swa.device.block_audit.BLOCK_CELLS`), then the write check's
#: (:data:`otel_swa.device.write_check.WRITE_CELLS`) and the provenance verification's
#: (:data:`otel_swa.device.provenance.PROVENANCE_CELLS`, FULL then SWA). The audit, window, read,
#: block, write and provenance cells are written only when the view (or the reporter's checks) asks
#: for them (else left as they are, never read).
STAGE_WIDTH = _PROV + PROVENANCE_WIDTH

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
        read_checked: whether the read check's cells were staged.
        block_audited: whether the KV block audit's cells were staged.
        write_checked: whether the write check's cells were staged.
        provenance: the host side of the provenance verification staged
            (:class:`~otel_swa.device.provenance.ProvenanceMeta`), ``None`` when none was.
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
    read_checked: bool = False
    block_audited: bool = False
    audit_started: bool = False
    write_checked: bool = False
    provenance: "ProvenanceMeta | None" = None


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
        read: the read check's ``(checked, mismatched, unchecked)`` queries, ``None`` when it did
            not run (:mod:`otel_swa.device.read_check`).
        read_offender: the first disagreeing query (``entry``, ``row``, ``position``,
            ``full_slot``, ``swa_slot``, ``layer``), ``None`` when none disagreed.
        block: the KV block audit's cells by name (:data:`otel_swa.device.block_audit.BLOCK_CELLS`),
            ``None`` when the view gave no block audit.
        write: the write check's ``(checked, mismatched, unchecked)`` (token, layer) pairs, ``None``
            when it is off (:mod:`otel_swa.device.write_check`).
        write_offender: the first mismatch (``entry``, ``position``, ``full_slot``, ``swa_slot``,
            ``layer``), ``None`` when none.
        provenance: the stamps' and checksums' verification
            (:class:`~otel_swa.device.provenance.ProvenanceReading`), ``None`` when none ran.
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
    read: "tuple[int, int, int] | None" = None
    read_offender: "dict[str, int] | None" = None
    block: "dict[str, int] | None" = None
    write: "tuple[int, int, int] | None" = None
    write_offender: "dict[str, int | None] | None" = None
    provenance: "ProvenanceReading | None" = None


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


def _flat_rows(req_to_token: torch.Tensor) -> "tuple[torch.Tensor, int]":
    """``req_to_token`` as a 1-D view and the stride between its rows (a copy only when its
    positions are not contiguous within a row)."""
    if req_to_token.stride(1) != 1:
        req_to_token = req_to_token.contiguous()
    rows, width = req_to_token.shape
    row_stride = req_to_token.stride(0) if rows > 1 else width
    span = (rows - 1) * row_stride + width if rows else 0
    return req_to_token.as_strided((span,), (1,)), row_stride


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
    read_check: "ReadCheck | None" = None,
    kv_block_audit: Any = None,
    audit_sweep: "SwaAuditSweep | None" = None,
    write_check: "WriteCheck | None" = None,
    provenance: "Callable[[torch.Tensor], ProvenanceMeta | None] | None" = None,
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
        read_check: the step's :class:`~otel_swa.device.read_check.ReadCheck`, whose cells are
            staged (and cleared: :meth:`~otel_swa.device.read_check.ReadCheck.take`), or ``None``.
        kv_block_audit: a :class:`~otel_swa.views.base.KvBlockAuditInputs`, whose audit is
            staged (:mod:`otel_swa.device.block_audit`), or ``None``.
        audit_sweep: the reporter's :class:`~otel_swa.device.audit.SwaAuditSweep`: the SWA slot
            audit then runs as its passes (work bounded by the holders and the sweep's budget; the
            audit cells are staged at the last sample of each pass, ``SampleMeta.audited``).
            ``None``: the whole audit at this sample (its work grows with the SWA pool).
        write_check: the step's :class:`~otel_swa.device.write_check.WriteCheck`, whose cells are
            staged (and cleared), or ``None``.
        provenance: stages the provenance verification into the slice it is given (``int64
            [PROVENANCE_WIDTH]``) and returns its meta (the reporter's
            :meth:`~otel_swa.device.provenance.KvProvenance.stage` bound to the view), or ``None``.

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
    read_checked = read_check is not None
    if read_checked:
        read_check.take(out[_READ:_READ + READ_WIDTH])
    block_audited = kv_block_audit is not None
    if block_audited:
        stage_block_audit(out[_BLOCK:_BLOCK + BLOCK_WIDTH], kv_block_audit, ws)
    extra = {"write_checked": write_check is not None,
             "provenance": provenance(out[_PROV:_PROV + PROVENANCE_WIDTH]) if provenance is not None else None}
    if write_check is not None:
        write_check.take(out[_WRITE:_WRITE + WRITE_WIDTH])
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
            gathered = _stage_live(out, totals, req_to_token, mapping, rows, host_rows, seq_lens, lens, given, live,
                                   upload, ws, spans, cells)
            path = "live"
        else:
            gathered = _stage_dense(out, totals, req_to_token, mapping, rows, host_rows, seq_lens, lens, given, upload,
                                    ws, window, allowance, cells, reach)
            path = "dense"
        done = audited and _stage_audit(out, mapping, swa_audit, gathered if with_batch else None, with_batch,
                                        audit_sweep, ws)
        return SampleMeta(path, live, batch, num_rows, width, size, faults, True, done, rows_known,
                          window, window_tokens, read_checked, block_audited, audited and audit_sweep.started, **extra)
    if batch == 0 or width == 0 or num_rows == 0 or size == 0:
        _stage_empty(out, totals, rows, seq_lens, None, upload, ws)
        if window is not None:
            stage_window_empty(cells)
        done = audited and _stage_audit(out, mapping, swa_audit, None, with_batch, audit_sweep, ws)
        return SampleMeta("empty", 0, batch, num_rows, width, size, (), False, done, False,
                          window, 0 if window is not None else None, read_checked, block_audited,
                          audited and audit_sweep.started, **extra)
    gathered = _stage_dense(out, totals, req_to_token, mapping, rows, None, seq_lens, None, None, upload, ws,
                            window, allowance, cells, reach)
    done = audited and _stage_audit(out, mapping, swa_audit, gathered if with_batch else None, with_batch,
                                    audit_sweep, ws)
    return SampleMeta("dense", None, batch, num_rows, width, size, (), False, done, False, window, None,
                      read_checked, block_audited, audited and audit_sweep.started, **extra)


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


def _upload(upload: "Callable[[np.ndarray], torch.Tensor] | None", array: np.ndarray, device: torch.device) -> torch.Tensor:
    if upload is not None:
        return upload(array)
    host = torch.from_numpy(array)
    return host if device.type == "cpu" else host.to(device)


def _commit(out: torch.Tensor, totals: torch.Tensor, fields: dict[int, torch.Tensor], ws: Workspace) -> None:
    """Write ``totals`` and ``fields`` (layout position -> 0-dim or 1-element tensor) into
    ``out[:_AUDIT]`` in one ``cat``; positions not given get 0."""
    zero = ws.zeros(1)
    parts = [totals]
    for position in range(_DIFFERENT, _AUDIT):
        value = fields.get(position)
        parts.append(zero if value is None else value.reshape(1))
    torch.cat(parts, out=out[:_AUDIT])


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


def _stage_live(out, totals, req_to_token, mapping, rows, host_rows, seq_lens, lens, given, live, upload, ws,
                spans=None, cells=None) -> None:
    """The live path (module docstring): work proportional to the ``live`` tokens; with ``spans``
    (the window's ``(w, o)`` per request) the window cells too, from the same one upload."""
    batch = lens.shape[0]
    num_rows = req_to_token.shape[0]
    flat, row_stride = _flat_rows(req_to_token)
    # Token t of request i has flat index row_stride * row_i + (t - start_i): a run of +1 steps
    # with a jump at each start, jump_i = row_stride * (row_i - row_{i-1}) - len_{i-1} (row_{-1} = 0
    # and len_{-1} = 1 make the first jump land on row_0's first slot). Requests of length 0 share a
    # start with the next one: their jumps add up (accumulate) to the right one, and the jumps of
    # trailing empty requests land in a spare last cell.
    ends = np.cumsum(lens)
    host = np.empty((3 if spans is None else 7, batch), dtype=np.int64)
    host[0, 0] = 0
    host[0, 1:] = ends[:-1]
    if spans is not None:  # offsets into the window's cumsum (a leading 0): see otel_swa.device.window
        host[3] = ends
        host[4] = ends - spans[0]
        host[5] = host[0] + spans[1]
        host[6] = host[0]
    host[1, 0] = -1
    host[1, 1:] = -lens[:-1]
    if host_rows is not None:  # the whole jump on the host
        host[1, 0] += row_stride * host_rows[0]
        host[1, 1:] += row_stride * np.diff(host_rows)
    host[2] = given  # as given: compared with the device's seq_lens
    up = _upload(upload, host, out.device)
    fields: dict[int, torch.Tensor] = {_LENS: torch.count_nonzero(up[2] - seq_lens)}
    # The flat index in int32 when every cell of req_to_token has an int32 index (each partial
    # sum of the cumsum is one: a live token's cell); else int64.
    narrow = flat.numel() < 2**31
    dtype = torch.int32 if narrow else torch.int64
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
    index = ws.get("live.index", live, dtype)
    torch.cumsum(steps[:live], 0, out=index)
    full, swa = _count(out, totals, flat, mapping, index, live, ws, fields)
    if spans is not None:
        stage_window_live(cells, swa, up[3:7], live, ws, full, rows, int(spans[0].max()) if batch else 0,
                          int(spans[0].sum()))
    return full, swa, None


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


def _stage_audit(out, mapping, swa_audit, gathered, with_batch, sweep, ws) -> bool:
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

    return sweep.stage(out[_AUDIT:_WINDOW], holders, swa_audit.swa_free_page_ids, swa_audit.num_swa_pages,
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


def read_sample(values: Sequence[int], meta: SampleMeta) -> SampleReading:
    """Read a staged sample (``values``: the ``STAGE_WIDTH`` ints of its slot) with ``meta``.

    The faults (:data:`FAULTS`) come from the staged ranges and counts and from
    ``meta.host_faults``; the counts are those of SGLang's definition when there is none.
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
    audit = tuple(values[_AUDIT:_AUDIT + AUDIT_COUNTS]) if meta.audited else None
    audit_where = dict(zip(AUDIT_OFFENDER_CELLS, values[_AUDIT + AUDIT_COUNTS:_AUDIT + AUDIT_WIDTH])) if audit else None
    premature = late_held = premature_where = None
    if meta.window is not None:
        window_tokens = meta.window_tokens if meta.window_tokens is not None else values[_WINDOW + 2]
        premature = window_tokens - values[_WINDOW]
        late_held = values[_WINDOW + 1]
        if premature > 0:
            premature_where = dict(zip(PREMATURE_CELLS, values[_WINDOW + 3:_WINDOW + 3 + len(PREMATURE_CELLS)]))
    read_cells = values[_READ:_READ + READ_WIDTH] if meta.read_checked else None
    write_cells = values[_WRITE:_WRITE + WRITE_WIDTH] if meta.write_checked else None
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
        read=read_counts(read_cells) if read_cells is not None else None,
        read_offender=read_offender_fields(read_cells) if read_cells is not None else None,
        block=block_audit_fields(values[_BLOCK:_BLOCK + BLOCK_WIDTH]) if meta.block_audited else None,
        write=write_counts(write_cells) if write_cells is not None else None,
        write_offender=write_offender_fields(write_cells) if write_cells is not None else None,
        provenance=meta.provenance.read(values[_PROV:_PROV + PROVENANCE_WIDTH]) if meta.provenance is not None else None,
    )
