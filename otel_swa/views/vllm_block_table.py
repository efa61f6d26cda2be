"""vLLM's window counts and the reporter's view from a block-id tensor (a table a caller already
holds, e.g. a worker's, or :func:`block_table_from_manager`): every token of block ``b`` gets view
slot ``b + 1``, which :func:`block_mapping` maps to itself for a real block and to 0 for the null
block. Reading the manager itself is :func:`otel_swa.views.vllm_window.read_window_table`."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from otel_swa.views.base import SwaBatch
from otel_swa.views.vllm_window import _BLOCK_ID, NULL_BLOCK_ID, WindowCounts, _req_to_blocks

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
