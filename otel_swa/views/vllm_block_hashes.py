"""Block-hash provenance of vLLM's KV blocks: does each block the prefix cache or a request's table
names hold the KV of the tokens it is named for?

vLLM 0.33 names the content of a full KV block by a block hash: a hash chained over the request's
tokens up to the block's end (``Request.block_hashes``, one per ``BlockPool.hash_block_size``
tokens, appended by ``Request.update_block_hashes``), with the KV cache group's id appended
(``BlockHashWithGroupId``: the hash's bytes then the group id in 4 big-endian bytes,
``kv_cache_utils.make_block_hash_with_group_id``). The prefix cache
(``BlockPool.cached_block_hash_to_block``, a ``BlockHashToBlockMap`` whose ``_cache`` dict maps
each such key to a ``KVCacheBlock`` or to a dict of them by block id) hands a block to any request
whose own hash for that index is the key. A block carries the key it was cached under
(``KVCacheBlock.block_hash``, set by ``BlockPool.cache_full_blocks``, covering
``block_hash_num_tokens`` tokens) and, for the partial prefix entries of groups whose block size is
a multiple of the hash block size (``BlockPool.cache_partial_block``), more keys in
``BlockPool.cached_block_hashes_by_block[block_id]``; eviction (``BlockPool._maybe_evict_cached_block``,
when ``get_new_blocks`` hands a free cached block out again) removes every map entry of the block
and resets its hash.

Two checks, each counted and naming its first offender:

* **stale prefix-cache entries**: a map entry (key, block) where the
  key is neither the block's own hash nor one of its secondary keys, or the block is the null
  block. A lookup of that key hands out a block that holds other tokens' KV (a block evicted or
  reused while its entry stayed behind): later requests "hit" it and read another request's KV.
* **foreign blocks**: an entry ``j`` of a request's table of KV cache group
  ``g`` (block size ``bs``) holding a block, not the null block, that carries a hash covering
  ``t`` tokens (``block_hash_num_tokens``; ``(j + 1) * bs`` when vLLM left it unset) where the
  hash is not the request's own: ``j * bs < t <= (j + 1) * bs`` and the hash equals
  ``make_block_hash_with_group_id(request.block_hashes[t // hash_block_size - 1], g)``. Otherwise
  the block holds other tokens' KV, or it is a block of another KV cache group (its hash carries
  another group id; vllm-project/vllm#47574), or it is named for tokens the request never hashed.

A block without a hash is not judged here (a request's blocks past its cached ones have none);
one such block in two requests' tables is the KV block audit's shared block
(:mod:`otel_swa.device.block_audit`), and a stale map entry never excuses it there
(:func:`otel_swa.views.vllm.kv_block_audit_inputs` counts a block as cached only through an entry
this module calls good). Tables are read for the managers whose block ``j`` holds tokens ``[j *
bs, (j + 1) * bs)``: vLLM's ``FullAttentionManager`` and ``SlidingWindowManager`` (the sliding
window's skipped blocks are the null block, skipped here); the other kinds' tables (Mamba, chunked
local attention, cross attention, the ``FullAttentionManager`` subclasses with other layouts) are
not read. The map is read whatever the group's kind.

Host work, not a device computation (hence here and not in ``otel_swa/device/``): the hashes are
Python ``bytes`` on vLLM's Python objects, read in the scheduler's process right after
``Scheduler.schedule()``; nothing reaches a device. Cost, bounded per sample
(:class:`BlockHashCheck`): at most ``budget`` map entries and about ``budget`` table entries are
read per sample, one attribute read and one ``bytes`` comparison each, plus, at the first sample
of each pass, one C-speed copy of the map's keys and of the request ids. With more entries than
the budget the check sweeps them in passes over several samples (see :class:`BlockHashCheck` for
the bound on how long a fault stays unseen).

Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any, Mapping, Sequence

from otel_swa.views.base import BlockHashFindings, BlockHashOffender

__all__ = ["DEFAULT_BUDGET", "CHECKED_MANAGERS", "BlockHashCheck", "block_hash_findings", "good_entry"]

#: Map entries, and table entries, read per sample by default. Measured with
#: ``benchmarks/bench_vllm_block_hashes.py`` (about 1 us an entry on 2 CPU cores): see docs/engines.md.
DEFAULT_BUDGET = 2048

#: The managers (``type(manager).__name__``, vLLM 0.33's ``single_type_kv_cache_manager.py``)
#: whose tables are checked: entry ``j`` holds the tokens ``[j * block_size, (j + 1) * block_size)``.
CHECKED_MANAGERS = ("FullAttentionManager", "SlidingWindowManager")

_GROUP_BYTES = 4  # the group id's bytes at the end of a BlockHashWithGroupId


def _group_of(key: bytes) -> int:
    return int.from_bytes(key[-_GROUP_BYTES:], "big", signed=False)


def _suffix(group: int) -> bytes:
    return group.to_bytes(_GROUP_BYTES, "big", signed=False)


def good_entry(key: bytes, block: Any, secondary: Mapping[int, Any]) -> bool:
    """Whether the prefix-cache map entry ``key -> block`` is good: ``key`` is the block's own hash
    (``KVCacheBlock.block_hash``) or one of its secondary keys (``secondary``:
    ``BlockPool.cached_block_hashes_by_block``), and the block is not the null block."""
    if block.is_null:
        return False
    return block.block_hash == key or key in secondary.get(block.block_id, ())


@dataclass
class _Table:
    """One request's table of one KV cache group, as read this sample."""

    request_id: str
    group: int
    block_size: int
    blocks: Sequence[Any]


class BlockHashCheck:
    """The block-hash provenance check of one vLLM ``KVCacheManager``, sample after sample.

    Each :meth:`check` reads up to ``budget`` entries of the prefix cache's map and about
    ``budget`` table entries (whole requests: every group's table of a request is read together, so
    a request whose tables alone exceed the budget is still read whole: at most ``budget`` plus
    one request's entries), continuing where the previous sample stopped, and returns what it
    found in them (:class:`~otel_swa.views.base.BlockHashFindings`). The counts are of the entries
    read at this sample (``entries_checked`` says how many carried a hash to compare); when the
    map and the tables fit the budget, that is all of them, every sample.

    Passes. The map's keys and the tables' request ids are copied at the first sample of a pass
    (one C-speed copy each); the pass then reads the entries still there, in that order, ``budget``
    a sample; an entry added during a pass is read by the next. So a stale entry that stays in the
    map is counted within ``2 * ceil(M / budget)`` samples (``M`` the map's largest size in that
    time), and a foreign block that stays in a running request's table within ``2 * ceil(E /
    budget)`` samples (``E`` the table entries of the running requests), the samples being
    ``interval`` forward steps apart. A fault that comes and goes between the samples that read
    its entry is not seen.

    Args:
        budget: map entries, and table entries, read per sample (int >= 1).

    Raises:
        ValueError: ``budget`` not an int >= 1.
    """

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        if type(budget) is not int or budget < 1:  # noqa: E721
            raise ValueError(f"budget must be an int >= 1 (entries per sample), got {budget!r}")
        self.budget = budget
        self._keys: list = []
        self._key_at = 0
        self._requests: list = []
        self._request_at = 0

    def check(self, kv_cache_manager: Any, requests: Mapping[str, Any]) -> BlockHashFindings:
        """Read the next entries of ``kv_cache_manager``'s prefix cache and tables (on the
        scheduler's thread, right after ``schedule()``).

        Args:
            kv_cache_manager: vLLM 0.33's ``KVCacheManager`` (``coordinator.block_pool``,
                ``coordinator.single_type_managers``).
            requests: the scheduler's requests by id (``Scheduler.requests``), for each one's
                ``block_hashes``; a table whose request is not there is not read.

        Raises:
            TypeError: not vLLM's ``KVCacheManager`` / ``BlockPool`` (the message names what is missing).
        """
        try:
            managers, pool = kv_cache_manager.coordinator.single_type_managers, kv_cache_manager.coordinator.block_pool
            cache, secondary = pool.cached_block_hash_to_block._cache, pool.cached_block_hashes_by_block
            hash_block_size = int(pool.hash_block_size)
        except AttributeError as exc:
            raise TypeError(f"{type(kv_cache_manager).__name__} is not vLLM 0.33's KVCacheManager: {exc}") from None
        if not isinstance(cache, dict):
            raise TypeError("BlockPool.cached_block_hash_to_block._cache is not a dict; expected vLLM 0.33")
        tables = self._next_tables(managers, requests)
        return _findings(self._next_keys(cache), cache, secondary, tables, requests, hash_block_size)

    # ------------------------------------------------------------------ the sweeps
    def _next_keys(self, cache: dict) -> list:
        if self._key_at >= len(self._keys):
            self._keys, self._key_at = list(cache), 0
        keys = self._keys[self._key_at:self._key_at + self.budget]
        self._key_at += len(keys)
        return keys

    def _next_tables(self, managers: Sequence[Any], requests: Mapping[str, Any]) -> list[_Table]:
        checked = []
        for index, manager in enumerate(managers):
            if type(manager).__name__ in CHECKED_MANAGERS:
                checked.append((getattr(manager, "kv_cache_group_id", index), manager.block_size,
                                manager.req_to_blocks))
        if self._request_at >= len(self._requests):
            seen: dict = {}
            for _, _, tables in checked:
                seen.update(dict.fromkeys(tables))
            self._requests, self._request_at = list(seen), 0
        out: list[_Table] = []
        read = 0
        while self._request_at < len(self._requests) and (read < self.budget or not out):
            request_id = self._requests[self._request_at]
            self._request_at += 1
            if request_id not in requests:
                continue
            for group, block_size, tables in checked:
                blocks = tables.get(request_id)  # .get: a defaultdict's lookup by [] would insert
                if blocks:
                    out.append(_Table(request_id, group, block_size, blocks))
                    read += len(blocks)
        return out


def block_hash_findings(kv_cache_manager: Any, requests: Mapping[str, Any]) -> BlockHashFindings:
    """The whole check at once (every map entry, every table): :meth:`BlockHashCheck.check` with no
    budget. For tests and one-off reads; the instrumentor keeps a :class:`BlockHashCheck`."""
    check = BlockHashCheck(budget=1 << 62)
    return check.check(kv_cache_manager, requests)


def _findings(keys: list, cache: dict, secondary: Mapping[int, Any], tables: list[_Table],
              requests: Mapping[str, Any], hash_block_size: int) -> BlockHashFindings:
    checked = stale = foreign = 0
    first_stale = first_foreign = None
    # the map: each (key, block) pair whose key is not one of the block's own
    for key in keys:
        entry = cache.get(key)
        if entry is None:  # gone since the pass began
            continue
        for block in (entry.values() if isinstance(entry, dict) else (entry,)):
            checked += 1
            if good_entry(key, block, secondary):
                continue
            stale += 1
            if first_stale is None:
                first_stale = (key, block)
    # the tables: each block carrying a hash that is not the request's for its index and group
    for table in tables:
        own = requests[table.request_id].block_hashes
        suffix = _suffix(table.group)
        bs = table.block_size
        for j, block in enumerate(table.blocks):
            found = block.block_hash
            if found is None or block.is_null:
                continue
            checked += 1
            tokens = block.block_hash_num_tokens
            if tokens is None:
                tokens = (j + 1) * bs
            index = tokens // hash_block_size - 1
            if (j * bs < tokens <= (j + 1) * bs and tokens % hash_block_size == 0 and 0 <= index < len(own)
                    and found == own[index] + suffix):
                continue
            foreign += 1
            if first_foreign is None:
                first_foreign = (table, j, block)
    return BlockHashFindings(
        entries_checked=checked,
        stale_entries=stale,
        foreign_blocks=foreign,
        first_stale=_stale_offender(*first_stale, tables, requests, hash_block_size) if first_stale else None,
        first_foreign=_foreign_offender(*first_foreign, tables) if first_foreign else None,
    )


def _holders(block: Any, tables: list[_Table]) -> list[tuple[_Table, int]]:
    """``(table, index)`` of every entry of the tables read this sample that holds ``block`` (none
    for the null block, which every sliding-window table holds)."""
    if block.is_null:
        return []
    return [(table, j) for table in tables for j, held in enumerate(table.blocks) if held is block]


def _stale_offender(key: bytes, block: Any, tables: list[_Table], requests: Mapping[str, Any],
                    hash_block_size: int) -> BlockHashOffender:
    """The stale entry's block and the key's group; ``request``: a request holding the block at an
    index whose own hash is the key (it took the block through the entry), ``position`` that
    index's first token; ``other_request``: another request holding the block (whose KV it is)."""
    group, named = _group_of(key), key[:-_GROUP_BYTES]
    holders = _holders(block, tables)
    victim = None
    for table, j in holders:
        own = requests[table.request_id].block_hashes
        bs = table.block_size
        if table.group == group and named in own[j * bs // hash_block_size:(j + 1) * bs // hash_block_size]:
            victim = (table, j)
            break
    other = next((t.request_id for t, _ in holders if victim is None or t.request_id != victim[0].request_id), None)
    return BlockHashOffender(
        block=int(block.block_id), kv_cache_group=group,
        request=str(victim[0].request_id) if victim else None,
        position=victim[1] * victim[0].block_size if victim else None,
        other_request=str(other) if other is not None else None,
    )


def _foreign_offender(table: _Table, j: int, block: Any, tables: list[_Table]) -> BlockHashOffender:
    """The table's request, the block's first token position, the block and the table's group;
    ``other_request``: another request whose table (read this sample) holds the block."""
    other = next((t.request_id for t, _ in _holders(block, tables) if t.request_id != table.request_id), None)
    return BlockHashOffender(
        block=int(block.block_id), kv_cache_group=int(table.group), request=str(table.request_id),
        position=j * table.block_size, other_request=str(other) if other is not None else None,
    )
