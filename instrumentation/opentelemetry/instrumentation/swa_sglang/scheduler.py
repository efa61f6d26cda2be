"""The SGLang instrumentor's wiring of the scheduler (``Scheduler.run_batch``): which scheduler and
``ScheduleBatch`` run on this thread, and what a sample reads from them (every holder of KV, the
prefix cache's slots, the requests' token ids, the pipeline micro-batch); the registration of the
scheduler's pools for the pool usage gauges."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from opentelemetry.instrumentation.swa_sglang import stop_paths
from opentelemetry.instrumentation.swa_sglang.attributes import POOLS_ATTRIBUTE
from opentelemetry.instrumentation.swa_sglang.process import _ranks

_log = logging.getLogger(__package__)  # the instrumentor's logger (opentelemetry.instrumentation.swa_sglang)


class SchedulerWiring:
    """The ``Scheduler.run_batch`` wrapper of :class:`~opentelemetry.instrumentation.swa_sglang.SwaSglangInstrumentor`
    and what it keeps (``self._running.scheduler`` / ``.batch``, read on the same thread)."""

    def _register_pools(self, scheduler: Any) -> None:
        """Register ``scheduler``'s pools for the pool usage gauges, once per scheduler (and let it
        answer a flush request at its exit: :func:`stop_paths.remember_scheduler`)."""
        from otel_swa.views.sglang import scheduler_pool_usage

        stop_paths.remember_scheduler(scheduler)

        registration = None
        try:
            registration = self._pools.register(scheduler_pool_usage, owner=scheduler, attributes=_ranks())
        except Exception:
            _log.exception("SGLang's KV pools are not observed (pool usage gauges)")
        scheduler.__dict__[POOLS_ATTRIBUTE] = registration

    def _holder_full_slots(self) -> Any:
        """Every live holder's FULL slots, from the scheduler running this thread's batch (``None``
        outside ``Scheduler.run_batch``, or when they cannot all be found: no audit then)."""
        from otel_swa.views.sglang import scheduler_holder_full_slots

        scheduler = getattr(self._running, "scheduler", None)
        if scheduler is None:
            return None
        return scheduler_holder_full_slots(scheduler, getattr(self._running, "batch", None))

    def _token_ids(self) -> "list | None":
        """Each request's token ids of the batch being run on this thread (``None`` outside
        ``Scheduler.run_batch``; see :func:`otel_swa.views.sglang.request_token_ids`)."""
        from otel_swa.views.sglang import request_token_ids

        batch = getattr(self._running, "batch", None)
        if batch is None:
            return None
        return request_token_ids(batch, len(batch.reqs))

    def _prefix_cache_full_slots(self) -> Any:
        """The FULL slots SGLang's prefix cache holds, from the scheduler running this thread's batch
        (``None`` outside ``Scheduler.run_batch``; :func:`otel_swa.views.sglang.scheduler_prefix_cache_full_slots`)."""
        from otel_swa.views.sglang import scheduler_prefix_cache_full_slots

        scheduler = getattr(self._running, "scheduler", None)
        return scheduler_prefix_cache_full_slots(scheduler) if scheduler is not None else None

    def _micro_batch(self) -> int | None:
        """The pipeline micro-batch of the batch being run on this thread (``None`` without a
        pipeline; see :func:`otel_swa.views.sglang.scheduler_micro_batch`)."""
        scheduler = getattr(self._running, "scheduler", None)
        if scheduler is None:
            return None
        from otel_swa.views.sglang import scheduler_micro_batch

        return scheduler_micro_batch(scheduler, getattr(self._running, "batch", None))

    def _wrap_run_batch(self, original: Callable) -> Callable:
        running = self._running
        instrumentor = self

        @functools.wraps(original)
        def run_batch(scheduler, batch, *args, **kwargs):
            if POOLS_ATTRIBUTE not in scheduler.__dict__:
                instrumentor._register_pools(scheduler)
            running.scheduler, running.batch = scheduler, batch
            try:
                return original(scheduler, batch, *args, **kwargs)
            finally:
                running.scheduler = running.batch = None

        return run_batch
