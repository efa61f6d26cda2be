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

The adapter's parts, one concern a module: the forward step's view (:mod:`otel_swa.views.sglang_batch`),
the KV-canary hooks (:mod:`otel_swa.views.sglang_canary`), the pools (free lists, usage, bytes per
token: :mod:`otel_swa.views.sglang_pools`), the SWA slot audit's holders
(:mod:`otel_swa.views.sglang_holders`) and what provenance reads (:mod:`otel_swa.views.sglang_provenance`).
Every name below is importable from here.
"""

from __future__ import annotations

from otel_swa.device.audit import SwaSlotAudit, audit_swa_slots
from otel_swa.views.sglang_batch import batch_view, scheduler_micro_batch, sglang_window
from otel_swa.views.sglang_canary import (  # noqa: F401 (SGLANG_LOGGER_NAME: importable here, as before)
    SGLANG_LOGGER_NAME, KvCanaryHooks, log_line_sink, observe_verified,
)
from otel_swa.views.sglang_holders import audit_sglang_swa_slots, scheduler_holder_full_slots
from otel_swa.views.sglang_pools import (
    SUPPORTED_SGLANG, scheduler_pool_usage, swa_free_page_lists, swa_free_pages, swa_kv_bytes_per_token,
)
from otel_swa.views.sglang_provenance import (
    kv_filled_outside_forward, provenance_layout, request_token_ids, scheduler_prefix_cache_full_slots,
)

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
