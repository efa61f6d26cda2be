"""SGLang's KV-canary hook points: :class:`KvCanaryHooks`, the drop-in for the canary's
``SwaDivergenceReporter`` (sglang 0.5.23 ``srt/kv_canary/runner/swa_divergence.py``), the count of
entries each canary plan verified, and the sink that logs SGLang's line."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from otel_swa.logline import LogLineSink
from otel_swa.views.base import SwaBatch
from otel_swa.views.sglang_batch import batch_view

#: SGLang's logger name for the line (``sglang/srt/kv_canary/runner/swa_divergence.py``).
SGLANG_LOGGER_NAME = "sglang.srt.kv_canary.runner.swa_divergence"

_log = logging.getLogger("otel_swa.views.sglang")


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
