"""The reporter's view of one SGLang forward step (:func:`batch_view`), the window check's window
and eviction allowance (:func:`sglang_window`) and the pipeline micro-batch a batch is
(:func:`scheduler_micro_batch`). Names and layouts: the docstring of :mod:`otel_swa.views.sglang`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from otel_swa.views.base import SwaAuditInputs, SwaBatch
from otel_swa.views.sglang_pools import _attr, swa_free_page_lists

def sglang_window(sliding_window_size: int, page_size: int, eviction_interval: int = 1) -> tuple[int, int]:
    """The view's ``(sliding_window, swa_eviction_allowance)`` for an SGLang model runner.

    Args:
        sliding_window_size: ``ModelRunner.sliding_window_size`` (int >= 1), SGLang's exclusive
            window: its attention reads keys ``q_pos - sliding_window_size .. q_pos``
            (``srt/layers/attention/torch_native_backend.py``; models return
            ``config.sliding_window - 1``, e.g. ``srt/models/gpt_oss.py``). The view's window, the
            number of positions read, is one more.
        page_size: the allocator's page size (int >= 1).
        eviction_interval: ``SGLANG_SWA_EVICTION_INTERVAL`` (int >= 1; SGLang's default 1).

    Returns:
        ``(sliding_window_size + 1, allowance)``. The allowance is what SGLang keeps by design at a
        decode step (sglang 0.5.23 ``srt/mem_cache/common.py`` ``free_swa_out_of_window_slots``,
        called by ``ScheduleBatch.maybe_evict_swa`` with ``pre_len = seqlen - 1``): with a
        prefix-sharing tree cache it frees below ``pre_len - ceil_align(max(sliding_window_size,
        page_size), page_size)`` rounded down to a page, so up to ``ceil_align(...) -
        sliding_window_size + page_size - 1`` tokens older than the window keep their SWA slot (without
        prefix sharing, up to ``page_size - 1``); it evicts only once ``eviction_interval`` tokens
        have left the window, which keeps up to ``eviction_interval - 1``. The larger of the two.

    Raises:
        ValueError: a value is not an int >= 1.
    """
    for name, value in (("sliding_window_size", sliding_window_size), ("page_size", page_size),
                        ("eviction_interval", eviction_interval)):
        if type(value) is not int or value < 1:  # noqa: E721
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    kept = -(-max(sliding_window_size, page_size) // page_size) * page_size
    return sliding_window_size + 1, max(kept - sliding_window_size + page_size - 1, eviction_interval - 1)


def _is_extend(forward_batch: Any) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    is_extend = getattr(mode, "is_extend", None)
    try:
        return bool(is_extend()) if callable(is_extend) else False
    except Exception:  # an unusual mode object: treat the batch as a decode batch
        return False


def batch_view(
    allocator: Any,
    req_to_token_pool: Any,
    forward_batch: Any = None,
    *,
    req_pool_indices: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None,
    holder_full_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    swa_eviction_allowance: int | None = None,
    extend_lens_cpu: "Sequence[int] | torch.Tensor | None" = None,
    token_ids: "Sequence[Any] | None" = None,
    sweep_full_slots: "Callable[[], torch.Tensor | None] | None" = None,
) -> SwaBatch:
    """The reporter's view (:class:`otel_swa.views.SwaBatch`) of one SGLang forward step.

    Everything is taken by reference: no copy, no device work, no host sync.

    Args:
        allocator: SGLang's ``SWATokenToKVPoolAllocator`` (anything with a
            ``full_to_swa_index_mapping`` tensor).
        req_to_token_pool: SGLang's ``ReqToTokenPool`` (``req_to_token``, ``int32 [rows, max_context_len]``).
        forward_batch: SGLang's ``ForwardBatch`` or ``ScheduleBatch``: ``req_pool_indices``,
            ``seq_lens`` and, when present and not ``None``, ``seq_lens_cpu`` are read from it, and
            ``rids`` (the requests' ids) for the first offenders of faults.
        req_pool_indices, seq_lens, seq_lens_cpu: the same, given directly (they override the
            batch's). ``seq_lens_cpu`` lets the reporter gather exactly the live tokens; without
            it the gather is dense over ``[batch, max_context_len]``, as in SGLang.
        holder_full_slots: ``int [n]`` on the allocator's device, the FULL slots of every token a
            live holder still reads (all running requests and the prefix cache, not only this
            batch), or a zero-argument callable returning them (or ``None`` when they cannot all
            be had): the reporter calls it only at the first sample of an audit pass. When given,
            the view also carries the SWA slot audit inputs (the allocator's SWA free lists as
            they are, see :func:`swa_free_page_lists`) and records get leaked / stale / shared SWA
            slot counts.
        sliding_window, swa_eviction_allowance: the window check (see
            :class:`otel_swa.views.SwaBatchView`), e.g. from :func:`sglang_window`; ``None``: no
            window check. In an extend (prefill) batch (``forward_batch.forward_mode.is_extend()``)
            the window covers the positions the chunk's first query reads onwards: the view's
            ``extend_lens_cpu`` is ``forward_batch.extend_seq_lens_cpu`` (``extend_lens`` on a
            ``ScheduleBatch``; 1 per request where it is below 1); an extend batch without one
            entry per request gets no window check (its reach is not known). No token is counted as
            late-held there: SGLang frees a request's out-of-window SWA slots from its second
            decode step on (``ScheduleBatch.maybe_evict_swa``: ``decode_batch_idx >= 1``; with a
            prefix-sharing tree cache never during a prefill), so a prompt keeps its SWA slots
            until then; the first decode step after a long prompt counts them as late-held.
            An allocator in SGLang's per-request SWA ring mode (``allocator.swa_req_ring`` true,
            sglang 0.5.23 ``srt/mem_cache/allocator/swa.py``) never writes
            ``full_to_swa_index_mapping``: its views get no window check (every in-window token
            would read as evicted).
        extend_lens_cpu: each request's new tokens in this step, given directly (overrides the
            batch's; a host sequence or CPU tensor of ints >= 1, ``[batch]``); read only with a
            window.
        token_ids: each request's token ids, one entry per batch entry (:func:`request_token_ids`),
            for the provenance check; ``None``: its slots are counted unchecked.
        sweep_full_slots: a zero-argument callable returning the FULL slots the provenance check
            sweeps beyond the batch (:func:`scheduler_prefix_cache_full_slots`), or ``None``.

    Returns:
        A :class:`~otel_swa.views.SwaBatch`. With neither a batch nor indices, an empty batch (the
        sample then counts 0 divergence and 0 out-of-window tokens, as SGLang's reporter does
        without a batch).

    Raises:
        TypeError: ``allocator`` or ``req_to_token_pool`` lacks SGLang's attributes.
        RuntimeError: with ``holder_full_slots``, see :func:`swa_free_pages`.
    """
    mapping = _attr(allocator, "full_to_swa_index_mapping", "allocator")
    req_to_token = _attr(req_to_token_pool, "req_to_token", "req_to_token_pool")
    if forward_batch is not None:
        if req_pool_indices is None:
            req_pool_indices = _attr(forward_batch, "req_pool_indices", "forward batch")
        if seq_lens is None:
            seq_lens = _attr(forward_batch, "seq_lens", "forward batch")
        if seq_lens_cpu is None:
            seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if req_pool_indices is None or seq_lens is None:
        device = mapping.device
        req_pool_indices = torch.zeros(0, dtype=torch.int64, device=device)
        seq_lens = torch.zeros(0, dtype=torch.int64, device=device)
        seq_lens_cpu = ()
    if sliding_window is not None and getattr(allocator, "swa_req_ring", False) is True:
        sliding_window = swa_eviction_allowance = extend_lens_cpu = None  # the mapping is not maintained
    if sliding_window is not None and forward_batch is not None and _is_extend(forward_batch):
        if swa_eviction_allowance is not None:
            swa_eviction_allowance = int(req_to_token.shape[1])  # nothing is older than that: no late-held count
        if extend_lens_cpu is None:
            extend_lens_cpu = _extend_lens(forward_batch, int(req_pool_indices.shape[0]))
            if extend_lens_cpu is None:
                sliding_window = swa_eviction_allowance = None  # the reach of its queries is not known
    request_ids = getattr(forward_batch, "rids", None) if forward_batch is not None else None
    if request_ids is not None and len(request_ids) != int(req_pool_indices.shape[0]):
        request_ids = None  # not this batch's (a padded or partial batch)
    return SwaBatch(
        req_to_token=req_to_token,
        full_to_swa_index_mapping=mapping,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        request_ids=request_ids,
        swa_audit=_audit_inputs(allocator, holder_full_slots) if holder_full_slots is not None else None,
        sliding_window=sliding_window,
        swa_eviction_allowance=swa_eviction_allowance,
        extend_lens_cpu=extend_lens_cpu if sliding_window is not None else None,
        **({"token_ids": token_ids} if token_ids is not None else {}),
        **({"kv_sweep_full_slots": sweep_full_slots} if sweep_full_slots is not None else {}),
    )


def _extend_lens(forward_batch: Any, batch: int) -> "list[int] | None":
    """Each request's new tokens in an extend or mixed batch, from ``extend_seq_lens_cpu``
    (``ForwardBatch``) or ``extend_lens`` (``ScheduleBatch``), as host ints >= 1; ``None`` when
    neither has one entry per request."""
    for name in ("extend_seq_lens_cpu", "extend_lens"):
        values = getattr(forward_batch, name, None)
        if values is None:
            continue
        try:
            values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
            if len(values) == batch:
                return [max(1, int(value)) for value in values]
        except (TypeError, ValueError):
            continue
    return None


def _audit_inputs(allocator: Any, holder_full_slots: Any) -> SwaAuditInputs:
    free, num_pages = swa_free_page_lists(allocator)
    return SwaAuditInputs(
        swa_free_page_ids=free,
        num_swa_pages=num_pages,
        page_size=int(_attr(allocator, "page_size", "allocator")),
        holder_full_slots=holder_full_slots,
    )


def scheduler_micro_batch(scheduler: Any, batch: Any) -> int | None:
    """The micro-batch ``batch`` is, under pipeline parallelism, or ``None``.

    sglang 0.5.23's pipeline event loop (``scheduler_pp_mixin.py``) keeps one batch per micro-batch
    in ``scheduler.mbs`` (a list of ``pp_loop_size`` entries) and runs ``self.mbs[mb_id]`` through
    ``Scheduler.run_batch``; the micro-batch is therefore the position of ``batch`` in that list
    (found by identity). ``None`` without a pipeline (no ``mbs`` list, or ``batch`` not in it).
    Host work: at most ``pp_loop_size`` identity comparisons.
    """
    micro_batches = getattr(scheduler, "mbs", None)
    if batch is None or not isinstance(micro_batches, list):
        return None
    for index, candidate in enumerate(micro_batches):
        if candidate is batch:
            return index
    return None
