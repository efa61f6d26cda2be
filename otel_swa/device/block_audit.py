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
* a held entry whose block is on the free queue was **freed while in use**: the pool may hand it
  to another request while this one still reads it (a cached block a request uses is taken off the
  free queue when the request takes it, vLLM's ``BlockPool.touch``, so being cached does not excuse
  it);
* a block that is not cached and that two requests' tables reference is **shared**: only prefix
  cache hits share blocks, and they are cached (the second request of a block freed early and
  handed out again).

Ids outside ``0 .. num_blocks - 1`` are ignored rather than read out of bounds (they go to a spare
table cell). Work: one bool table per kind over the ``num_blocks + 1`` cells, written at the ids,
and passes over the held entries; no atomics, no host sync.

Cells (:data:`BLOCK_CELLS`): the three counts, the first leaked block (lowest id), and the first
held entry freed while in use and the first of a shared block (in the order the entries are given):
its block, KV cache group, request index and first position. A cell of an offender is meaningful
only when its count is above 0.
"""

from __future__ import annotations

from typing import Any

import torch

from otel_swa.checks.block_audit import BLOCK_CELLS, BLOCK_WIDTH, block_audit_fields
from otel_swa.device.workspace import Workspace

__all__ = ["BLOCK_CELLS", "BLOCK_WIDTH", "stage_block_audit", "block_audit_fields"]




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
    entries = [t.reshape(-1).long() for t in (inputs.held_block_ids, inputs.held_groups, inputs.held_rows,
                                               inputs.held_positions)]
    zero = torch.zeros((), dtype=torch.int64, device=out.device)
    if held_keys.numel():
        # freed while in use: a held entry whose block is on the free queue
        exposed = free.index_select(0, held_keys)
        freed = torch.count_nonzero(exposed)
        first = torch.max(exposed, 0).indices.reshape(1)
        freed_entry = [t.index_select(0, first).reshape(()) for t in entries]
        # shared: an uncached block whose cell, written with each held entry's request, reads back
        # another request for one of them (bad ids share the spare cell, never counted)
        rows = entries[2]
        owner = ws.get("block.owner", n + 1, torch.int64).fill_(-1)
        owner.scatter_(0, held_keys, rows)
        sharing = torch.ne(owner.index_select(0, held_keys), rows).logical_and_(
            cached.index_select(0, held_keys).logical_not_()).logical_and_(held_keys < n)
        keys = torch.where(sharing, held_keys, n)
        marked = ws.get("block.shared", n + 1, torch.bool).zero_()
        marked.index_fill_(0, keys, True)
        marked[n] = False
        shared = torch.count_nonzero(marked)
        first = torch.max(sharing, 0).indices.reshape(1)
        shared_entry = [t.index_select(0, first).reshape(()) for t in entries]
    else:
        freed = shared = zero
        freed_entry = shared_entry = [zero] * 4
    # leaked: not free, not held, not cached; the null block and the spare cell never
    lost = torch.logical_or(free, held, out=ws.get("block.lost", n + 1, torch.bool)).logical_or_(cached).logical_not_()
    lost[int(inputs.null_block_id)] = False
    lost[n] = False
    leaked = torch.count_nonzero(lost)
    leaked_block = torch.max(lost, 0).indices
    torch.stack([leaked, freed, shared, leaked_block, *freed_entry, *shared_entry], out=out)
    return out
