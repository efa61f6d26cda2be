"""SGLang adapter: the reporter's view over SGLang's hybrid SWA KV cache, the KV-canary hook points,
and a leak / stale-mapping audit of the SWA pool.

Nothing here imports SGLang: the adapter reads the attributes SGLang's objects carry (names and
layouts from sglang 0.5.23, ``python/sglang/srt/mem_cache/``):

``SWATokenToKVPoolAllocator``
    ``full_to_swa_index_mapping``: ``int64 [size + page_size + 1]`` on the KV device; entry ``f`` is
    the SWA slot of FULL slot ``f``, ``0`` when unmapped or freed because the token left the sliding
    window, and the last entry is ``-1``. ``page_size``; ``swa_attn_allocator``: the SWA pool's own
    allocator (its free list, see :func:`swa_free_pages`).
``ReqToTokenPool``
    ``req_to_token``: ``int32 [size + 1, max_context_len]``; row 0 is padding, row ``r`` holds the
    FULL slot of each position of the request in row ``r``.
``ForwardBatch`` (or ``ScheduleBatch``)
    ``req_pool_indices`` (``int64 [batch]``), ``seq_lens`` (``int32``/``int64 [batch]``) on the KV
    device, and ``seq_lens_cpu`` (host copy, optional); in extend and mixed batches
    (``forward_mode.is_extend()``) ``extend_seq_lens_cpu`` (``ForwardBatch``; ``extend_lens`` on a
    ``ScheduleBatch``): each request's new tokens in this step, a host list of ints ``[batch]``.

Switching it on inside SGLang's KV canary (the reporter SGLang builds in
``sglang/srt/kv_canary/runner/canary_manager.py`` when
``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL`` > 0) is one substitution: build
:class:`KvCanaryHooks` instead of SGLang's ``SwaDivergenceReporter``. It has the same methods and
keyword arguments (``observe_after_invoke_plan(group=, verify_plan=)`` after each plan,
``step(outer_step_counter=, maybe_inaccurate_forward_batch=)`` once per outer step), and with
:func:`log_line_sink` among the reporter's sinks it logs the same line, byte for byte, so SGLang's
own e2e assertion (``assert_swa_divergence_observed``) accepts it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from otel_swa.device.audit import SwaSlotAudit, audit_swa_slots
from otel_swa.device.sample import live_full_slots
from otel_swa.logline import LogLineSink
from otel_swa.pool_usage import POOL_FULL, POOL_SWA, PoolUsage
from otel_swa.views.base import SwaAuditInputs, SwaBatch

__all__ = [
    "SUPPORTED_SGLANG",
    "batch_view",
    "sglang_window",
    "KvCanaryHooks",
    "log_line_sink",
    "observe_verified",
    "SwaSlotAudit",
    "swa_free_pages",
    "swa_free_page_lists",
    "audit_swa_slots",
    "audit_sglang_swa_slots",
    "scheduler_holder_full_slots",
    "scheduler_micro_batch",
    "scheduler_pool_usage",
    "swa_kv_bytes_per_token",
    "provenance_layout",
    "kv_filled_outside_forward",
    "request_token_ids",
    "scheduler_prefix_cache_full_slots",
]

#: The SGLang versions whose allocator layout this adapter was tested against (pip specifier).
SUPPORTED_SGLANG = "sglang >= 0.5.23, < 0.6"

#: SGLang's logger name for the line (``sglang/srt/kv_canary/runner/swa_divergence.py``).
SGLANG_LOGGER_NAME = "sglang.srt.kv_canary.runner.swa_divergence"

_log = logging.getLogger("otel_swa.views.sglang")


def _attr(obj: Any, name: str, what: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise TypeError(
            f"{what} {type(obj).__name__} has no attribute {name!r}; expected SGLang's {what} "
            f"({SUPPORTED_SGLANG})"
        ) from None


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


# ---------------------------------------------------------------------------------------- KV canary


def _pool_of_group(group: Any) -> str:
    """``"full"`` or ``"swa"`` for a KV-canary buffer group (``CanaryBufferGroup.kind`` is SGLang's
    ``PoolKind.FULL``/``PoolKind.SWA``), a ``PoolKind``, or the strings themselves."""
    kind = getattr(group, "kind", group)
    name = getattr(kind, "name", kind)
    if isinstance(name, str) and name.lower() in ("full", "swa"):
        return name.lower()
    raise ValueError(f"unknown KV canary pool kind {kind!r}; expected PoolKind.FULL or PoolKind.SWA")


def observe_verified(reporter: Any, group: Any, verify_num_valid: "torch.Tensor | int") -> None:
    """Add the KV entries verified by one canary plan to ``reporter`` (after each plan).

    Args:
        reporter: an :class:`otel_swa.reporter.SwaDivergenceReporter`.
        group: the plan's buffer group (``.kind`` is ``PoolKind.FULL`` or ``PoolKind.SWA``), a
            ``PoolKind``, or ``"full"``/``"swa"``.
        verify_num_valid: SGLang's ``VerifyPlan.verify_num_valid``: an integer device tensor of
            shape ``[1]`` (or ``[]``), or a Python int. Added in place on the device through a view:
            no sync, safe inside CUDA graph capture.

    Raises:
        ValueError: unknown pool kind, or a tensor with more than one element.
    """
    count = verify_num_valid
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(
                f"verify_num_valid must hold one count, got shape {tuple(count.shape)}"
            )
        count = count.reshape(())
    reporter.observe(_pool_of_group(group), count)


def log_line_sink(logger: "logging.Logger | None" = None, level: int = logging.INFO) -> LogLineSink:
    """A reporter sink that logs each record's line (``otel_swa[verify=...] kv_canary_swa_divergence={...}``).

    A :class:`otel_swa.logline.LogLineSink`: the messages are
    :meth:`otel_swa.record.SwaDivergenceRecord.lines` (the tagged line, the record part byte for byte
    the line SGLang's reporter logs, then its audit line when audited), after one run start marker;
    log greps and SGLang's ``SwaDivergenceLog.find_all`` read them unchanged. Default logger:
    SGLang's (``sglang.srt.kv_canary.runner.swa_divergence``), so the engine's log handlers apply.
    """
    return LogLineSink(logger if logger is not None else logging.getLogger(SGLANG_LOGGER_NAME), level)


class KvCanaryHooks:
    """Drop-in for SGLang's KV-canary ``SwaDivergenceReporter``, backed by an otel-swa reporter.

    Same call points and keyword arguments as SGLang's class (sglang 0.5.23,
    ``srt/kv_canary/runner/swa_divergence.py``), so the canary manager can hold either.

    Args:
        reporter: an :class:`otel_swa.reporter.SwaDivergenceReporter` (its sinks receive the
            records; add :func:`log_line_sink` for SGLang's log line).
        swa_allocator: SGLang's ``SWATokenToKVPoolAllocator``, or ``None`` (then every sample
            reports 0 divergence and 0 out-of-window tokens, as SGLang does).
        req_to_token_pool: SGLang's ``ReqToTokenPool`` (needed with an allocator).

    Sampling: the reporter samples when its own forward count is a non-zero multiple of its
    interval; SGLang samples on ``outer_step_counter``. Both count the calls to ``step`` from 1,
    so they agree when the hooks are created with the canary manager (as SGLang creates its
    reporter).

        holder_full_slots: a zero-argument callable returning the FULL slots of every token a live
            holder reads (see :func:`scheduler_holder_full_slots`), or ``None`` when they cannot be
            had at that moment; called at sampling steps only. With it, samples carry the SWA slot
            audit; a sample whose holders are ``None`` (or while a free group is open) is not
            audited, never audited against an incomplete list (that would report false leaks).
        sliding_window, swa_eviction_allowance: the window check of every view (see
            :func:`batch_view` and :func:`sglang_window`), or ``None``.
        token_ids: a zero-argument callable returning each request's token ids for the batch being
            sampled (:func:`request_token_ids`), or ``None``; called at sampling steps only.
        sweep_full_slots: a zero-argument callable returning the FULL slots the provenance check
            sweeps beyond the batch (:func:`scheduler_prefix_cache_full_slots`), or ``None``; the
            reporter calls it at the first sample of each sweep pass.

    Raises:
        ValueError: an allocator without a ``req_to_token_pool``.
    """

    def __init__(
        self,
        reporter: Any,
        *,
        swa_allocator: Any = None,
        req_to_token_pool: Any = None,
        holder_full_slots: "Callable[[], torch.Tensor | None] | None" = None,
        sliding_window: int | None = None,
        swa_eviction_allowance: int | None = None,
        token_ids: "Callable[[], Sequence[Any] | None] | None" = None,
        sweep_full_slots: "Callable[[], torch.Tensor | None] | None" = None,
    ) -> None:
        if swa_allocator is not None and req_to_token_pool is None:
            raise ValueError("KvCanaryHooks: swa_allocator given without req_to_token_pool")
        self.reporter = reporter
        self._swa_allocator = swa_allocator
        self._req_to_token_pool = req_to_token_pool
        self._holders = holder_full_slots
        self._window = {"sliding_window": sliding_window, "swa_eviction_allowance": swa_eviction_allowance}
        self._token_ids = token_ids
        self._sweep = sweep_full_slots
        #: Errors caught in :meth:`step` (building or sampling the view), never raised to SGLang.
        self.step_errors = 0
        self._logged_error_kinds: set[str] = set()

    @property
    def verify_total_count_device(self) -> torch.Tensor:
        """Running totals of verified entries, ``int64 [2]`` (FULL, SWA) on the reporter's device.

        SGLang's own counter is ``int32 [2]``; the values are the same until ``2**31``. This is the
        reporter's device accumulator itself (``device_totals``), which SGLang's canary manager may
        read inside its CUDA graph.
        """
        return self.reporter.device_totals

    def observe_after_invoke_plan(self, *, group: Any, verify_plan: Any) -> None:
        """After each canary plan: add ``verify_plan.verify_num_valid`` to ``group``'s pool."""
        observe_verified(self.reporter, group, verify_plan.verify_num_valid)

    def step(self, *, outer_step_counter: int, maybe_inaccurate_forward_batch: Any = None, context: Any = None,
             micro_batch: int | None = None) -> None:
        """Once per outer step, after the forward: count it and, at sampling steps, sample the batch.

        ``outer_step_counter`` is accepted for signature compatibility (see the class docstring).
        ``micro_batch``: the pipeline micro-batch of this forward step (:func:`scheduler_micro_batch`),
        handed to ``reporter.step``.
        SGLang's canary manager calls this inside its forward, so nothing raised while building the
        view or sampling it reaches the engine: the error is counted in :attr:`step_errors` and
        logged with its traceback once per exception type.
        """
        try:
            # The reporter calls the factory only at sampling steps: the other steps cost one increment.
            self.reporter.step(lambda: self._view(maybe_inaccurate_forward_batch), context, micro_batch=micro_batch)
        except Exception as exc:  # telemetry never breaks the forward
            self.step_errors += 1
            kind = type(exc).__name__
            if kind not in self._logged_error_kinds:
                self._logged_error_kinds.add(kind)
                _log.exception(
                    "SWA divergence sample failed at forward step %d (%s); the forward goes on, "
                    "later %s errors are only counted (KvCanaryHooks.step_errors)",
                    self.reporter.forward_ct, kind, kind,
                )

    def _view(self, forward_batch: Any) -> SwaBatch:
        if self._swa_allocator is None:
            return _empty_view(self.reporter.device)
        extra = dict(self._window)
        if self._token_ids is not None:
            extra["token_ids"] = self._token_ids()
        if self._sweep is not None:
            extra["sweep_full_slots"] = self._sweep
        if self._holders is not None:
            try:  # the holders are listed by the reporter's audit, only at the first sample of a pass
                return batch_view(self._swa_allocator, self._req_to_token_pool, forward_batch,
                                  holder_full_slots=self._holders, **extra)
            except RuntimeError as exc:  # no consistent SWA free list right now: this sample is not audited
                _log.debug("SWA slot audit skipped at forward step %d: %s", self.reporter.forward_ct, exc)
            except TypeError as exc:  # an allocator without SGLang's SWA free lists: no audit at all
                self._holders = None
                _log.warning("SWA slot audit off for this model runner: %s", exc)
        return batch_view(self._swa_allocator, self._req_to_token_pool, forward_batch, **extra)

    def close(self) -> None:
        """Deliver every pending sample (SGLang's reporter loses the last one at shutdown)."""
        self.reporter.close()


def _empty_view(device: torch.device) -> SwaBatch:
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return SwaBatch(
        req_to_token=torch.zeros((1, 1), dtype=torch.int32, device=device),
        full_to_swa_index_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        req_pool_indices=empty,
        seq_lens=empty,
        seq_lens_cpu=(),
    )


# ---------------------------------------------------------------------------------- leak / stale audit


def _live_full_slots(
    req_to_token: torch.Tensor, req_pool_indices: Sequence[int], seq_lens: Sequence[int]
) -> torch.Tensor:
    if len(req_pool_indices) != len(seq_lens):
        raise ValueError(
            f"req_pool_indices has {len(req_pool_indices)} entries but seq_lens has {len(seq_lens)}"
        )
    num_rows, width = req_to_token.shape
    rows, lens = [int(r) for r in req_pool_indices], [int(n) for n in seq_lens]
    for row, length in zip(rows, lens):
        if not 0 <= row < num_rows:
            raise ValueError(f"req_pool_index {row} is outside req_to_token's {num_rows} rows")
        if not 0 <= length <= width:
            raise ValueError(f"seq_len {length} is outside [0, max_context_len={width}]")
    device = req_to_token.device
    lens_tensor = torch.tensor(lens, dtype=torch.int64)
    # With host lengths the gather is exactly the live tokens, and every row is in range (checked
    # above), so the mask selects them all.
    slots, _ = live_full_slots(
        req_to_token, torch.tensor(rows, dtype=torch.int64, device=device), lens_tensor.to(device),
        seq_lens_cpu=lens_tensor,
    )
    return slots


def swa_free_pages(allocator: Any) -> tuple[torch.Tensor, int]:
    """The SWA pool's free pages and its page count, read from SGLang's allocator: the lists of
    :func:`swa_free_page_lists` in one ``int64`` tensor (a copy).

    Returns:
        ``(free_page_ids int64 [k], num_pages)``.

    Raises:
        TypeError, RuntimeError: see :func:`swa_free_page_lists`.
    """
    lists, num_pages = swa_free_page_lists(allocator)
    if not lists:
        return torch.zeros(0, dtype=torch.int64, device=allocator.full_to_swa_index_mapping.device), num_pages
    return torch.cat([t.long() for t in lists]), num_pages


def swa_free_page_lists(allocator: Any) -> "tuple[tuple[torch.Tensor, ...], int]":
    """The SWA pool's free lists as SGLang keeps them (no copy) and its page count.

    For ``page_size == 1`` SGLang's ``TokenToKVPoolAllocator`` keeps free slots in ``free_pages``
    and, with ``need_sort``, ``release_pages``; the paged allocator keeps free page ids in
    ``free_pages`` and ``staged_pages`` (a list of tensors). Pool ids run ``1 .. size`` (page 1) or
    ``1 .. num_pages``. sglang 0.5.23 never writes into these tensors: every allocation and free
    replaces them (a slice, a ``torch.cat``, a sort), so the audit may read them over several
    samples (:class:`otel_swa.device.audit.SwaAuditSweep`).

    Returns:
        ``(free lists: 1-D int tensors, num_pages)``; empty lists left out.

    Raises:
        TypeError: not an SGLang SWA allocator.
        RuntimeError: a free group is open (frees are held back until ``free_group_end``), or the
            allocator uses the per-request SWA ring, which has no SWA free list.
    """
    if getattr(allocator, "swa_req_ring", False):
        raise RuntimeError("the per-request SWA ring has no SWA free list to audit")
    if getattr(allocator, "free_group", None) is not None:
        raise RuntimeError("a free group is open on the allocator; audit between free_group_end and the next begin")
    swa = _attr(allocator, "swa_attn_allocator", "allocator")
    page_size = int(_attr(allocator, "page_size", "allocator"))
    lists = [_attr(swa, "free_pages", "SWA allocator")]
    if page_size == 1:
        release = getattr(swa, "release_pages", None)
        if release is not None:
            lists.append(release)
        num_pages = int(swa.size)
    else:
        lists.extend(getattr(swa, "staged_pages", ()) or ())
        num_pages = int(swa.num_pages)
    return tuple(t.reshape(-1) for t in lists if t.numel()), num_pages


def audit_sglang_swa_slots(
    allocator: Any,
    req_to_token_pool: Any,
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    *,
    held_full_slots: torch.Tensor | None = None,
) -> SwaSlotAudit:
    """:func:`audit_swa_slots` over SGLang's objects.

    Args:
        allocator: SGLang's ``SWATokenToKVPoolAllocator``.
        req_to_token_pool: SGLang's ``ReqToTokenPool``.
        req_pool_indices, seq_lens: the rows and live lengths of EVERY request that holds KV (not
            just one forward batch), as host ints.
        held_full_slots: FULL slots held outside requests (the prefix cache's), ``int [m]``.

    Raises:
        TypeError, RuntimeError: see :func:`swa_free_pages`; ValueError: see :func:`audit_swa_slots`.
    """
    free, num_pages = swa_free_pages(allocator)
    req_to_token = _attr(req_to_token_pool, "req_to_token", "req_to_token_pool")
    live = _live_full_slots(req_to_token, list(req_pool_indices), list(seq_lens))
    if held_full_slots is not None:
        live = torch.cat([live, held_full_slots.to(device=live.device, dtype=torch.int64).reshape(-1)])
    return audit_swa_slots(allocator.full_to_swa_index_mapping, free, num_pages, int(allocator.page_size), live)


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


def scheduler_holder_full_slots(scheduler: Any, batch: Any = None) -> torch.Tensor | None:
    """The FULL slots of every token a live holder of SGLang's KV cache reads, from its ``Scheduler``.

    Holders (sglang 0.5.23): every request with a ``req_to_token`` row (``req.kv.req_pool_idx``),
    over its first ``req.kv.kv_allocated_len`` positions, found in ``batch`` (the batch being run),
    ``scheduler.cur_batch``, ``last_batch``, ``running_batch``, the batches whose results are still
    queued (``result_queue``: the overlap scheduler releases a finished request only after the
    next forward), ``chunked_req`` and ``waiting_queue``, plus the sessions' rows (``tree_cache.session_records()``) and the prefix
    cache's own slots (``tree_cache.all_values_flatten()``: the radix tree's nodes, evictable or
    locked). Host work only (Python over the requests, one gather per request row); call it at
    sampling steps, not every step.

    Returns:
        ``int64 [n]`` on the KV device (duplicates possible: a request's prefix is also in the tree),
        or ``None`` when some allocated ``req_to_token`` row belongs to no request found above: the
        list would be incomplete, and an audit against it would report false leaks.

    Raises:
        TypeError: ``scheduler`` lacks ``req_to_token_pool``.
    """
    pool = _attr(scheduler, "req_to_token_pool", "scheduler")
    requests: dict[int, Any] = {}
    # with the overlap scheduler, the previous batch's requests are released only after this
    # forward, when its result (queued with a copy of the batch) is processed
    queued = [entry[0] for entry in getattr(scheduler, "result_queue", None) or ()]
    for source in (batch, getattr(scheduler, "cur_batch", None), getattr(scheduler, "last_batch", None),
                   getattr(scheduler, "running_batch", None), *queued):
        for req in getattr(source, "reqs", None) or ():
            requests[id(req)] = req
    for req in [getattr(scheduler, "chunked_req", None), *(getattr(scheduler, "waiting_queue", None) or ())]:
        if req is not None:
            requests[id(req)] = req
    lengths: dict[int, int] = {}
    records = [getattr(req, "kv", None) for req in requests.values()]
    tree = getattr(scheduler, "tree_cache", None)
    sessions = getattr(tree, "session_records", None)
    if callable(sessions):
        records.extend(sessions().values())
    for kv in records:
        row = getattr(kv, "req_pool_idx", None)
        if row is not None:
            lengths[int(row)] = max(lengths.get(int(row), 0), int(kv.kv_allocated_len))
    free = pool.free_slots
    free_rows = set(free.tolist() if isinstance(free, torch.Tensor) else free)
    allocated = set(range(1, int(pool.size) + 1)) - free_rows
    if not allocated.issubset(lengths):
        return None
    req_to_token = pool.req_to_token
    parts = []
    held = [(row, length) for row, length in lengths.items() if length > 0]
    if held:  # every row's first positions in one gather: flat index row * stride + position
        rows = np.fromiter((row for row, _ in held), dtype=np.int64, count=len(held))
        lens = np.fromiter((length for _, length in held), dtype=np.int64, count=len(held))
        index = np.repeat(rows * req_to_token.stride(0) - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        flat = req_to_token if req_to_token.is_contiguous() else req_to_token.contiguous()
        parts.append(flat.view(-1).index_select(0, torch.from_numpy(index).to(req_to_token.device)).long())
    values = getattr(tree, "all_values_flatten", None)
    if callable(values):
        parts.append(values().reshape(-1).to(req_to_token.device, torch.int64))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=req_to_token.device)
    return torch.cat(parts)


# ---------------------------------------------------------------------------------- pool usage


def scheduler_pool_usage(scheduler: Any) -> "tuple[PoolUsage, ...] | None":
    """How full SGLang's KV pools are, computed as SGLang computes its own pool gauges.

    The computation of sglang 0.5.23's ``SchedulerPoolStatsObserver.get_pool_stats``
    (``managers/scheduler_components/pool_stats_observer.py``), whose fields become the Prometheus
    gauges ``sglang:kv_/swa_ used/available/evictable _tokens`` and ``full_/swa_token_usage``:

    * hybrid SWA (``scheduler.is_hybrid_swa``): ``(capacity, available)`` of each pool from the
      allocator's ``swa_capacity_and_available(full_capacity=scheduler.full_tokens_per_layer,
      swa_capacity=scheduler.swa_tokens_per_layer)``; evictable from the tree cache's
      ``full_evictable_size()`` / ``swa_evictable_size()`` (0 for the SWA pool under the
      per-request SWA ring, ``allocator.swa_req_ring``); ``used = capacity - (available +
      evictable)``; an empty pool (capacity 0) reports 0 used and 0 available;
    * otherwise, one FULL pool: ``allocator.available_size()``, ``tree_cache.evictable_size()``,
      capacity ``scheduler.max_total_num_tokens x scheduler.kv_shard_widening``;
    * hybrid SSM without SWA (``scheduler.is_hybrid_ssm``, mamba state pools): ``None``, not read.

    Host work only: the allocator's free-list lengths and the tree cache's counters, no device
    tensor is read. Call it between the scheduler's updates (e.g. the metric collection) or from
    another thread: the figures are then those of one moment give or take an update in flight.

    Returns:
        ``(full, swa)`` for hybrid SWA, ``(full,)`` otherwise, in tokens; ``None`` for hybrid SSM.

    Raises:
        TypeError: ``scheduler`` lacks SGLang's attributes (the message names the missing one).
        ValueError: the figures are inconsistent (available + evictable above capacity: HiSparse's
            transient over-release, which SGLang's gauges clamp to 0 used); that read gives nothing.
    """
    allocator = _attr(scheduler, "token_to_kv_pool_allocator", "scheduler")
    tree = _attr(scheduler, "tree_cache", "scheduler")
    if getattr(scheduler, "is_hybrid_swa", False):
        (full_cap, full_avail), (swa_cap, swa_avail) = allocator.swa_capacity_and_available(
            full_capacity=_attr(scheduler, "full_tokens_per_layer", "scheduler"),
            swa_capacity=_attr(scheduler, "swa_tokens_per_layer", "scheduler"),
        )
        full_evict = int(tree.full_evictable_size())
        swa_evict = 0 if getattr(allocator, "swa_req_ring", False) else int(tree.swa_evictable_size())
        return (
            _pool(POOL_FULL, int(full_cap), int(full_avail), full_evict),
            _pool(POOL_SWA, int(swa_cap), int(swa_avail), swa_evict),
        )
    if getattr(scheduler, "is_hybrid_ssm", False):
        return None
    capacity = int(_attr(scheduler, "max_total_num_tokens", "scheduler")) * int(getattr(scheduler, "kv_shard_widening", 1))
    return (_pool(POOL_FULL, capacity, int(allocator.available_size()), int(tree.evictable_size())),)


def _pool(pool: str, capacity: int, available: int, evictable: int) -> PoolUsage:
    if not capacity:  # SGLang: an empty pool counts 0 used and 0 available
        return PoolUsage(pool, 0, 0, evictable, 0)
    return PoolUsage.from_free(pool, total=capacity, available=available, evictable=evictable)


# ---------------------------------------------------------------------------------- provenance


def provenance_layout(kv_pool: Any) -> "dict[str, Any] | None":
    """Where the KV's provenance of an SGLang ``SWAKVPool`` lives (sglang 0.5.23
    ``srt/mem_cache/swa_memory_pool.py``): its slots per pool and the layers that matter.

    ``kv_pool.full_kv_pool`` / ``swa_kv_pool`` each hold one K and one V buffer per layer of their
    kind (``k_buffer[i]``: ``[slots, heads, head_dim]``, indexed by FULL slot, resp. by SWA slot
    ``full_to_swa_index_mapping[full_slot]``); ``layers_mapping`` maps a model layer id to ``(index
    in its sub-pool, is_swa)``. The checksum's designated layer of each pool is the one at index 0 of
    its sub-pool, the layer whose K/V bytes SGLang's KV canary hashes (``--kv-canary-real-data``,
    ``srt/kv_canary/pool_patcher/adapters/swa.py``: ``k_buffer[0]`` of each sub-pool), so that a
    byte the canary's self-tests flip there is one otel-swa hashed too.

    Returns:
        ``{"full_slots", "swa_slots", "checksum_layers": {"full": id, "swa": id}, "first_layer",
        "swa_layers": frozenset}`` (``first_layer``: the lowest model layer id of the pool, the
        attention layer that runs first in a forward step), or ``None`` when ``kv_pool`` is not an
        ``SWAKVPool`` of K/V buffers (MLA, quantized, another layout): no provenance then.
    """
    mapping = getattr(kv_pool, "layers_mapping", None)
    try:
        full = int(kv_pool.full_kv_pool.k_buffer[0].shape[0])
        swa = int(kv_pool.swa_kv_pool.k_buffer[0].shape[0])
        layers = {int(layer): (int(index), bool(is_swa)) for layer, (index, is_swa) in mapping.items()}
    except (AttributeError, TypeError, IndexError, ValueError):
        return None
    if not layers:
        return None
    designated = {("swa" if is_swa else "full"): layer for layer, (index, is_swa) in layers.items() if index == 0}
    return {
        "full_slots": full, "swa_slots": swa, "checksum_layers": designated, "first_layer": min(layers),
        "swa_layers": frozenset(layer for layer, (_, is_swa) in layers.items() if is_swa),
    }


#: Settings under which SGLang fills KV cache slots without a forward step (sglang 0.5.23 names):
#: ``(server argument, runtime-context bag, the values under which the forward step writes every
#: slot, what fills the slots otherwise)``.
_KV_FILLED_OUTSIDE_FORWARD = (
    ("enable_hierarchical_cache", "memory", (False,), "HiCache loads KV back from the host"),
    ("enable_lmcache", "memory", (False,), "LMCache loads KV from its store"),
    ("enable_unified_memory", "memory", (False,), "unified memory compacts KV pages by copying them"),
    ("disaggregation_mode", "disagg", ("null", "prefill"), "a disaggregated decode receives the prefill's KV"),
)


def kv_filled_outside_forward(runner: Any) -> "str | None":
    """Why SGLang may fill ``runner``'s KV cache slots without a forward step, or ``None``.

    Such slots hold KV whose provenance the stamps do not follow (the forward step writes them, and a
    load-back or transfer moves bytes only): HiCache (``--enable-hierarchical-cache``), LMCache
    (``--enable-lmcache``), unified memory (``--enable-unified-memory``: its compaction moves KV
    pages per sub-pool, ``UnifiedMHATokenToKVPool.move_kv_cache``), a disaggregated decode instance
    (``--disaggregation-mode decode``; a prefill instance computes its KV itself).
    Read from the model runner's ``server_args`` (sglang 0.5.23 ``ModelRunner.server_args``), else
    from SGLang's runtime context (``sglang.srt.runtime_context.get_memory()`` / ``get_disagg()``);
    a setting that cannot be read counts as off.

    Returns:
        the first such setting in words (``"HiCache loads KV back from the host"``), or ``None``.
    """
    args = getattr(runner, "server_args", None)
    for name, bag, written, what in _KV_FILLED_OUTSIDE_FORWARD:
        value = getattr(args, name, None) if args is not None else None
        if value is None:
            try:
                from sglang.srt import runtime_context

                value = getattr(getattr(runtime_context, f"get_{bag}")(), name, None)
            except Exception:  # not published in this process, or another SGLang
                value = None
        value = getattr(value, "value", value)  # an enum (DisaggregationMode) by its value
        if value is not None and value not in written and value != "":
            return what
    return None


def scheduler_prefix_cache_full_slots(scheduler: Any) -> "torch.Tensor | None":
    """The FULL slots SGLang's prefix cache holds (``scheduler.tree_cache.all_values_flatten()``: the
    radix tree's nodes, evictable or locked; sglang 0.5.23 ``srt/mem_cache/``), ``int64`` on the KV
    device, for the provenance check's sweep; ``None`` without a tree cache that lists them (the
    chunk cache of ``disable_radix_cache``). Host work: a walk of the tree (call it once per sweep
    pass, not every step)."""
    values = getattr(getattr(scheduler, "tree_cache", None), "all_values_flatten", None)
    if not callable(values):
        return None
    slots = values()
    return slots.reshape(-1).to(torch.int64) if isinstance(slots, torch.Tensor) else None


def request_token_ids(schedule_batch: Any, batch_size: int) -> "list | None":
    """Each request's token ids for the provenance check, from SGLang's ``ScheduleBatch`` (the batch
    whose forward step is being sampled; its ``reqs`` are in the forward batch's order): per request
    ``origin_input_ids`` (the prompt, a list) then ``output_ids`` (the generated tokens, an
    ``array("q")``), joined without a copy (:class:`otel_swa.views.base.JoinedTokenIds`). With the
    overlap scheduler the last generated token is still on the device when the next step runs: that
    request's ids are then one short of its ``seq_len`` and its slots are counted unchecked.

    Host work: one small object per request; the ids themselves are read only for the positions a
    sample verifies. Returns ``None`` when the batch has no ``reqs`` or not ``batch_size`` of them.
    """
    from otel_swa.views.base import JoinedTokenIds

    reqs = getattr(schedule_batch, "reqs", None)
    if reqs is None or len(reqs) != batch_size:
        return None
    return [JoinedTokenIds(req.origin_input_ids, req.output_ids) for req in reqs]


def swa_kv_bytes_per_token(kv_pool: Any) -> "int | None":
    """KV bytes one token takes in all the sliding-window layers of SGLang's ``SWAKVPool``.

    ``layer_num x head_num x (head_dim + v_head_dim) x store_dtype.itemsize`` of its
    ``swa_kv_pool`` (an ``MHATokenToKVPool``: one K and one V row per token and layer; the per-token
    scales of FP8/FP4 pools are not counted). ``kv_pool`` is the allocator's ``get_kvcache()`` (or
    ``ModelRunner.token_to_kv_pool``). Reads attributes only.

    Returns:
        bytes per token (int >= 1), or ``None`` when ``kv_pool`` has no SWA pool of that kind
        (not a hybrid SWA model, or an MLA-style SWA pool without K/V heads).
    """
    swa = getattr(kv_pool, "swa_kv_pool", None)
    try:
        layers, heads = int(swa.layer_num), int(swa.head_num)
        dims = int(swa.head_dim) + int(swa.v_head_dim)
        itemsize = int(swa.store_dtype.itemsize)
    except (AttributeError, TypeError, ValueError):
        return None
    size = layers * heads * dims * itemsize
    return size if size > 0 else None
