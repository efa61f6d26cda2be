"""The KV block audit: leaked KV blocks and blocks freed while a request still uses them.

torch only, no host synchronisation: the counts and the first offenders are written into device
cells that ride in the sample's one device-to-host copy (see ``otel_swa.reporter``).

For block-pool engines (vLLM's v1 ``BlockPool``, shared by every KV cache group): a block is free
(on the free queue), held (some request's block table references it, in any group) and/or cached
(the prefix cache maps a block hash to it; a cached block may sit on the free queue, evictable).
So (vLLM#50630, #50702, #39589: blocks freed early or reused while referenced; a block taken off
the free queue and never returned leaks):

* a block that is not free, not held and not cached, other than the null block, is **leaked**:
  nothing references it and nothing will free it;
* a held entry whose block is free and not cached was **freed while in use**: the pool may hand it
  to another request while this one still reads it.

Ids outside ``0 .. num_blocks - 1`` are ignored rather than read out of bounds (they go to a spare
table cell). Work: one bool table per kind over the ``num_blocks + 1`` cells, written at the ids,
and passes over the held entries; no atomics, no host sync.

Cells (:data:`BLOCK_CELLS`): the two counts, the first leaked block (lowest id), and the first held
entry freed while in use (in the order the entries are given): its block, KV cache group, request
index and first position. A cell of an offender is meaningful only when its count is above 0.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from otel_swa.device.workspace import Workspace

__all__ = ["BLOCK_CELLS", "BLOCK_WIDTH", "stage_block_audit", "block_audit_fields"]

#: The cells :func:`stage_block_audit` writes, in order.
BLOCK_CELLS = (
    "leaked",  # blocks not free, not held, not cached (the null block excepted)
    "freed_in_use",  # held entries whose block is free and not cached
    "leaked_block",  # the lowest leaked block id
    "freed_block",  # the first such held entry's block id
    "freed_group",  # its KV cache group
    "freed_row",  # its request's index in held_request_ids
    "freed_position",  # the first token position its block covers
)
#: int64 cells of the block audit.
BLOCK_WIDTH = len(BLOCK_CELLS)


def _mark(ws: Workspace, name: str, ids: torch.Tensor, cells: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """A bool table of ``cells + 1`` cells, True at the valid ``ids`` (bad ids at the spare last cell,
    cleared); and the ids as table keys (``int64``, bad ones at the spare cell)."""
    ids = ids.reshape(-1).long()
    keys = ids.clamp(0, cells)
    keys.masked_fill_(keys != ids, cells)
    table = ws.get(name, cells + 1, torch.bool).zero_()
    table.index_fill_(0, keys, True)
    table[cells] = False
    return table, keys


def stage_block_audit(out: torch.Tensor, inputs: Any, ws: Workspace | None = None) -> torch.Tensor:
    """Write the block audit's cells (:data:`BLOCK_CELLS`) into ``out`` (``int64 [BLOCK_WIDTH]`` on
    the device) and return it.

    Args:
        out: the destination cells.
        inputs: a :class:`otel_swa.views.base.KvBlockAuditInputs` (its tensors on ``out``'s device).
        ws: where the tables live (default: fresh tensors).
    """
    ws = ws if ws is not None else Workspace(out.device)
    n = int(inputs.num_blocks)
    free, _ = _mark(ws, "block.free", inputs.free_block_ids, n)
    held, held_keys = _mark(ws, "block.held", inputs.held_block_ids, n)
    cached, _ = _mark(ws, "block.cached", inputs.cached_block_ids, n)
    # freed while in use: a held entry on the free queue and not cached
    if held_keys.numel():
        exposed = free.index_select(0, held_keys).logical_and_(cached.index_select(0, held_keys).logical_not_())
        freed = torch.count_nonzero(exposed)
        first = torch.argmax(exposed.to(torch.uint8)).reshape(1)
        entry = [t.reshape(-1).long().index_select(0, first).reshape(())
                 for t in (inputs.held_block_ids, inputs.held_groups, inputs.held_rows, inputs.held_positions)]
    else:
        freed = torch.zeros((), dtype=torch.int64, device=out.device)
        entry = [freed] * 4
    # leaked: not free, not held, not cached; the null block and the spare cell never
    lost = torch.logical_or(free, held, out=ws.get("block.lost", n + 1, torch.bool)).logical_or_(cached).logical_not_()
    lost[int(inputs.null_block_id)] = False
    lost[n] = False
    leaked = torch.count_nonzero(lost)
    leaked_block = torch.argmax(lost.to(torch.uint8))
    torch.stack([leaked, freed, leaked_block, *entry], out=out)
    return out


def block_audit_fields(values: Sequence[int]) -> dict[str, int]:
    """The staged cells as ints by name (:data:`BLOCK_CELLS`)."""
    return {name: int(value) for name, value in zip(BLOCK_CELLS, values)}
