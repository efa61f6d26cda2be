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
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from otel_swa.pool_usage import POOL_FULL, POOL_SWA, PoolUsage
from otel_swa.views.base import BlockHashFindings, KvBlockAuditInputs, SwaBatch
from otel_swa.views.vllm_block_hashes import good_entry

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

#: The null block's id in vLLM's ``BlockPool`` (the pool reserves block 0 for it).
NULL_BLOCK_ID = 0

#: The vLLM versions whose v1 KV cache manager has the structures read here (pip specifier). The
#: lower bound is the version this adapter was run against (0.33.0's real ``KVCacheManager`` and
#: ``Scheduler``); older versions were not tested.
SUPPORTED_VLLM = "vllm >= 0.33.0, < 0.34"

_BLOCK_ID = operator.attrgetter("block_id")


def num_skipped_tokens(num_computed_tokens: int, sliding_window: int, extra_retained_tokens: int = 0) -> int:
    """vLLM 0.33's ``SlidingWindowManager.get_num_skipped_tokens``: the tokens before the window.

    ``max(0, num_computed_tokens - sliding_window + 1 - extra_retained_tokens)``, where
    ``extra_retained_tokens`` is the ``SlidingWindowSpec`` field (trailing tokens kept below the
    window for multi-module speculative decoding; 0 otherwise). This is the formula vLLM frees by,
    not a count of the table: the table's null entries lag it (see the module docstring).

    Raises:
        ValueError: ``sliding_window`` below 1, or a negative token count.
    """
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
    if extra_retained_tokens < 0:
        raise ValueError(f"extra_retained_tokens must be >= 0, got {extra_retained_tokens}")
    return max(0, num_computed_tokens - sliding_window + 1 - extra_retained_tokens)


def window_allowance(
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    num_in_flight_tokens: Sequence[int],
    *,
    block_size: int,
    sliding_window: int,
    extra_retained_tokens: int = 0,
) -> list[int]:
    """Per request, how many tokens older than the positions this step reads vLLM 0.33 keeps in
    real SWA blocks by design, read right after ``Scheduler.schedule()`` (the view's
    ``swa_eviction_allowance``, with ``extend_lens_cpu`` = ``num_scheduled_tokens``).

    After ``schedule()`` a request's ``Request.num_computed_tokens`` ``n`` and
    ``Request.num_in_flight_tokens`` ``f`` both count the ``s`` tokens scheduled in this step
    (``Scheduler._update_after_schedule``); ``f - s`` are the tokens of earlier steps still in
    flight (async scheduling: ``AsyncScheduler`` schedules a step before the previous step's output
    is in; 0 with the synchronous ``Scheduler``). The step's first query, at ``n - s``, reads from
    ``n - s - sliding_window + 1``. The table was trimmed in ``KVCacheManager.allocate_slots`` on
    the tokens processed before the step, ``n - f`` (``remove_skipped_blocks(num_computed_tokens -
    num_in_flight_tokens)``): the whole blocks below ``num_skipped_tokens(n - f, sliding_window,
    extra_retained_tokens)`` are freed, so the table holds real blocks from ``b = block_size *
    floor(num_skipped_tokens(n - f) / block_size)`` on. The allowance is ``max(0, n - s -
    sliding_window + 1 - b)``: up to ``block_size - 1`` tokens of a partly skipped block, the
    ``f - s`` tokens in flight, and the ``extra_retained_tokens`` (``SlidingWindowSpec``: kept below
    the window for multi-module speculative decoding).

    Args:
        num_computed_tokens, num_scheduled_tokens, num_in_flight_tokens: per request of the batch
            (host ints, same length): ``n``, ``s`` (``SchedulerOutput.num_scheduled_tokens``) and
            ``f`` as above.
        block_size, sliding_window, extra_retained_tokens: the sliding-window group's
            (``SlidingWindowManager.block_size``, ``.sliding_window``, ``.extra_retained_tokens``).

    Raises:
        ValueError: lengths that differ, ``block_size`` or ``sliding_window`` below 1,
            ``extra_retained_tokens`` below 0, a scheduled count below 1, or counts that contradict
            each other (``f < s``, ``n < s``).
    """
    for name, value, minimum in (("block_size", block_size, 1), ("sliding_window", sliding_window, 1),
                                 ("extra_retained_tokens", extra_retained_tokens, 0)):
        if type(value) is not int or value < minimum:  # noqa: E721
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    counts = (tuple(num_computed_tokens), tuple(num_scheduled_tokens), tuple(num_in_flight_tokens))
    if len({len(c) for c in counts}) != 1:
        raise ValueError(
            f"{len(counts[0])} computed, {len(counts[1])} scheduled and {len(counts[2])} in-flight token "
            "counts; give one of each per request"
        )
    out = []
    for n, s, f in zip(*counts):
        if any(type(x) is not int for x in (n, s, f)) or s < 1 or n < s or f < s:  # noqa: E721
            raise ValueError(
                "each request needs int counts with num_scheduled_tokens >= 1 and num_computed_tokens, "
                f"num_in_flight_tokens >= num_scheduled_tokens; got n={n!r}, s={s!r}, f={f!r}"
            )
        first_held = num_skipped_tokens(max(0, n - f), sliding_window, extra_retained_tokens) // block_size * block_size
        out.append(max(0, n - s - sliding_window + 1 - first_held))
    return out


@dataclass(frozen=True)
class WindowCounts:
    """One batch's sliding-window counts in vLLM terms (host ints, tokens).

    Attributes:
        live_tokens: sum of the requests' token counts (FULL entries).
        swa_entries: tokens whose SWA block is a real block (SWA entries).
        swa_out_of_window_tokens: tokens whose SWA block is the null block.
        swa_full_idx_divergence: always ``None``: not applicable to vLLM.
    """

    live_tokens: int
    swa_entries: int
    swa_out_of_window_tokens: int
    swa_full_idx_divergence: None = None


def _req_to_blocks(manager: Any) -> Any:
    try:
        return manager.req_to_blocks
    except AttributeError:
        raise TypeError(
            f"{type(manager).__name__} has no req_to_blocks; expected vLLM's SlidingWindowManager ({SUPPORTED_VLLM})"
        ) from None


def _block_size(manager: Any) -> int:
    size = getattr(manager, "block_size", None)
    if type(size) is not int or size < 1:
        raise TypeError(f"{type(manager).__name__}.block_size must be an int >= 1, got {size!r}")
    return size


def _null_entries(blocks: Sequence[Any], stop: int, every_entry: bool = True) -> tuple[int, list[int]]:
    """``(head, others)`` for ``blocks[:stop]``: the length of the leading run of null entries and
    the indices of every other null entry. Each of the ``stop`` entries is checked; with
    ``every_entry=False`` the leading run's end is found by the bisection alone (``log2(stop)``
    reads; ``others`` is then empty).

    vLLM's null entries form one run at the head of the table, all the same object: the run's end
    is found by bisection on ``is_null`` and confirmed by an identity count over the run (a C-speed
    scan); the entries after it are read one by one (``is_null``). A head that fails the
    confirmation is read entry by entry too.
    """
    head = 0
    if stop and blocks[0].is_null:
        lo, hi = 1, stop
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid].is_null:
                lo = mid + 1
            else:
                hi = mid
        if not every_entry:
            return lo, []
        if blocks[:lo].count(blocks[0]) == lo:
            head = lo
    if not every_entry:
        return head, []
    flags = [block.is_null for block in blocks[head:stop]]
    if True not in flags:
        return head, []
    return head, [head + i for i, null in enumerate(flags) if null]


@dataclass(frozen=True)
class WindowTable:
    """One read of the SWA block tables of a batch (see :func:`read_window_table`). Host values.

    Attributes:
        request_ids: the batch's requests, in order.
        num_tokens: live tokens per request.
        block_size: tokens per block of the SWA group.
        null_heads: per request, how many of the blocks covering its tokens (``ceil(n /
            block_size)`` entries) lead the table as one null-block object (0 when the leading
            null entries are not all that object).
        other_nulls: ``(request index, block index)`` of every other null entry among those
            blocks (none in vLLM 0.33's own tables).
        counts: the batch's :class:`WindowCounts`.
    """

    request_ids: tuple[str, ...]
    num_tokens: tuple[int, ...]
    block_size: int
    null_heads: tuple[int, ...]
    other_nulls: tuple[tuple[int, int], ...]
    counts: WindowCounts

    def view(
        self,
        device: "str | torch.device" = "cpu",
        *,
        sliding_window: int | None = None,
        swa_eviction_allowance: "int | Sequence[int] | None" = None,
        extend_lens_cpu: "Sequence[int] | None" = None,
        kv_block_audit: "KvBlockAuditInputs | None" = None,
        kv_block_hashes: "BlockHashFindings | None" = None,
    ) -> SwaBatch:
        """The reporter's view (:class:`otel_swa.views.SwaBatch`) of this read, on ``device``.

        Built from what was read, with no second pass over the blocks: ``req_to_token`` is
        ``int64 [batch, max_blocks * block_size]``, 1 for a token whose block is real and 0 for a
        token whose block is the null block, and ``full_to_swa_index_mapping`` is ``int64 [0, 1]``,
        so the reporter counts the null-block tokens as out of window and divergence as 0, marked
        not applicable (``divergence_applicable=False``). The table is as wide as the longest
        request, so the reporter's dense masked gather over it is the cheaper one unless the
        lengths are skewed: ``seq_lens_cpu`` (the live-token gather) is given only when the table
        has more than twice as many cells as live tokens. Allocates ``batch x max_blocks x
        block_size`` int64 on ``device``; no host sync.

        ``sliding_window`` (the group's ``SlidingWindowSpec.sliding_window``: the next query reads
        its own position and the ``sliding_window - 1`` before it, ``get_num_skipped_tokens``) and
        ``swa_eviction_allowance`` (e.g. :func:`window_allowance`) switch on the window check, with
        ``extend_lens_cpu`` the step's scheduled tokens per request
        (``SchedulerOutput.num_scheduled_tokens``, host ints ``[batch]``; ``None``: 1 each): read
        after ``schedule()``, where ``num_computed_tokens`` ``n`` counts the step's own ``s``
        tokens, the step's queries read the last ``sliding_window + s - 1`` positions; a null-block
        token among them is a premature eviction; a real block held further back than the
        allowance is late-held. Block granularity is the view's: every token of a block counts.

        The view carries the batch's ``request_ids`` (a fault's first offender names its request)
        and ``kv_block_audit`` (e.g. :func:`kv_block_audit_inputs`: the KV block audit of the
        whole pool, leaked blocks and blocks freed while in use) and ``kv_block_hashes`` (what
        :class:`otel_swa.views.vllm_block_hashes.BlockHashCheck` found: stale prefix-cache entries
        and foreign blocks).
        """
        device = torch.device(device)
        batch = len(self.num_tokens)
        bs = self.block_size
        width = max((-(-n // bs) for n in self.num_tokens), default=0)
        columns = torch.arange(max(width, 1), device=device)
        heads = torch.tensor(self.null_heads, dtype=torch.int64).to(device)
        held = (columns.unsqueeze(0) >= heads.unsqueeze(1)).to(torch.int64)
        if self.other_nulls:
            rows, cols = zip(*self.other_nulls)
            held[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = 0
        return SwaBatch(
            req_to_token=held.repeat_interleave(bs, dim=1),
            full_to_swa_index_mapping=_held_mapping(device),
            req_pool_indices=torch.arange(batch, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(self.num_tokens, dtype=torch.int64).to(device),
            seq_lens_cpu=self.num_tokens if batch * width * bs > 2 * self.counts.live_tokens else None,
            divergence_applicable=False,
            sliding_window=sliding_window,
            swa_eviction_allowance=list(swa_eviction_allowance) if isinstance(swa_eviction_allowance, tuple)
            else swa_eviction_allowance,
            extend_lens_cpu=list(extend_lens_cpu) if isinstance(extend_lens_cpu, tuple) else extend_lens_cpu,
            request_ids=self.request_ids,
            kv_block_audit=kv_block_audit,
            kv_block_hashes=kv_block_hashes,
        )


@functools.lru_cache(maxsize=8)
def _held_mapping(device: torch.device) -> torch.Tensor:
    return torch.tensor([0, 1], dtype=torch.int64, device=device)


def read_window_table(
    manager: Any, request_ids: Sequence[str], num_tokens: Sequence[int], *, every_entry: bool = True
) -> WindowTable:
    """Read the SWA block tables of a batch from vLLM's ``SlidingWindowManager``.

    Reads ``manager.req_to_blocks[request_id]`` (without inserting: it is a ``defaultdict``) and
    ``manager.block_size``; for each request, the first ``ceil(n / block_size)`` entries, every one
    checked (see :class:`WindowTable`). Host Python only, no torch work; the cost per request is
    a bisection and a C-speed scan of its null run, plus one attribute read per block after it
    (the blocks inside the window and those the table has not freed yet). With
    ``every_entry=False`` only the end of the leading null run is looked for, by bisection
    (``log2`` of the request's blocks reads): exact for vLLM 0.33's tables, whose null entries are
    one leading run, and what the instrumentor reads at every step; the full read, at sampling
    steps, checks every entry (a null entry after the run, if vLLM ever made one, shows there).

    Args:
        manager: the sliding-window group's ``SlidingWindowManager``
            (``KVCacheManager.coordinator.single_type_managers``).
        request_ids: the batch's request ids.
        num_tokens: live tokens per request (``Request.num_computed_tokens``), same length.

    Raises:
        TypeError: ``manager`` lacks ``req_to_blocks`` or an int ``block_size``.
        KeyError: a request the manager holds no blocks for.
        ValueError: lengths differ, a negative token count, or a table shorter than its tokens.
    """
    req_to_blocks = _req_to_blocks(manager)
    bs = _block_size(manager)
    ids = tuple(request_ids)
    lens = tuple(int(n) for n in num_tokens)
    if len(ids) != len(lens):
        raise ValueError(f"{len(ids)} request ids but {len(lens)} token counts; they must describe one batch")
    heads: list[int] = []
    others: list[tuple[int, int]] = []
    out_of_window = 0
    for row, (request_id, n) in enumerate(zip(ids, lens)):
        blocks = req_to_blocks.get(request_id)
        if blocks is None:
            raise KeyError(f"request {request_id!r} holds no blocks in the sliding-window manager")
        if n < 0:
            raise ValueError(f"request {request_id!r} has a negative token count {n}")
        stop = -(-n // bs)
        if stop > len(blocks):
            raise ValueError(
                f"request {request_id!r} has {n} tokens but its SWA block table holds {len(blocks)} "
                f"blocks of {bs} tokens"
            )
        head, rest = _null_entries(blocks, stop, every_entry)
        heads.append(head)
        nulls = head
        if rest:
            others.extend((row, j) for j in rest)
            nulls += len(rest)
        if nulls:
            out_of_window += nulls * bs
            if blocks[stop - 1].is_null:  # the last block holds only n - (stop - 1) * bs live tokens
                out_of_window -= stop * bs - n
    live = sum(lens)
    return WindowTable(
        request_ids=ids,
        num_tokens=lens,
        block_size=bs,
        null_heads=tuple(heads),
        other_nulls=tuple(others),
        counts=WindowCounts(live_tokens=live, swa_entries=live - out_of_window, swa_out_of_window_tokens=out_of_window),
    )


def block_table_from_manager(
    manager: Any, request_ids: Sequence[str], *, device: "str | torch.device" = "cpu"
) -> torch.Tensor:
    """The SWA group's block table of ``request_ids``, read from a ``SlidingWindowManager``.

    Reads ``manager.req_to_blocks[request_id]`` (a list of ``KVCacheBlock``; ``block_id`` each),
    without inserting into it.

    Returns:
        ``int32 [len(request_ids), max_blocks]`` on ``device`` (``max_blocks`` at least 1), padded
        with the null block id.

    Raises:
        TypeError: ``manager`` has no ``req_to_blocks``.
        KeyError: a request id the manager does not hold.
    """
    req_to_blocks = _req_to_blocks(manager)
    rows = []
    for request_id in request_ids:
        blocks = req_to_blocks.get(request_id)
        if blocks is None:
            raise KeyError(f"request {request_id!r} holds no blocks in the sliding-window manager")
        rows.append(list(map(_BLOCK_ID, blocks)))
    width = max(1, max((len(r) for r in rows), default=0))
    for row in rows:
        row.extend([NULL_BLOCK_ID] * (width - len(row)))
    table = torch.tensor(rows, dtype=torch.int32) if rows else torch.zeros((0, width), dtype=torch.int32)
    return table.to(device)


def _check(block_table: torch.Tensor, num_tokens: torch.Tensor, block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [batch, max_blocks], got shape {tuple(block_table.shape)}")
    if num_tokens.dim() != 1 or num_tokens.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"num_tokens must be [batch] with batch={block_table.shape[0]}, got shape {tuple(num_tokens.shape)}"
        )


def window_counts(
    block_table: torch.Tensor,
    num_tokens: torch.Tensor,
    block_size: int,
    *,
    null_block_id: int = NULL_BLOCK_ID,
) -> WindowCounts:
    """Out-of-window and read-entry counts of a batch from the SWA group's block-id table.

    Runs on the tensors' device, block by block (``[batch, max_blocks]`` work), and synchronises
    once to return host ints.

    Args:
        block_table: ``int32``/``int64 [batch, max_blocks]``: the SWA group's block ids per request.
        num_tokens: ``int [batch]``: live tokens per request (``num_computed_tokens``).
        block_size: tokens per block of the SWA group.
        null_block_id: the null block's id (0 in vLLM).

    Raises:
        ValueError: shapes that do not describe one batch, ``block_size`` below 1, or a request
            with more tokens than its block table covers.
    """
    _check(block_table, num_tokens, block_size)
    if num_tokens.numel() and int(num_tokens.max()) > block_table.shape[1] * block_size:
        raise ValueError(
            f"a request has {int(num_tokens.max())} tokens but the block table covers "
            f"{block_table.shape[1]} blocks x {block_size} tokens"
        )
    starts = torch.arange(block_table.shape[1], device=block_table.device) * block_size
    # Live tokens of each block: block_size below n, the remainder in the last one, 0 after it.
    live = (num_tokens.long().unsqueeze(1) - starts).clamp(0, block_size)
    null = (block_table == null_block_id).long()
    live_tokens, out_of_window = torch.stack([live.sum(), (live * null).sum()]).tolist()
    return WindowCounts(
        live_tokens=live_tokens,
        swa_entries=live_tokens - out_of_window,
        swa_out_of_window_tokens=out_of_window,
    )


@functools.lru_cache(maxsize=8)
def _cached_block_mapping(num_blocks: int, null_block_id: int, device: torch.device) -> torch.Tensor:
    mapping = torch.arange(num_blocks + 1, dtype=torch.int64, device=device)
    mapping[null_block_id + 1] = 0
    return mapping


def block_mapping(num_blocks: int, null_block_id: int, device: "torch.device | str") -> torch.Tensor:
    """The FULL-to-SWA mapping of :func:`batch_view`'s view of a vLLM SWA group.

    ``int64 [num_blocks + 1]`` on ``device``: view slot ``b + 1`` (block ``b``) maps to itself,
    except the null block's, which maps to 0; slot 0 is the reserved "none" and maps to 0. Built
    once per ``(num_blocks, null_block_id, device)`` (the last 8 kept) and shared: the reporter
    only reads it, and nobody may write to it.

    Raises:
        ValueError: ``num_blocks`` below 1, or ``null_block_id`` outside ``[0, num_blocks)``.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if not 0 <= null_block_id < num_blocks:
        raise ValueError(f"null_block_id {null_block_id} is outside [0, num_blocks={num_blocks})")
    return _cached_block_mapping(int(num_blocks), int(null_block_id), torch.device(device))


def batch_view(
    block_table: torch.Tensor,
    num_tokens: torch.Tensor,
    block_size: int,
    *,
    num_blocks: int,
    null_block_id: int = NULL_BLOCK_ID,
    num_tokens_cpu: "torch.Tensor | Sequence[int] | None" = None,
) -> SwaBatch:
    """A reporter view (:class:`otel_swa.views.SwaBatch`) of a vLLM batch, from a block-id table.

    vLLM has no FULL-to-SWA mapping, so the view states only what exists: every token of block
    ``b`` gets view slot ``b + 1``, which :func:`block_mapping` maps to itself for a real block and
    to 0 for the null block. The reporter then counts null-block tokens as out of window and
    divergence as 0, marked not applicable (``divergence_applicable=False``; see the module
    docstring). Build it at sampling steps only: it allocates ``[batch, max_blocks * block_size]``
    in the table's dtype on the device (no host sync); the mapping is built once and shared.
    Reading the manager? :meth:`WindowTable.view` skips the block-id table altogether.

    Args:
        block_table, num_tokens, block_size, null_block_id: see :func:`window_counts`.
        num_blocks: blocks in vLLM's ``BlockPool`` (``num_gpu_blocks``); every id in
            ``block_table`` is below it.
        num_tokens_cpu: host copy of ``num_tokens`` (lets the reporter gather only live tokens).

    Raises:
        ValueError: see :func:`window_counts` (shape checks only, no sync), ``num_blocks`` < 1, or
            ``null_block_id`` outside ``[0, num_blocks)``.
    """
    _check(block_table, num_tokens, block_size)
    mapping = block_mapping(num_blocks, null_block_id, block_table.device)
    batch = block_table.shape[0]
    return SwaBatch(
        req_to_token=(block_table + 1).repeat_interleave(block_size, dim=1),
        full_to_swa_index_mapping=mapping,
        req_pool_indices=torch.arange(batch, dtype=torch.int64, device=block_table.device),
        seq_lens=num_tokens,
        seq_lens_cpu=num_tokens_cpu,
        divergence_applicable=False,
    )


def observe_counts(reporter: Any, counts: WindowCounts) -> None:
    """Add a batch's entries to ``reporter``: ``live_tokens`` to FULL, ``swa_entries`` to SWA."""
    reporter.observe("full", counts.live_tokens)
    reporter.observe("swa", counts.swa_entries)


# ------------------------------------------------------------------- block pool, audit, usage

#: Which managers' groups make up each pool (``type(manager).__mro__`` names, vLLM 0.33's
#: ``single_type_kv_cache_manager.py``). Other kinds (chunked local attention, Mamba, cross
#: attention, RSWA, circular buffer...) belong to neither pool.
_POOL_OF_MANAGER = {"SlidingWindowManager": POOL_SWA}
_FULL_MANAGERS = ("FullAttentionManager",)


class FreeQueueMoved(RuntimeError):
    """The free queue changed while it was walked (read from another thread than the scheduler's)."""


def _pool_of(manager: Any) -> "str | None":
    if type(manager).__name__ in _FULL_MANAGERS:
        return POOL_FULL
    for cls in type(manager).__mro__:
        if cls.__name__ in _POOL_OF_MANAGER:
            return _POOL_OF_MANAGER[cls.__name__]
    return None


def _group_id(block_hash: Any) -> int:
    """The KV cache group of a ``BlockHashWithGroupId``: its last 4 bytes, big-endian (vLLM 0.33's
    ``kv_cache_utils.make_block_hash_with_group_id``)."""
    return int.from_bytes(bytes(block_hash)[-4:], "big", signed=False)


def _parts(kv_cache_manager: Any) -> "tuple[Sequence[Any], Any]":
    """``(single_type_managers, block_pool)`` of a ``KVCacheManager``."""
    try:
        coordinator = kv_cache_manager.coordinator
        return coordinator.single_type_managers, coordinator.block_pool
    except AttributeError as exc:
        raise TypeError(
            f"{type(kv_cache_manager).__name__} is not vLLM's KVCacheManager ({SUPPORTED_VLLM}): {exc}"
        ) from None


def free_queue(block_pool: Any) -> list:
    """The blocks on vLLM's free queue (``BlockPool.free_block_queue``, a linked list through
    ``KVCacheBlock.next_free_block`` between two sentinel blocks), front first: the blocks
    ``BlockPool.get_num_free_blocks()`` and ``get_usage()`` count as free (cached ones included:
    evictable).

    Host work, one attribute read per free block, bounded by the pool's size.

    Raises:
        TypeError: not vLLM's ``BlockPool``.
        FreeQueueMoved: the walk did not end at the queue's tail within ``num_gpu_blocks`` blocks, or
            found another number of blocks than ``free_block_queue.num_free_blocks`` (the queue
            changed during the walk: read from another thread than the scheduler's).
    """
    try:
        queue = block_pool.free_block_queue
        expected = queue.num_free_blocks
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        limit = int(block_pool.num_gpu_blocks)
    except AttributeError as exc:
        raise TypeError(f"{type(block_pool).__name__} is not vLLM's BlockPool ({SUPPORTED_VLLM}): {exc}") from None
    blocks = []
    while block is not tail:
        if block is None or len(blocks) >= limit:
            raise FreeQueueMoved(f"the free queue did not end at its tail within {limit} blocks")
        blocks.append(block)
        block = block.next_free_block
    if len(blocks) != expected:
        raise FreeQueueMoved(f"walked {len(blocks)} free blocks, the queue counts {expected}")
    return blocks


def _cached_block_ids(block_pool: Any) -> list[int]:
    """Ids of the blocks the prefix cache holds (``cached_block_hash_to_block``: a
    ``BlockHashToBlockMap`` whose values are a ``KVCacheBlock`` or a dict of them by id), through
    good entries only (:func:`otel_swa.views.vllm_block_hashes.good_entry`: the key is the block's
    own hash or one of its secondary keys): a stale entry, left behind when its block was evicted,
    does not make the block cached (it would excuse an unhashed block two tables share)."""
    cache = getattr(block_pool.cached_block_hash_to_block, "_cache", None)
    if not isinstance(cache, dict):
        raise TypeError(f"BlockPool.cached_block_hash_to_block has no dict _cache; expected {SUPPORTED_VLLM}")
    secondary = getattr(block_pool, "cached_block_hashes_by_block", {})
    ids: list[int] = []
    for key, entry in list(cache.items()):
        for block in (entry.values() if isinstance(entry, dict) else (entry,)):
            if good_entry(key, block, secondary):
                ids.append(block.block_id)
    return ids


def kv_block_audit_inputs(kv_cache_manager: Any, *, device: "str | torch.device" = "cpu") -> KvBlockAuditInputs:
    """What the KV block audit reads, from vLLM 0.33's ``KVCacheManager`` (its one ``BlockPool``
    and every KV cache group's ``SingleTypeKVCacheManager``), read now on the host.

    * ``free_block_ids``: the free queue (:func:`free_queue`), front first;
    * ``cached_block_ids``: every block the prefix cache maps a hash to
      (``BlockPool.cached_block_hash_to_block``), free or not, through a good entry only (a stale
      entry, whose key is not the block's own hash, makes no block cached);
    * held entries: every entry of every request's table (``req_to_blocks``) of every group, in
      group order, then request order, then block order; the null block (``block_id`` 0,
      ``BlockPool.null_block``) left out. ``held_positions``: entry ``j`` of a group of block size
      ``bs`` covers positions from ``j * bs``; ``held_rows`` index ``held_request_ids`` (each
      request once, in the order first met);
    * ``num_blocks``: ``BlockPool.num_gpu_blocks``; ``null_block_id``: 0.

    Read on the scheduler's thread (the instrumentor reads it right after ``schedule()``, at
    sampling steps only): host work of one attribute read per free block, per cached hash and per
    table entry, then one tensor per field on ``device`` (``int64``).

    A block held outside the tables is not seen: runs whose KV connector defers frees
    (``Scheduler.deferred_frees``) or pins blocks should not be audited (the instrumentor leaves
    the audit off when a connector is set).

    Raises:
        TypeError: not vLLM's ``KVCacheManager`` (the message names what is missing).
        FreeQueueMoved: see :func:`free_queue`.
    """
    managers, block_pool = _parts(kv_cache_manager)
    free_ids = list(map(_BLOCK_ID, free_queue(block_pool)))
    cached_ids = _cached_block_ids(block_pool)
    rows: dict[str, int] = {}
    ids: list[int] = []
    segments: list[tuple[int, int, int, int]] = []  # (group, row, entries, block size) per table
    for group, manager in enumerate(managers):
        bs = _block_size(manager)
        for request_id, blocks in list(_req_to_blocks(manager).items()):
            if blocks:
                ids.extend(map(_BLOCK_ID, blocks))
                segments.append((group, rows.setdefault(request_id, len(rows)), len(blocks), bs))
    held = np.array(ids, dtype=np.int64)
    if segments:
        groups, held_rows, lens, sizes = np.array(segments, dtype=np.int64).T
        starts = np.cumsum(lens) - lens
        positions = (np.arange(held.shape[0]) - np.repeat(starts, lens)) * np.repeat(sizes, lens)
        groups, held_rows = np.repeat(groups, lens), np.repeat(held_rows, lens)
        keep = held != NULL_BLOCK_ID  # the null entries (the window's skipped blocks, prefix hits) left out
        held, groups, held_rows, positions = held[keep], groups[keep], held_rows[keep], positions[keep]
    else:
        groups = held_rows = positions = held
    t = torch.from_numpy
    device = torch.device(device)
    return KvBlockAuditInputs(
        num_blocks=int(block_pool.num_gpu_blocks),
        free_block_ids=t(np.array(free_ids, dtype=np.int64)).to(device),
        cached_block_ids=t(np.array(cached_ids, dtype=np.int64)).to(device),
        held_block_ids=t(held).to(device),
        held_groups=t(groups).to(device),
        held_rows=t(held_rows).to(device),
        held_positions=t(positions).to(device),
        held_request_ids=tuple(rows),
        null_block_id=NULL_BLOCK_ID,
    )


def kv_cache_pool_usage(kv_cache_manager: Any) -> "tuple[PoolUsage, ...] | None":
    """How full vLLM's KV cache is, per pool kind, in tokens (vLLM 0.33's v1 ``KVCacheManager``).

    vLLM keeps one ``BlockPool`` (``kv_cache_manager.coordinator.block_pool``) for every KV cache
    group; each group (``coordinator.single_type_managers[i]``) takes its blocks from it. A pool
    here is the groups of one kind: ``full`` the ``FullAttentionManager`` groups, ``swa`` the
    ``SlidingWindowManager`` groups (other kinds are in neither). Free means on the free queue
    (:func:`free_queue`), as vLLM counts it (``BlockPool.get_num_free_blocks``). Per pool, in token
    slots of the shared pool (blocks x the groups' ``block_size``):

    * ``available``: free blocks not in the prefix cache (``block_hash`` unset), shared: the same in
      both pools;
    * ``evictable``: free blocks still in the prefix cache whose hash belongs to one of the pool's
      groups (``BlockHashWithGroupId``'s group id);
    * ``used``: the blocks not free that the pool's groups' tables hold (``req_to_blocks``, the
      null block, ``is_null``, being no block; a block in the tables of both kinds, which only a
      corrupted pool has, counted once, in ``full``), plus the blocks not free that no table holds (leaked: the KV block audit
      names them): by their hash's group when cached, else in ``full`` (``swa`` when there is no
      full-attention group), since vLLM counts them as used;
    * ``total``: ``num_gpu_blocks - 1`` (block 0 is the null block), shared: the same in both.

    So over the pools ``sum(used) / total`` is vLLM's own ``kv_cache_usage_perc``
    (``BlockPool.get_usage()``, ``1 - num_free_blocks / (num_gpu_blocks - 1)``) when every group
    is of one of the two kinds, leak or not; a block a table holds while it is on the free queue
    (freed while in use) counts as free, as vLLM counts it.

    Host work only (no device tensor): one pass over the free queue and one over the groups' block
    tables (one attribute read per entry), then a few numpy passes over one flag per block: call it
    at metric collection, not every step. Read from another thread while the scheduler runs, the free
    queue may change during the walk: the read is tried three times, then ``None`` is returned (no
    figure rather than a wrong one).

    Returns:
        one :class:`~otel_swa.pool_usage.PoolUsage` per pool kind present (``full`` first), or
        ``None`` when the free queue kept moving.

    Raises:
        TypeError: not vLLM's ``KVCacheManager`` (the message names the missing attribute).
        ValueError: the groups of one pool have different block sizes (no single token unit), or
            the counts are inconsistent.
    """
    managers, block_pool = _parts(kv_cache_manager)
    try:
        blocks = block_pool.blocks
        total_blocks = int(block_pool.num_gpu_blocks) - 1
    except AttributeError as exc:
        raise TypeError(f"{type(block_pool).__name__} is not vLLM's BlockPool ({SUPPORTED_VLLM}): {exc}") from None
    groups: dict[str, list[tuple[int, Any]]] = {}
    for group_id, manager in enumerate(managers):
        pool = _pool_of(manager)
        if pool is not None:
            groups.setdefault(pool, []).append((group_id, manager))
    if not groups:
        return ()
    sizes = {}
    for pool, members in groups.items():
        found = {_block_size(manager) for _, manager in members}
        if len(found) != 1:
            raise ValueError(f"the {pool} KV cache groups have block sizes {sorted(found)}; expected one")
        sizes[pool] = found.pop()
    pool_of_group = {group_id: pool for pool, members in groups.items() for group_id, _ in members}
    for attempt in range(3):
        try:
            free = free_queue(block_pool)
            break
        except FreeQueueMoved:
            if attempt == 2:
                return None
    available_blocks = 0
    evictable_blocks = dict.fromkeys(groups, 0)
    for block in free:
        block_hash = block.block_hash
        if block_hash is None:
            available_blocks += 1
            continue
        pool = pool_of_group.get(_group_id(block_hash))
        if pool is not None:
            evictable_blocks[pool] += 1
    n = len(blocks)
    held = {POOL_FULL: [], POOL_SWA: [], None: []}  # block ids by the kind of the tables holding them
    for group_id, manager in enumerate(managers):
        ids = held[pool_of_group.get(group_id)]
        for req_blocks in list(_req_to_blocks(manager).values()):
            ids.extend(map(_BLOCK_ID, req_blocks))
    marks = {}
    for kind, ids in held.items():
        mark = np.zeros(n, dtype=bool)
        mark[np.array(ids, dtype=np.int64)] = True
        marks[kind] = mark
    in_use = np.ones(n, dtype=bool)
    in_use[np.array(list(map(_BLOCK_ID, free)), dtype=np.int64)] = False
    in_use[NULL_BLOCK_ID] = False
    full = marks[POOL_FULL] & in_use  # a block in the tables of both kinds (a corrupted pool) counts in full
    used_blocks = {POOL_FULL: int(np.count_nonzero(full)),
                   POOL_SWA: int(np.count_nonzero(marks[POOL_SWA] & in_use & ~full))}
    rest = POOL_FULL if POOL_FULL in groups else POOL_SWA
    for block_id in np.flatnonzero(in_use & ~marks[POOL_FULL] & ~marks[POOL_SWA] & ~marks[None]).tolist():
        block_hash = blocks[block_id].block_hash  # in use, in no table: by its hash's group when cached
        used_blocks[pool_of_group.get(_group_id(block_hash), rest) if block_hash is not None else rest] += 1
    return tuple(
        PoolUsage(pool, used_blocks[pool] * sizes[pool], available_blocks * sizes[pool],
                  evictable_blocks[pool] * sizes[pool], total_blocks * sizes[pool])
        for pool in (POOL_FULL, POOL_SWA) if pool in groups
    )


def scheduler_pool_usage(scheduler: Any) -> "tuple[PoolUsage, ...] | None":
    """:func:`kv_cache_pool_usage` of a vLLM ``Scheduler``'s ``kv_cache_manager``."""
    return kv_cache_pool_usage(scheduler.kv_cache_manager)
