"""The KV block audit of block-pool engines (vLLM): is every KV block held by exactly what should hold it?

From the view's block tables, free queue and prefix-cache map (``view.kv_block_audit``,
:class:`~otel_swa.views.base.KvBlockAuditInputs`), staged on the device
(:mod:`otel_swa.device.block_audit`): blocks in use that nothing holds (leaked), blocks a running
request's table references that are on the free queue (freed while in use), and uncached blocks
two requests' tables reference (handed out twice).
"""

from __future__ import annotations

from typing import Any, Sequence

from otel_swa.checks.protocol import Check, CheckField, SampleBatch, Staging

__all__ = ["BLOCK_CELLS", "BLOCK_WIDTH", "block_audit_fields", "BlockAuditCheck", "CHECK"]

#: The cells :func:`otel_swa.device.block_audit.stage_block_audit` writes, in order.
BLOCK_CELLS = (
    "leaked",  # blocks not free, not held, not cached (the null block excepted)
    "freed_in_use",  # held entries whose block is on the free queue
    "shared",  # uncached blocks two requests' tables reference
    "leaked_block",  # the lowest leaked block id
    "freed_block",  # the first such held entry's block id
    "freed_group",  # its KV cache group
    "freed_row",  # its request's index in held_request_ids
    "freed_position",  # the first token position its block covers
    "shared_block",  # the first held entry of a shared uncached block: its block id
    "shared_group",  # its KV cache group
    "shared_row",  # its request's index in held_request_ids
    "shared_position",  # the first token position its block covers
)
#: int64 cells of the block audit.
BLOCK_WIDTH = len(BLOCK_CELLS)


def block_audit_fields(values: Sequence[int]) -> dict[str, int]:
    """The staged cells as ints by name (:data:`BLOCK_CELLS`)."""
    return {name: int(value) for name, value in zip(BLOCK_CELLS, values)}


class BlockAuditCheck(Check):
    name = "block_audit"
    title = "KV block audit"
    line = "audit"
    ran_when = "when the engine gives the KV block audit's inputs"
    fields = (
        CheckField("kv_leaked_blocks", "{block}", "KV blocks in use that no request and no prefix-cache entry holds",
                   role="fault", label="leaked KV blocks",
                   gauge=("blocks.leaked", "KV blocks in use that no request and no prefix-cache entry holds: "
                                           "allocated and unreachable (block-pool engines: vLLM)")),
        CheckField("kv_freed_blocks_in_use", "{block}",
                   "KV blocks a running request's block table references that are on the free queue",
                   role="fault", label="KV blocks freed while in use",
                   gauge=("blocks.freed_in_use", "KV blocks a running request's block table references that are on "
                                                 "the free queue: the pool may hand them to another request "
                                                 "(block-pool engines: vLLM)")),
        CheckField("kv_shared_blocks", "{block}",
                   "KV blocks not in the prefix cache that two requests' block tables reference",
                   role="fault", label="KV blocks handed out twice",
                   gauge=("blocks.shared", "KV blocks not in the prefix cache that two requests' block tables "
                                           "reference: a block handed out again while in use (block-pool engines: "
                                           "vLLM)")),
    )
    reason = "the SWA slot audit found faults (peak {found}); exit status 1"

    width = BLOCK_WIDTH

    def stage(self, staging: Staging, cells: Any) -> Any:
        inputs = getattr(staging.view, "kv_block_audit", None)
        if inputs is None:
            return None
        staging.kernels.stage_block_audit(cells, inputs, staging.workspace)
        return inputs

    def keep(self, staging: Staging, staged: Any) -> Any:
        return tuple(str(r) for r in staged.held_request_ids)

    def read(self, cells: Sequence[int], kept: Any, batch: SampleBatch) -> "tuple[dict, list[dict]]":
        block = block_audit_fields(cells)
        fields = {"kv_leaked_blocks": block["leaked"], "kv_freed_blocks_in_use": block["freed_in_use"],
                  "kv_shared_blocks": block["shared"]}
        offenders = []
        if block["leaked"] > 0:
            offenders.append(dict(fault="kv_leaked_blocks", block=block["leaked_block"]))
        ids = kept
        for fault, count, prefix in (("kv_freed_blocks_in_use", "freed_in_use", "freed"),
                                     ("kv_shared_blocks", "shared", "shared")):
            if block[count] > 0:
                row = block[f"{prefix}_row"]
                offenders.append(dict(
                    fault=fault, request=ids[row] if ids is not None and 0 <= row < len(ids) else None,
                    position=block[f"{prefix}_position"], block=block[f"{prefix}_block"],
                    kv_cache_group=block[f"{prefix}_group"]))
        return fields, offenders

    def summary(self, records: Sequence[Any]) -> str:
        audited = [r for r in records if self.present(r)]
        peaks = {f.name: max(getattr(r, f.name) for r in audited) for f in self.fields}
        verdict = "clean" if not any(peaks.values()) else "FAULTS"
        leaked, freed, shared = peaks.values()
        return (f"{verdict}: peak leaked {leaked} blocks, freed while in use {freed}, handed out twice {shared} "
                f"({len(audited)} samples)")


#: The KV block audit.
CHECK = BlockAuditCheck()
