"""vLLM adapter: the SWA KV cache of vLLM's v1 engine, mapped onto what otel-swa reports.

vLLM keeps no FULL-to-SWA slot mapping. Each KV cache group has its own block table; the sliding
window group's ``SlidingWindowManager`` (``vllm/v1/core/single_type_kv_cache_manager.py``) frees
the blocks that left the window to the shared ``BlockPool`` and puts the pool's null block
(``BlockPool.null_block``, block id 0, ``is_null``) in their place; a request skips
``get_num_skipped_tokens(n) = max(0, n - sliding_window + 1)`` tokens, in whole blocks.

What maps, per live request of ``n`` tokens in the SWA group's block table:

* ``swa_out_of_window_tokens``: null-block entries among its first ``ceil(n / block_size)`` blocks
  times ``block_size``, clipped to ``n``;
* SWA entries read: ``n - out_of_window``; FULL entries read: ``n`` (give these to ``observe``);
* ``swa_full_idx_divergence``: not applicable. There is no second index to diverge from.
  :class:`WindowCounts` carries ``None``. Through the reporter (:func:`batch_view`) the field is
  0 by construction, because SGLang's line holds integers only; the view sets
  ``divergence_applicable=False``, so each record says so and the telemetry emits no
  ``kv_cache.swa.tokens.divergent`` data point (the event carries
  ``kv_cache.swa.divergence_applicable=false``) rather than a misleading 0.

Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from otel_swa.views.base import SwaBatch

__all__ = [
    "NULL_BLOCK_ID",
    "SUPPORTED_VLLM",
    "WindowCounts",
    "num_skipped_tokens",
    "block_table_from_manager",
    "window_counts",
    "batch_view",
    "slot_mapping",
    "observe_counts",
]

#: The null block's id in vLLM's ``BlockPool`` (the pool reserves block 0 for it).
NULL_BLOCK_ID = 0

#: vLLM versions whose v1 KV cache manager has the structures read here (pip specifier; read
#: against the 0.33.0 wheel's source: ``req_to_blocks``, ``BlockPool.null_block``, ``get_num_skipped_tokens``).
SUPPORTED_VLLM = "vllm >= 0.10, < 0.34"


def num_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    """vLLM's ``SlidingWindowManager.get_num_skipped_tokens``: ``max(0, n - window + 1)``.

    Raises:
        ValueError: ``sliding_window`` below 1 or a negative token count.
    """
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
    return max(0, num_computed_tokens - sliding_window + 1)


@dataclass(frozen=True)
class WindowCounts:
    """One batch's sliding-window counts in vLLM terms (host ints).

    Attributes:
        live_tokens: sum of the requests' token counts (FULL entries read).
        swa_entries: tokens whose SWA block is a real block (SWA entries read).
        swa_out_of_window_tokens: tokens whose SWA block is the null block.
        swa_full_idx_divergence: always ``None``: not applicable to vLLM.
    """

    live_tokens: int
    swa_entries: int
    swa_out_of_window_tokens: int
    swa_full_idx_divergence: None = None


def block_table_from_manager(
    manager: Any, request_ids: Sequence[str], *, device: "str | torch.device" = "cpu"
) -> torch.Tensor:
    """The SWA group's block table of ``request_ids``, read from a ``SlidingWindowManager``.

    Reads ``manager.req_to_blocks[request_id]`` (a list of ``KVCacheBlock``; ``block_id`` each).

    Returns:
        ``int32 [len(request_ids), max_blocks]`` on ``device``, padded with the null block id.

    Raises:
        TypeError: ``manager`` has no ``req_to_blocks``.
        KeyError: a request id the manager does not hold.
    """
    try:
        req_to_blocks = manager.req_to_blocks
    except AttributeError:
        raise TypeError(
            f"{type(manager).__name__} has no req_to_blocks; expected vLLM's SlidingWindowManager ({SUPPORTED_VLLM})"
        ) from None
    rows = []
    for request_id in request_ids:
        if request_id not in req_to_blocks:
            raise KeyError(f"request {request_id!r} holds no blocks in the sliding-window manager")
        rows.append([int(block.block_id) for block in req_to_blocks[request_id]])
    width = max((len(r) for r in rows), default=0)
    table = torch.full((len(rows), max(width, 1)), NULL_BLOCK_ID, dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
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


def _null_token_mask(block_table: torch.Tensor, num_tokens: torch.Tensor, block_size: int, null_block_id: int):
    """``bool [batch, max_blocks * block_size]``: live positions whose block is the null block, and
    the live-position mask."""
    width = block_table.shape[1] * block_size
    positions = torch.arange(width, device=block_table.device)
    live = positions.unsqueeze(0) < num_tokens.long().unsqueeze(1)
    null = (block_table == null_block_id).repeat_interleave(block_size, dim=1)
    return null & live, live


def window_counts(
    block_table: torch.Tensor,
    num_tokens: torch.Tensor,
    block_size: int,
    *,
    null_block_id: int = NULL_BLOCK_ID,
) -> WindowCounts:
    """Out-of-window and read-entry counts of a batch from the SWA group's block table.

    Runs on the tensors' device and synchronises once to return host ints.

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
    null, live = _null_token_mask(block_table, num_tokens, block_size, null_block_id)
    live_tokens, out_of_window = torch.stack([live.sum(), null.sum()]).tolist()
    return WindowCounts(
        live_tokens=live_tokens,
        swa_entries=live_tokens - out_of_window,
        swa_out_of_window_tokens=out_of_window,
    )


@functools.lru_cache(maxsize=8)
def _cached_slot_mapping(num_blocks: int, block_size: int, null_block_id: int, device: torch.device) -> torch.Tensor:
    mapping = torch.arange(num_blocks * block_size + 1, dtype=torch.int64, device=device)
    null_start = null_block_id * block_size + 1
    mapping[0] = 0
    mapping[null_start : null_start + block_size] = 0
    return mapping


def slot_mapping(num_blocks: int, block_size: int, null_block_id: int, device: "torch.device | str") -> torch.Tensor:
    """The view's FULL-to-SWA mapping of a vLLM SWA group (see :func:`batch_view`).

    ``int64 [num_blocks * block_size + 1]`` on ``device``: view slot ``s`` (token slot ``s - 1``)
    maps to itself, except slot 0 and the null block's ``block_size`` slots, which map to 0. Built
    once per ``(num_blocks, block_size, null_block_id, device)`` (the last 8 kept) and shared: the
    reporter only reads it, and nobody may write to it.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1, or ``null_block_id`` outside
            ``[0, num_blocks)``.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
    if not 0 <= null_block_id < num_blocks:
        raise ValueError(f"null_block_id {null_block_id} is outside [0, num_blocks={num_blocks})")
    return _cached_slot_mapping(int(num_blocks), int(block_size), int(null_block_id), torch.device(device))


def batch_view(
    block_table: torch.Tensor,
    num_tokens: torch.Tensor,
    block_size: int,
    *,
    num_blocks: int,
    null_block_id: int = NULL_BLOCK_ID,
    num_tokens_cpu: "torch.Tensor | Sequence[int] | None" = None,
) -> SwaBatch:
    """A reporter view (:class:`otel_swa.views.SwaBatch`) of a vLLM batch.

    vLLM has no FULL-to-SWA mapping, so the view builds one that states only what exists: token
    slot ``block_id * block_size + offset`` of the SWA block table, mapped to itself for a real
    block and to 0 for the null block. The reporter then counts null-block tokens as out of window
    and divergence as 0, marked not applicable (``divergence_applicable=False``; see the module
    docstring). Build it at sampling steps only: it allocates ``[batch, max_blocks * block_size]``
    on the device (no host sync); the mapping itself is built once and shared (:func:`slot_mapping`).

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
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    device = block_table.device
    batch, max_blocks = block_table.shape
    offsets = torch.arange(block_size, device=device)
    slots = (block_table.long().unsqueeze(2) * block_size + offsets).reshape(batch, max_blocks * block_size)
    # Slot 0 is never a real token in the view: shift by one so that the null block's slots and
    # the reserved "none" slot 0 stay apart.
    req_to_token = slots + 1
    return SwaBatch(
        req_to_token=req_to_token,
        full_to_swa_index_mapping=slot_mapping(num_blocks, block_size, null_block_id, device),
        req_pool_indices=torch.arange(batch, dtype=torch.int64, device=device),
        seq_lens=num_tokens,
        seq_lens_cpu=num_tokens_cpu,
        divergence_applicable=False,
    )


def observe_counts(reporter: Any, counts: WindowCounts) -> None:
    """Add a batch's read entries to ``reporter``: ``live_tokens`` to FULL, ``swa_entries`` to SWA."""
    reporter.observe("full", counts.live_tokens)
    reporter.observe("swa", counts.swa_entries)

