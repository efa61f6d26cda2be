"""What the reporter reads from an engine: the SWA KV cache view protocol.

An engine exposes its hybrid KV cache to the reporter through an object with four tensor attributes
(all on the same device as the reporter):

``req_to_token``
    ``int32`` or ``int64``, shape ``[num_req_slots, max_context_len]``. Row ``r`` holds the FULL-pool
    slot of each position of the request in request slot ``r`` (SGLang's ``ReqToTokenPool``).
``full_to_swa_index_mapping``
    ``int64``, shape ``[num_full_slots]``. The SWA slot of each FULL slot; ``0`` means "none": never
    mapped, or freed because the token left the sliding window (SGLang's
    ``SWATokenToKVPoolAllocator.full_to_swa_index_mapping``).
``req_pool_indices``
    ``int32`` or ``int64``, shape ``[batch]``: the ``req_to_token`` rows of the requests in this
    forward step.
``seq_lens``
    ``int32`` or ``int64``, shape ``[batch]``: the number of live tokens (positions ``0 ..
    seq_len - 1``) of each request of the batch.

and, optionally:

``seq_lens_cpu``
    the same as ``seq_lens`` as a host tensor or a sequence of ints. With it the reporter gathers
    exactly the live tokens (``sum(seq_lens)`` of them), or, when they fill ``DENSE_FILL_RATIO``
    (95 %) or more of ``[batch, max_context_len]``, the whole rows (cheaper then; see
    :mod:`otel_swa.device.sample`);
    without it it always gathers the whole rows, masked, which needs no host sync either. The
    sample also counts the batch entries where it differs from ``seq_lens`` (a fault: such a
    sample gives no record).
``req_pool_indices_cpu``
    the same as ``req_pool_indices`` on the host (a CPU tensor or a sequence of ints), used with
    ``seq_lens_cpu``: the rows are then checked and turned into gather offsets on the host, and the
    sample takes four device operations fewer (``req_pool_indices`` is not read).
``swa_audit``
    a :class:`SwaAuditInputs` (the SWA free list and every live holder's FULL slots): the reporter
    then also counts leaked SWA slots, stale tokens and shared SWA slots in the same device pass
    (see :mod:`otel_swa.device.audit`).
``divergence_applicable``
    ``False`` for engines without a FULL-to-SWA mapping (vLLM); default ``True``.
``sliding_window``
    an ``int >= 1``: the number of most recent positions the SWA layers' attention reads, the
    current token included (a request of ``seq_len`` tokens reads positions ``seq_len - window ..
    seq_len - 1``). With it each sample also counts the live tokens inside the window whose SWA
    mapping is 0 (premature eviction: attention reads freed KV) and the SWA slots still held by
    tokens older than the window plus the allowance (see :mod:`otel_swa.device.window`). ``None``
    (default): not known, nothing counted, the record's window fields absent. Each engine's
    convention differs: SGLang's ``ModelRunner.sliding_window_size`` is one less (its attention
    masks ``q_pos - sliding_window_size <= k_pos <= q_pos``, sglang 0.5.23
    ``srt/layers/attention/torch_native_backend.py``; models return ``config.sliding_window - 1``,
    ``srt/models/gpt_oss.py``); vLLM's ``SlidingWindowSpec.sliding_window`` is the count itself
    (``get_num_skipped_tokens = max(0, num_computed_tokens - sliding_window + 1)`` keeps the last
    ``sliding_window - 1`` computed tokens for the next one, vllm 0.33.0
    ``v1/core/single_type_kv_cache_manager.py``); the reference engine's ``EngineConfig.window``
    is the count itself.
``extend_lens_cpu``
    the new tokens (queries) each request computes in this forward step, on the host: one ``int
    >= 1`` for every request, or one per batch entry (a sequence or a 1-dimensional CPU tensor of
    ints >= 1, ``[batch]``). 1 in a decode step, the chunk's length in an extend (prefill,
    chunked-prefill) step. Read with ``sliding_window`` only: the step's first query, at ``seq_len
    - extend_len``, reads from ``seq_len - extend_len - window + 1``, so the window check covers
    the last ``window + extend_len - 1`` positions (sgl-project/sglang#8649: a chunk at least as
    long as the window would otherwise hide a freed tail of the previous chunk). ``None``
    (default): 1 for every request. Each engine's source: the reference engine's
    ``ForwardItem.extend_len``; SGLang's ``ForwardBatch.extend_seq_lens_cpu`` in extend and mixed
    batches; vLLM's ``SchedulerOutput.num_scheduled_tokens``. Without ``seq_lens_cpu`` the
    per-request values reach the device with the sample's one upload.
``request_ids``
    the engine's id of each request of the batch, on the host (a sequence of ``[batch]`` strings or
    ints: SGLang's ``ForwardBatch.rids``, vLLM's request ids), so that a fault's first offender
    names its request (:class:`otel_swa.record.Offender`); ``None`` (default): offenders name the
    ``req_to_token`` row only. Read at delivery, never on the device.
``kv_block_audit``
    a :class:`KvBlockAuditInputs` (the KV block pool's free queue, the prefix cache's blocks and every
    request's block table): the reporter then also counts leaked KV blocks and blocks freed while in
    use, for engines whose pool is of blocks rather than mapped slots (vLLM; see
    :mod:`otel_swa.device.block_audit`).
``kv_block_hashes``
    a :class:`BlockHashFindings`: what a block-hash provenance check of the engine's prefix cache
    and block tables found at this step, computed on the host by the view (vLLM; see
    :mod:`otel_swa.views.vllm_block_hashes`); the reporter carries it into the record unchanged.
``token_ids``
    each request's token ids, on the host: one entry per batch entry, each a sequence holding the
    token ids of the request's positions ``0 .. seq_len - 1`` at least (the prompt, then the
    generated tokens; the step's input token at ``seq_len - 1``), or ``None`` where unknown. Read at
    sampling steps by the provenance verification (:mod:`otel_swa.device.provenance`), which needs
    only ``len(ids)`` and slices ``ids[a:b]`` of ints (a list, a tuple, a 1-D numpy array or CPU
    tensor, or a :class:`JoinedTokenIds` over SGLang's ``origin_input_ids`` and ``output_ids``, which
    joins them without a copy). A request whose ids are missing has its slots counted unchecked;
    one whose ids are shorter than ``seq_len``, its positions past them (SGLang's overlap scheduler
    runs a decode step before the host has the token it feeds). Each engine's source: SGLang's ``Req.origin_input_ids`` and
    ``Req.output_ids``; the reference engine's ``RequestState.prompt_ids`` and ``output_ids``.
``kv_sweep_full_slots``
    FULL slots held beyond the batch (SGLang: its prefix cache's, ``tree_cache.all_values_flatten()``),
    whose checksums the provenance check re-hashes at each sample, at most its budget per pool in
    turn (a pass over the list read at its start): an ``int`` tensor on the KV device, or a
    zero-argument callable returning one (or ``None``), called at the first sample of each pass.
    Catches bytes changed in KV no running request reads (what SGLang's KV canary finds by
    sweeping its radix cache).
``swa_eviction_allowance``
    tokens older than the positions this step reads (the last ``window + extend_len - 1``) that
    may still hold an SWA slot without counting as late-held: an ``int >= 0``, or one per batch
    entry (a host sequence or CPU tensor of ints >= 0, ``[batch]``). Default (``None``): the
    ``swa_audit`` page size when the view has one (eviction frees whole pages), else 0.

Engines adapt their own objects to this protocol (see ``otel_swa.views`` for the adapters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "SwaBatchView", "SwaBatch", "SwaAuditInputs", "KvBlockAuditInputs", "BlockHashOffender", "BlockHashFindings",
    "JoinedTokenIds", "validate_view",
]


@runtime_checkable
class SwaBatchView(Protocol):
    """The tensors the reporter reads at a sampled forward step (see the module docstring)."""

    req_to_token: torch.Tensor
    full_to_swa_index_mapping: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True)
class SwaAuditInputs:
    """What the SWA slot audit reads besides the mapping (see :mod:`otel_swa.device.audit`).

    Attributes:
        swa_free_page_ids: ``int32``/``int64 [k]`` on the reporter's device: the SWA pool's free
            page ids (slot ids when ``page_size == 1``), every free list together; or a sequence
            of such tensors (the allocator's free lists as they are, not concatenated), or a
            zero-argument callable returning either. The reporter's audit reads them in passes
            over several samples when the pool is large (:class:`otel_swa.device.audit.SwaAuditSweep`):
            give tensors the engine will not write into (engines replace their free lists).
        num_swa_pages: pages of the SWA pool (ids ``1 .. num_swa_pages``).
        page_size: slots per page.
        holder_full_slots: ``int32``/``int64 [n]`` on the reporter's device: the FULL slot of every
            token a live holder (running request, prefix cache) still reads, not only the batch's;
            or a zero-argument callable returning it, or ``None`` when the holders cannot all be
            had now (the audit reads holders only at the first sample of a pass, so an engine
            pays for listing them only then).
        holders_include_batch: ``True`` when the live tokens of the view's batch (positions below
            ``seq_len`` of its rows) are holders too and ``holder_full_slots`` gives only the
            others (requests outside this forward step, the prefix cache); the audit then takes the
            batch's FULL and SWA slots from the sample's own gathers instead of gathering them a
            second time (do not list the batch's tokens again: a holder given twice is two
            holders). ``False`` (default): ``holder_full_slots`` is every holder.
    """

    swa_free_page_ids: "torch.Tensor | Sequence[torch.Tensor] | Callable[[], Any]"
    num_swa_pages: int
    page_size: int
    holder_full_slots: "torch.Tensor | Callable[[], torch.Tensor | None]"
    holders_include_batch: bool = False


@dataclass(frozen=True)
class KvBlockAuditInputs:
    """What the KV block audit reads (see :mod:`otel_swa.device.block_audit`): a block pool shared
    by every KV cache group, each request's block table per group (vLLM's ``BlockPool`` and its
    managers' ``req_to_blocks``).

    Attributes:
        num_blocks: blocks of the pool, ids ``0 .. num_blocks - 1`` (vLLM's ``num_gpu_blocks``), an
            int >= 1.
        free_block_ids: ``int32``/``int64 [k]`` on the reporter's device: the free queue (what the
            pool counts as free; vLLM's ``free_block_queue``).
        cached_block_ids: ``int [c]``: blocks the prefix cache holds (a block hash maps to them),
            free or not.
        held_block_ids: ``int [h]``: every block id a request's block table references, every KV
            cache group, null entries left out.
        held_groups: ``int [h]``: the KV cache group of each held entry.
        held_rows: ``int [h]``: the index of each held entry's request in ``held_request_ids``.
        held_positions: ``int [h]``: the first token position the block covers in its request.
        held_request_ids: the requests' ids, on the host (``str`` each).
        null_block_id: the pool's placeholder block, never audited (vLLM: 0).
    """

    num_blocks: int
    free_block_ids: torch.Tensor
    cached_block_ids: torch.Tensor
    held_block_ids: torch.Tensor
    held_groups: torch.Tensor
    held_rows: torch.Tensor
    held_positions: torch.Tensor
    held_request_ids: Sequence[str] = ()
    null_block_id: int = 0


class JoinedTokenIds:
    """Token ids held in several host sequences, read as one (a view's ``token_ids`` entry):
    ``len()`` is the sum of the parts' lengths and a slice ``[a:b]`` (step 1) gives a list of the
    ids at positions ``a .. b - 1``, copying only those. SGLang: ``JoinedTokenIds(req.origin_input_ids,
    req.output_ids)``.

    Raises:
        TypeError: an index other than a slice of step 1.
    """

    __slots__ = ("parts",)

    def __init__(self, *parts: Sequence[int]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def __getitem__(self, index: slice) -> list:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"JoinedTokenIds takes slices of step 1, got {index!r}")
        start, stop, _ = index.indices(len(self))
        out: list = []
        for part in self.parts:
            size = len(part)
            if stop > 0 and start < size:
                chunk = part[max(start, 0):min(stop, size)]
                out.extend(chunk.tolist() if hasattr(chunk, "tolist") else chunk)
            start -= size
            stop -= size
        return out


@dataclass(frozen=True)
class BlockHashOffender:
    """Where a block-hash provenance fault was first seen (host values; see
    :mod:`otel_swa.views.vllm_block_hashes`).

    Attributes:
        block: the KV block id.
        kv_cache_group: a foreign block: the group of the table holding it; a stale entry: the group
            of the map key.
        request: the request whose table holds the block (a stale entry: a request that took the
            block through it), when known.
        position: the first token position the block covers in that request, when known.
        other_request: another request whose table holds the block (whose KV it holds), when known.
    """

    block: int
    kv_cache_group: int
    request: "str | None" = None
    position: "int | None" = None
    other_request: "str | None" = None


@dataclass(frozen=True)
class BlockHashFindings:
    """What the block-hash provenance check found at one sample (host ints; see
    :mod:`otel_swa.views.vllm_block_hashes`): the counts of :mod:`otel_swa.checks.block_hashes`
    (entries checked, stale entries, foreign blocks), and the first offender of each fault
    (``None`` when its count is 0).
    """

    entries_checked: int
    stale_entries: int
    foreign_blocks: int
    first_stale: BlockHashOffender | None = None
    first_foreign: BlockHashOffender | None = None


@dataclass(frozen=True)
class SwaBatch:
    """A plain :class:`SwaBatchView`: the engine's tensors for one forward step, by reference.

    ``seq_lens_cpu`` is optional host knowledge of ``seq_lens`` (a CPU tensor or a sequence of
    ints); give it when the engine has it, so the reporter gathers only the live tokens.
    ``req_pool_indices_cpu`` is the same for ``req_pool_indices`` (read only with ``seq_lens_cpu``).
    ``sliding_window``, ``extend_lens_cpu`` and ``swa_eviction_allowance``: the window check (module
    docstring). ``request_ids``: the batch's request ids, for offenders. ``kv_block_audit``: the KV
    block audit's inputs. ``kv_block_hashes``: what the block-hash provenance check found. ``token_ids``:
    each request's token ids (provenance).
    ``kv_sweep_full_slots``: the FULL slots the provenance check sweeps beyond the batch.
    ``kv_provenance``: what a paged engine's provenance verifies, in its own tables
    (:mod:`otel_swa.device.paged_provenance`; vLLM: :func:`otel_swa.views.vllm_provenance.provenance_view`).
    """

    req_to_token: torch.Tensor
    full_to_swa_index_mapping: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None
    swa_audit: SwaAuditInputs | None = None
    divergence_applicable: bool = True
    req_pool_indices_cpu: "torch.Tensor | Sequence[int] | None" = None
    sliding_window: "int | None" = None
    swa_eviction_allowance: "int | torch.Tensor | Sequence[int] | None" = None
    extend_lens_cpu: "int | torch.Tensor | Sequence[int] | None" = None
    request_ids: "Sequence[str | int] | None" = None
    kv_block_audit: KvBlockAuditInputs | None = None
    kv_block_hashes: BlockHashFindings | None = None
    token_ids: "Sequence[Sequence[int] | None] | None" = None
    kv_sweep_full_slots: "torch.Tensor | Callable[[], torch.Tensor | None] | None" = None
    kv_provenance: Any = None


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_same_batch(name: str, values: Any, view: Any) -> None:
    """Raise ``ValueError`` unless ``view.<name>`` (``values``, a host sequence or tensor) has one
    entry per ``view.req_pool_indices``."""
    if len(values) != view.req_pool_indices.shape[0]:
        raise ValueError(
            f"view.{name} has {len(values)} entries but view.req_pool_indices has "
            f"{view.req_pool_indices.shape[0]}; they must describe the same batch"
        )


def _check_tensor(name: str, value: Any, ndim: int, dtypes: tuple, device: torch.device | None) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"view.{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"view.{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"view.{name} must be {names}, got {str(value.dtype).replace('torch.', '')}")
    if device is not None and value.device != device:
        raise ValueError(f"view.{name} is on {value.device}, expected the reporter's device {device}")


def validate_view(view: Any, device: torch.device | None = None) -> None:
    """Check that ``view`` satisfies :class:`SwaBatchView`.

    Only metadata is read (dim, dtype, device, shape): no device work, no host sync.

    Raises:
        TypeError: an attribute is missing, is not a tensor, or has the wrong dtype; ``token_ids``
            is not a sequence.
        ValueError: a tensor has the wrong number of dimensions or is on another device, or
            ``req_pool_indices``, ``seq_lens``, ``seq_lens_cpu``, ``req_pool_indices_cpu``,
            ``request_ids`` and ``token_ids`` differ in length; ``sliding_window`` is not an int >= 1, ``swa_eviction_allowance`` not an
            int >= 0 nor one such int per batch entry on the host, or ``extend_lens_cpu`` not an int
            >= 1 nor one such int per batch entry on the host.
    """
    for name in ("req_to_token", "full_to_swa_index_mapping", "req_pool_indices", "seq_lens"):
        if not hasattr(view, name):
            raise TypeError(f"view {type(view).__name__} has no attribute {name!r} (see SwaBatchView)")
    _check_tensor("req_to_token", view.req_to_token, 2, _INDEX_DTYPES, device)
    _check_tensor("full_to_swa_index_mapping", view.full_to_swa_index_mapping, 1, (torch.int64, torch.int32), device)
    _check_tensor("req_pool_indices", view.req_pool_indices, 1, _INDEX_DTYPES, device)
    _check_tensor("seq_lens", view.seq_lens, 1, _INDEX_DTYPES, device)
    host_lens = getattr(view, "seq_lens_cpu", None)
    if host_lens is not None:
        if isinstance(host_lens, torch.Tensor) and host_lens.dim() != 1:
            raise ValueError(f"view.seq_lens_cpu must have 1 dimension, got shape {tuple(host_lens.shape)}")
        _check_same_batch("seq_lens_cpu", host_lens, view)
    host_rows = getattr(view, "req_pool_indices_cpu", None)
    if host_rows is not None:
        if isinstance(host_rows, torch.Tensor) and (host_rows.dim() != 1 or host_rows.device.type != "cpu"):
            raise ValueError(
                f"view.req_pool_indices_cpu must be a 1-dimensional host tensor or a sequence, got shape "
                f"{tuple(host_rows.shape)} on {host_rows.device}"
            )
        _check_same_batch("req_pool_indices_cpu", host_rows, view)
    audit = getattr(view, "swa_audit", None)
    if audit is not None:
        if not isinstance(audit, SwaAuditInputs):
            raise TypeError(f"view.swa_audit must be a SwaAuditInputs or None, got {type(audit).__name__}")
        free = audit.swa_free_page_ids
        if isinstance(free, (list, tuple)):
            for i, part in enumerate(free):
                _check_tensor(f"swa_audit.swa_free_page_ids[{i}]", part, 1, _INDEX_DTYPES, device)
        elif not callable(free):  # a callable's tensors are checked when the audit calls it
            _check_tensor("swa_audit.swa_free_page_ids", free, 1, _INDEX_DTYPES, device)
        if not callable(audit.holder_full_slots):
            _check_tensor("swa_audit.holder_full_slots", audit.holder_full_slots, 1, _INDEX_DTYPES, device)
        for name in ("num_swa_pages", "page_size"):
            value = getattr(audit, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"view.swa_audit.{name} must be an int >= 1, got {value!r}")
        if type(audit.holders_include_batch) is not bool:  # noqa: E721
            raise TypeError(f"view.swa_audit.holders_include_batch must be a bool, got {audit.holders_include_batch!r}")
    _check_window(view)
    _check_request_ids(view)
    _check_token_ids(view)
    _check_block_audit(getattr(view, "kv_block_audit", None), device)
    if view.req_pool_indices.shape[0] != view.seq_lens.shape[0]:
        raise ValueError(
            f"view.req_pool_indices has {view.req_pool_indices.shape[0]} entries but view.seq_lens has "
            f"{view.seq_lens.shape[0]}; they must describe the same batch"
        )


def _check_window(view: Any) -> None:
    window = getattr(view, "sliding_window", None)
    if window is not None and (type(window) is not int or window < 1):  # noqa: E721 - bool refused
        raise ValueError(
            f"view.sliding_window must be None or an int >= 1 (tokens attention reads, the current one "
            f"included), got {window!r}"
        )
    batch = view.req_pool_indices.shape[0]
    _check_per_request("swa_eviction_allowance", getattr(view, "swa_eviction_allowance", None), 0, "tokens", batch)
    _check_per_request("extend_lens_cpu", getattr(view, "extend_lens_cpu", None), 1,
                       "new tokens of the request in this forward step", batch)


def _check_per_request(name: str, value: Any, minimum: int, unit: str, batch: int) -> None:
    """``value`` is ``None``, an int >= ``minimum``, or one per batch entry on the host."""
    if value is None:
        return
    if type(value) is int:  # noqa: E721
        if value < minimum:
            raise ValueError(f"view.{name} must be an int >= {minimum} ({unit}), got {value}")
        return
    expected = f"an int >= {minimum} or one int >= {minimum} per batch entry on the host"
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.dim() != 1 or value.dtype.is_floating_point \
                or value.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(f"view.{name} must be {expected}, got a {value.dtype} tensor of "
                             f"shape {tuple(value.shape)} on {value.device}")
        values = value.tolist()
    elif isinstance(value, (list, tuple, range)):
        values = list(value)
    else:
        raise TypeError(f"view.{name} must be {expected}, got {type(value).__name__}")
    bad = [v for v in values if type(v) is not int or v < minimum]  # noqa: E721
    if bad:
        raise ValueError(f"view.{name} must be {expected}, got {bad[0]!r} among its entries")
    if len(values) != batch:
        raise ValueError(
            f"view.{name} has {len(values)} entries but view.req_pool_indices has "
            f"{batch}; give one per batch entry (or one int for all)"
        )


def _check_request_ids(view: Any) -> None:
    ids = getattr(view, "request_ids", None)
    if ids is None:
        return
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"view.request_ids must be a sequence of request ids (one per batch entry), got {ids!r}")
    batch = view.req_pool_indices.shape[0]
    if len(ids) != batch:
        raise ValueError(f"view.request_ids has {len(ids)} entries but view.req_pool_indices has {batch}; "
                         "give one per batch entry")


def _check_token_ids(view: Any) -> None:
    ids = getattr(view, "token_ids", None)
    if ids is None:
        return
    if isinstance(ids, (str, bytes, torch.Tensor)) or not hasattr(ids, "__len__"):
        raise TypeError(f"view.token_ids must be a sequence with one entry (a sequence of token ids or None) per "
                        f"batch entry, got {type(ids).__name__}")
    batch = view.req_pool_indices.shape[0]
    if len(ids) != batch:
        raise ValueError(f"view.token_ids has {len(ids)} entries but view.req_pool_indices has {batch}; "
                         "give one per batch entry")


def _check_block_audit(audit: Any, device: "torch.device | None") -> None:
    if audit is None:
        return
    if not isinstance(audit, KvBlockAuditInputs):
        raise TypeError(f"view.kv_block_audit must be a KvBlockAuditInputs or None, got {type(audit).__name__}")
    if type(audit.num_blocks) is not int or audit.num_blocks < 1:  # noqa: E721
        raise ValueError(f"view.kv_block_audit.num_blocks must be an int >= 1, got {audit.num_blocks!r}")
    if type(audit.null_block_id) is not int or not 0 <= audit.null_block_id < audit.num_blocks:  # noqa: E721
        raise ValueError(f"view.kv_block_audit.null_block_id must be an int from 0 to {audit.num_blocks - 1}, "
                         f"got {audit.null_block_id!r}")
    for name in ("free_block_ids", "cached_block_ids", "held_block_ids", "held_groups", "held_rows", "held_positions"):
        _check_tensor(f"kv_block_audit.{name}", getattr(audit, name), 1, _INDEX_DTYPES, device)
    held = audit.held_block_ids.shape[0]
    for name in ("held_groups", "held_rows", "held_positions"):
        if getattr(audit, name).shape[0] != held:
            raise ValueError(f"view.kv_block_audit.{name} has {getattr(audit, name).shape[0]} entries but "
                             f"held_block_ids has {held}; give one per held entry")
