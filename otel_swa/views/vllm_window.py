"""vLLM's sliding-window block tables read from the ``SlidingWindowManager`` (vLLM 0.33's v1 engine;
nothing here imports vLLM): the window counts of a batch (:class:`WindowCounts`), one read of its
tables giving both the counts and the reporter's view (:func:`read_window_table`,
:class:`WindowTable`), vLLM's own formula (:func:`num_skipped_tokens`) and the window check's
allowance (:func:`window_allowance`). What maps and what does not: :mod:`otel_swa.views.vllm`.
Also what every vLLM view reads of a manager (``req_to_blocks``, ``block_size``)."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from otel_swa.views.base import BlockHashFindings, KvBlockAuditInputs, SwaBatch

#: The null block's id in vLLM's ``BlockPool`` (the pool reserves block 0 for it).
NULL_BLOCK_ID = 0

#: The vLLM versions whose v1 KV cache manager has the structures read here (pip specifier). The
#: lower bound is the oldest version this adapter was run against (0.32.0's CPU build, whole engine;
#: 0.33.0's real ``KVCacheManager`` and ``Scheduler``); older versions were not tested.
SUPPORTED_VLLM = "vllm >= 0.32.0, < 0.34"

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
        kv_provenance: Any = None,
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
        and foreign blocks), ``kv_provenance`` (the KV provenance check's tables:
        :func:`otel_swa.views.vllm_provenance.provenance_view`).
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
            kv_provenance=kv_provenance,
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



def observe_counts(reporter: Any, counts: WindowCounts) -> None:
    """Add a batch's entries to ``reporter``: ``live_tokens`` to FULL, ``swa_entries`` to SWA."""
    reporter.observe("full", counts.live_tokens)
    reporter.observe("swa", counts.swa_entries)
