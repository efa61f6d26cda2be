"""Block-hash provenance of block-pool engines (vLLM): does every prefix-cache entry and every block
of a request's table hold the tokens its hash says?

The view computes it on the host from the scheduler's own tables (``view.kv_block_hashes``,
:class:`~otel_swa.views.base.BlockHashFindings`, :mod:`otel_swa.views.vllm_block_hashes`): no
device work. A stale entry (a map key whose block's own hash differs: a hit would read other
tokens' KV) and a foreign block (a block at a full-block index whose hash is not the request's, or
of another KV cache group) are faults.
"""

from __future__ import annotations

from typing import Any, Sequence

from otel_swa.checks.protocol import Check, CheckField, MetricRow, SampleBatch, Staging

__all__ = ["BlockHashesCheck", "CHECK"]


class BlockHashesCheck(Check):
    name = "block_hashes"
    title = "block hashes"
    line = "provenance"
    ran_when = "when the engine checks its block hashes"
    fields = (
        CheckField("kv_cache_entries_checked", "{entry}",
                   "prefix-cache map entries and table entries whose block hash was compared"),
        CheckField("kv_stale_cache_entries", "{block}",
                   "prefix-cache map entries naming a block whose own hash is not the entry's key",
                   role="fault", label="stale prefix-cache entries",
                   explain="{peak} prefix-cache entr(ies) name a block whose own hash is not the key (stale after "
                           "eviction or reuse: a hit would read other tokens' KV)",
                   gauge=("blocks.stale_cached", "Prefix-cache map entries naming a block whose own hash is not the "
                          "entry's key: a stale entry left after eviction or reuse, whose hit reads other tokens' KV "
                          "(block-pool engines: vLLM); must be 0")),
        CheckField("kv_foreign_blocks", "{block}",
                   "blocks in a request's table whose hash is not the request's block hash for that index",
                   role="fault", label="foreign KV blocks",
                   explain="{peak} block(s) in a request's table hold other tokens' KV (their hash is not the "
                           "request's for that index, or they belong to another KV cache group)",
                   gauge=("blocks.foreign", "Blocks in a request's block table whose hash is not the request's "
                          "block hash for that index, or blocks of another KV cache group: they hold other tokens' KV "
                          "(block-pool engines: vLLM); must be 0")),
    )
    counters = (
        MetricRow("provenance.block_hashes", "sample_counter", "{entry}",
                  "Prefix-cache map entries and block-table entries whose block hash was compared with the key or "
                  "the request's block hash for that index (block-pool engines: vLLM)",
                  "kv_cache_entries_checked (when the engine checks its block hashes)",
                  field="kv_cache_entries_checked"),
    )
    reason = ("the write check and provenance found KV that is not the KV of the token the tables name (peak "
              "{found}); exit status 1")

    def stage(self, staging: Staging, cells: Any) -> Any:
        return getattr(staging.view, "kv_block_hashes", None)  # host findings of the sampled step

    def read(self, cells: Sequence[int], kept: Any, batch: SampleBatch) -> "tuple[dict, list[dict]]":
        found = kept
        fields = {"kv_cache_entries_checked": found.entries_checked, "kv_stale_cache_entries": found.stale_entries,
                  "kv_foreign_blocks": found.foreign_blocks}
        return fields, [dict(fault=fault, request=o.request, position=o.position, block=o.block,
                             kv_cache_group=o.kv_cache_group, other_request=o.other_request)
                        for fault, count, o in (("kv_stale_cache_entries", found.stale_entries, found.first_stale),
                                                ("kv_foreign_blocks", found.foreign_blocks, found.first_foreign))
                        if count > 0 and o is not None]

    def summary(self, records: Sequence[Any]) -> str:
        checked = [r for r in records if self.present(r)]
        entries = sum(r.kv_cache_entries_checked for r in checked)
        stale = sum(r.kv_stale_cache_entries for r in checked)
        foreign = sum(r.kv_foreign_blocks for r in checked)
        verdict = "clean" if not stale and not foreign else "STALE OR FOREIGN BLOCKS"
        return f"{verdict}: {stale} stale, {foreign} foreign of {entries} entries checked ({len(checked)} samples)"


#: Block-hash provenance.
CHECK = BlockHashesCheck()
