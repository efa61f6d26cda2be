"""vLLM adapter: the SWA KV cache of vLLM's v1 engine, mapped onto what otel-swa reports.

vLLM keeps no FULL-to-SWA slot mapping. Each KV cache group has its own block table; the sliding
window group's ``SlidingWindowManager`` (``vllm/v1/core/single_type_kv_cache_manager.py``) keeps
it in ``req_to_blocks`` (request id -> list of ``KVCacheBlock``), frees the blocks that left the
window to the shared ``BlockPool`` and puts the pool's null block (``BlockPool.null_block``: one
shared object, ``block_id`` 0, ``is_null`` True) in their place.

What maps, per live request of ``n`` tokens (``Request.num_computed_tokens``), over the first
``ceil(n / block_size)`` entries of its SWA block table:

* ``swa_out_of_window_tokens``: the tokens whose block is the null block (the last entry counts
  only the tokens below ``n``);
* SWA entries: ``n - out_of_window``, the tokens held in real SWA blocks; FULL entries: ``n``
  (what :func:`observe_counts` gives the reporter's ``observe``);
* ``swa_full_idx_divergence``: not applicable. There is no second index to diverge from.
  :class:`WindowCounts` carries ``None``. Through the reporter the field is 0 by construction,
  because SGLang's line holds integers only; the views set ``divergence_applicable=False``, so
  each record says so and the telemetry emits no ``kv_cache.swa.tokens.divergent`` data point
  (the event carries ``kv_cache.swa.divergence_applicable=false``) rather than a misleading 0.

Every count here is read from the block table itself, never from vLLM's formula
(:func:`num_skipped_tokens`). In vLLM 0.33 the two differ: ``allocate_slots`` frees blocks on the
tokens already processed when a step's slots are allocated (``num_computed_tokens -
num_in_flight_tokens`` before the step), a point at least the step's own tokens behind the one
the formula gives for the request's tokens, so the table holds up to that many more tokens (in
whole blocks); and a prefix-cache hit puts null entries at the head of a new request's table at
admission, for blocks it never held.

Two ways in:

* from the manager (what the ``swa_vllm`` instrumentor uses): :func:`read_window_table` reads
  the tables of a batch once, in host Python, and gives both the counts and the reporter's view
  (:meth:`WindowTable.view`), so a sampling step reads no block twice;
* from a block-id tensor (a table a caller already holds, e.g. a worker's):
  :func:`block_table_from_manager`, :func:`window_counts` and :func:`batch_view`.

The whole pool, beside the batch: :func:`kv_block_audit_inputs` (the KV block audit's inputs:
the ``BlockPool``'s free queue, the prefix cache's blocks, every group's tables) and
:func:`kv_cache_pool_usage` (the pool gauges, free counted as vLLM's ``get_usage()`` counts it);
:func:`window_allowance` gives the window check vLLM's own trimming. Whose KV the blocks hold (the
prefix cache's keys and the tables' block hashes against the requests' own): the block-hash
provenance check, :mod:`otel_swa.views.vllm_block_hashes`.

Nothing here imports vLLM.
The adapter's parts: the tables read from the manager (:mod:`otel_swa.views.vllm_window`), the
view from a block-id tensor (:mod:`otel_swa.views.vllm_block_table`) and the block pool
(:mod:`otel_swa.views.vllm_block_pool`). Every name below is importable from here.
"""

from __future__ import annotations

from otel_swa.views.vllm_block_pool import (
    FreeQueueMoved, free_queue, kv_block_audit_inputs, kv_cache_pool_usage, scheduler_pool_usage,
)
from otel_swa.views.vllm_block_table import batch_view, block_mapping, block_table_from_manager, window_counts
from otel_swa.views.vllm_window import (
    NULL_BLOCK_ID, SUPPORTED_VLLM, WindowCounts, WindowTable, num_skipped_tokens, observe_counts, read_window_table,
    window_allowance,
)

__all__ = [
    "NULL_BLOCK_ID",
    "SUPPORTED_VLLM",
    "WindowCounts",
    "WindowTable",
    "num_skipped_tokens",
    "window_allowance",
    "read_window_table",
    "block_table_from_manager",
    "window_counts",
    "batch_view",
    "block_mapping",
    "observe_counts",
    "FreeQueueMoved",
    "free_queue",
    "kv_block_audit_inputs",
    "kv_cache_pool_usage",
    "scheduler_pool_usage",
]
