"""The block-hash provenance check (``otel_swa.views.vllm_block_hashes``) on a prefix cache and block
tables built by hand, without vLLM.

vLLM's real ``Scheduler`` and ``BlockPool`` drive it in ``test_vllm_block_hashes_real.py`` (marker
``vllm``). Here: states vLLM 0.33 reaches only through a bug, each made on purpose, with what the
check must count known from how the state was made (never read back from the code): a map entry
left behind by an eviction, a block of another KV cache group, a block at another index, partial
prefix entries (secondary keys), duplicate blocks under one key, and the budget's passes.

The objects have vLLM 0.33's attribute names (``KVCacheBlock.block_id``, ``is_null``,
``block_hash``, ``block_hash_num_tokens``; ``BlockPool.cached_block_hash_to_block._cache``,
``cached_block_hashes_by_block``, ``hash_block_size``; the managers' ``req_to_blocks``,
``block_size``, ``kv_cache_group_id``; ``Request.block_hashes``). The hashes are SHA-256 chains over
the tokens of each block, with the group id appended in 4 big-endian bytes, as vLLM builds them.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest

from otel_swa.views.base import BlockHashOffender
from otel_swa.views.vllm_block_hashes import BlockHashCheck, block_hash_findings, good_entry

BS = 16


class Block:
    def __init__(self, block_id: int, is_null: bool = False) -> None:
        self.block_id, self.is_null = block_id, is_null
        self.block_hash = self.block_hash_num_tokens = None


class FullAttentionManager:
    def __init__(self, group: int, block_size: int = BS) -> None:
        self.kv_cache_group_id, self.block_size, self.req_to_blocks = group, block_size, defaultdict(list)


class SlidingWindowManager(FullAttentionManager):
    pass


class MambaManager(FullAttentionManager):
    pass


NULL = Block(0, is_null=True)


def chain(tokens: list[int], hash_block_size: int = BS) -> list[bytes]:
    """One SHA-256 hash per full block of ``tokens``, each over the previous hash and the block."""
    out, parent = [], b"\0" * 32
    for start in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        parent = hashlib.sha256(parent + bytes(str(tokens[start:start + hash_block_size]), "ascii")).digest()
        out.append(parent)
    return out


def key(block_hash: bytes, group: int) -> bytes:
    return block_hash + group.to_bytes(4, "big")


class World:
    """A pool of 40 blocks, a full-attention group 0 and a sliding-window group 1, requests by id."""

    def __init__(self, *, hash_block_size: int = BS) -> None:
        self.blocks = [NULL] + [Block(i) for i in range(1, 40)]
        self.cache: dict = {}
        self.secondary: dict = {}
        self.pool = SimpleNamespace(cached_block_hash_to_block=SimpleNamespace(_cache=self.cache),
                                    cached_block_hashes_by_block=self.secondary, hash_block_size=hash_block_size)
        self.managers = (FullAttentionManager(0), SlidingWindowManager(1))
        self.kv = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=self.managers, block_pool=self.pool))
        self.requests: dict = {}
        self.next_block = 1

    def new_block(self) -> Block:
        block = self.blocks[self.next_block]
        self.next_block += 1
        return block

    def cache_block(self, block: Block, block_hash: bytes, group: int, num_tokens: int) -> None:
        k = key(block_hash, group)
        block.block_hash, block.block_hash_num_tokens = k, num_tokens
        entry = self.cache.get(k)
        if entry is None:
            self.cache[k] = block
        else:
            self.cache[k] = {**({entry.block_id: entry} if isinstance(entry, Block) else entry), block.block_id: block}

    def admit(self, rid: str, tokens: list[int], *, hit: "str | None" = None, hits: int = 0, null_head: int = 0):
        """A request of ``tokens``: its first ``hits`` blocks of each group those of request ``hit``,
        the rest new; its full blocks cached; the sliding-window table's first ``null_head`` entries
        the null block."""
        hashes = chain(tokens)
        self.requests[rid] = SimpleNamespace(block_hashes=hashes)
        for manager in self.managers:
            g = manager.kv_cache_group_id
            table = manager.req_to_blocks[rid]
            for j in range(math.ceil(len(tokens) / BS)):
                if j < hits:
                    table.append(manager.req_to_blocks[hit][j])
                    continue
                block = self.new_block()
                table.append(block)
                if j < len(hashes):
                    self.cache_block(block, hashes[j], g, (j + 1) * BS)
            if g == 1:
                table[:null_head] = [NULL] * null_head

    def findings(self, budget: "int | None" = None):
        if budget is None:
            return block_hash_findings(self.kv, self.requests)
        return BlockHashCheck(budget).check(self.kv, self.requests)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 1000 + 3 for i in range(n)]


def healthy() -> World:
    """Three requests: b shares a's first two blocks (prefix hits), c is its own; sliding-window
    tables with null heads."""
    w = World()
    shared = tokens(1, 32)
    w.admit("a", shared + tokens(2, 40))           # 72 tokens: 4 full blocks + a partial one
    w.admit("b", shared + tokens(3, 20), hit="a", hits=2, null_head=1)  # 52 tokens
    w.admit("c", tokens(4, 48), null_head=2)       # 48 tokens: 3 full blocks
    return w


def hashed_entries(w: World) -> int:
    """Table entries that carry a hash (not the null block), counted from how the world was built."""
    return sum(1 for m in w.managers for table in m.req_to_blocks.values() for b in table
               if not b.is_null and b.block_hash is not None)


def test_a_healthy_cache_counts_every_entry_and_no_fault():
    w = healthy()
    found = w.findings()
    # map: a's 4 + c's 3 full blocks per group, b's one own full block (its 3rd) per group; b's hits
    # add no entry. Tables: a 5+5 entries (4+4 hashed), b 4+4 (3+2 hashed: one null head), c 3+3 (3+1).
    assert len(w.cache) == 2 * (4 + 3 + 1)
    assert hashed_entries(w) == 8 + 5 + 4
    assert (found.entries_checked, found.stale_entries, found.foreign_blocks) == (16 + 17, 0, 0)
    assert found.first_stale is None and found.first_foreign is None


def test_secondary_keys_and_duplicate_blocks_are_good_entries():
    """A partial prefix entry (a second key of a block, ``cached_block_hashes_by_block``) and two
    blocks cached under one key (vLLM does not de-duplicate: a dict of blocks by id) are good."""
    w = healthy()
    a = w.requests["a"]
    block = w.managers[0].req_to_blocks["a"][1]
    partial = key(hashlib.sha256(b"partial boundary").digest(), 0)
    w.cache[partial] = block
    w.secondary[block.block_id] = {partial}
    twin = w.new_block()
    w.cache_block(twin, a.block_hashes[0], 0, BS)  # a second block under a's first key
    assert isinstance(w.cache[key(a.block_hashes[0], 0)], dict)
    found = w.findings()
    assert (found.entries_checked, found.stale_entries, found.foreign_blocks) == (16 + 2 + 17, 0, 0)
    assert good_entry(partial, block, w.secondary) and not good_entry(partial, twin, w.secondary)


def test_a_stale_entry_is_counted_with_the_request_that_took_its_block_and_the_owner():
    """vLLM's eviction removes a block's map entries and resets its hash; here the entry stays. The
    block goes to request d (uncached yet), and request e, whose prompt is a's, takes it through the
    stale entry at its index 2 (tokens 32-47): e now reads d's KV there."""
    w = healthy()
    victim = w.managers[0].req_to_blocks["a"][2]
    del w.managers[0].req_to_blocks["a"], w.managers[1].req_to_blocks["a"]  # a finished; its blocks evicted
    victim.block_hash = victim.block_hash_num_tokens = None  # eviction resets the hash, the entry stays
    w.requests.pop("a")
    w.requests["d"] = SimpleNamespace(block_hashes=[])  # 10 tokens: no full block, no hash
    w.managers[0].req_to_blocks["d"] = [victim]
    prompt = tokens(1, 32) + tokens(2, 40)
    hashes = chain(prompt)
    w.requests["e"] = SimpleNamespace(block_hashes=hashes)
    others = [w.new_block() for _ in range(2)]
    w.managers[0].req_to_blocks["e"] = [others[0], others[1], victim]
    for j, b in enumerate(others):
        w.cache_block(b, hashes[j], 0, (j + 1) * BS)
    found = w.findings()
    assert (found.stale_entries, found.foreign_blocks) == (1, 0)
    assert found.first_stale == BlockHashOffender(block=victim.block_id, kv_cache_group=0, request="e",
                                                  position=32, other_request="d")


def test_foreign_blocks_of_another_request_another_group_and_another_index():
    w = healthy()
    full, swa = w.managers
    # 1. c's full-attention entry 1 replaced by a's block 1 (a's KV, a's hash)
    full.req_to_blocks["c"][1] = full.req_to_blocks["a"][1]
    # 2. b's sliding-window entry 3 replaced by a full-attention block of b's own tokens (vllm#47574:
    #    the right tokens' hash, group 0's id)
    own = w.new_block()
    w.cache_block(own, w.requests["b"].block_hashes[2], 0, 3 * BS)
    swa.req_to_blocks["b"][2] = own
    # 3. a's full-attention entries 2 and 3 swapped (each holds the other index's tokens)
    t = full.req_to_blocks["a"]
    t[2], t[3] = t[3], t[2]
    found = w.findings()
    assert (found.stale_entries, found.foreign_blocks) == (0, 4)
    # the first in check order: requests as first met (a, b, c), each group's table, each entry
    assert found.first_foreign == BlockHashOffender(block=t[2].block_id, kv_cache_group=0, request="a",
                                                    position=32, other_request=None)
    del full.req_to_blocks["a"], swa.req_to_blocks["a"]
    found = w.findings()
    assert found.foreign_blocks == 2
    assert found.first_foreign == BlockHashOffender(block=own.block_id, kv_cache_group=1, request="b",
                                                    position=32, other_request=None)


def test_a_foreign_block_names_the_other_request_that_holds_it():
    w = healthy()
    full = w.managers[0]
    full.req_to_blocks["c"][1] = full.req_to_blocks["a"][1]
    found = w.findings()
    assert found.foreign_blocks == 1
    assert found.first_foreign == BlockHashOffender(block=full.req_to_blocks["a"][1].block_id, kv_cache_group=0,
                                                    request="c", position=16, other_request="a")


def test_a_hash_past_the_requests_own_tokens_or_not_on_a_hash_boundary_is_foreign():
    w = healthy()
    c = w.managers[0].req_to_blocks["c"]
    tail = w.new_block()
    tail.block_hash, tail.block_hash_num_tokens = key(b"\1" * 32, 0), 4 * BS  # c has 3 hashes only
    c.append(tail)
    odd = c[0]
    odd.block_hash_num_tokens = BS - 3  # not a multiple of the hash block size
    found = w.findings()
    assert found.foreign_blocks == 2 and found.first_foreign.request == "c" and found.first_foreign.position == 0


def test_partial_primary_hashes_inside_the_block_are_the_requests_own():
    """Hash blocks of 8 tokens in blocks of 16: a block whose primary hash covers 8 of its tokens
    (a partial prefix entry, ``cache_partial_block``) is the request's own when that hash is the
    request's at 8 tokens; at 24 tokens it lies past the block's end."""
    w = World(hash_block_size=8)
    prompt = tokens(5, 40)
    hashes = chain(prompt, 8)  # 5 hashes, one per 8 tokens
    w.requests["p"] = SimpleNamespace(block_hashes=hashes)
    blocks = [w.new_block() for _ in range(3)]
    w.managers[0].req_to_blocks["p"] = blocks
    w.cache_block(blocks[0], hashes[1], 0, 16)
    w.cache_block(blocks[1], hashes[3], 0, 32)
    w.cache_block(blocks[2], hashes[4], 0, 40)  # tokens 32-39 of the block's 32-47
    found = w.findings()
    assert (found.entries_checked, found.stale_entries, found.foreign_blocks) == (6, 0, 0)
    blocks[2].block_hash_num_tokens = 56
    assert w.findings().foreign_blocks == 1


def test_the_null_block_and_other_kinds_of_tables_are_not_judged():
    w = healthy()
    mamba = MambaManager(2)
    mamba.req_to_blocks["a"] = [w.managers[0].req_to_blocks["c"][0]]  # would be foreign in a checked table
    w.kv.coordinator.single_type_managers = (*w.managers, mamba)
    assert w.findings().foreign_blocks == 0
    w.cache[key(b"\2" * 32, 1)] = NULL  # the null block in the map is a stale entry
    found = w.findings()
    assert found.stale_entries == 1 and found.first_stale.block == 0 and found.first_stale.kv_cache_group == 1


def test_the_budget_sweeps_the_map_and_the_tables_in_passes():
    """Budget 5: 16 map entries are read in 4 samples per pass; a stale entry is counted at the
    sample whose slice holds it and again one pass later. Tables: whole requests, at least one a
    sample, until the budget is reached."""
    w = healthy()
    stale_key = list(w.cache)[11]
    block = w.cache[stale_key]
    block.block_hash = key(b"\3" * 32, 0)  # its entry is now stale (and its table entries foreign)
    check = BlockHashCheck(budget=5)
    seen = [check.check(w.kv, w.requests) for _ in range(8)]
    # map slices per sample: 0-4, 5-9, 10-14, 15; then again. The key at 11 is in the third.
    assert [f.stale_entries for f in seen] == [0, 0, 1, 0, 0, 0, 1, 0]
    # tables: a (10 entries) alone, b (8), c (6); then a pass again from a
    holders = {rid for m in w.managers for rid, t in m.req_to_blocks.items() if block in t}
    assert holders == {"c"}
    assert [f.foreign_blocks for f in seen[:6]] == [0, 0, 1, 0, 0, 1]
    assert seen[2].first_foreign.request == "c"


def test_entries_gone_during_a_pass_are_skipped_and_new_ones_wait_for_the_next():
    w = healthy()
    check = BlockHashCheck(budget=4)
    first = check.check(w.kv, w.requests)
    gone = list(w.cache)[5]
    del w.cache[gone]
    late = key(b"\4" * 32, 0)
    w.cache[late] = w.blocks[1]  # stale, added after the pass began
    counts = [check.check(w.kv, w.requests).stale_entries for _ in range(3)]  # the rest of the pass
    assert first.stale_entries == 0 and counts == [0, 0, 0]
    nxt = [check.check(w.kv, w.requests).stale_entries for _ in range(5)]  # the next pass: 16 keys
    assert nxt == [0, 0, 0, 1, 0]  # the new key is the last, in the pass's fourth slice


def test_bad_input():
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        BlockHashCheck(budget=0)
    with pytest.raises(TypeError, match="is not vLLM 0.33's KVCacheManager"):
        BlockHashCheck().check(object(), {})
    w = healthy()
    w.pool.cached_block_hash_to_block._cache = [1]
    with pytest.raises(TypeError, match="_cache is not a dict"):
        w.findings()


def test_requests_unknown_to_the_scheduler_are_not_read():
    w = healthy()
    w.managers[0].req_to_blocks["c"][1] = w.managers[0].req_to_blocks["a"][1]
    requests = {rid: r for rid, r in w.requests.items() if rid != "c"}
    assert block_hash_findings(w.kv, requests).foreign_blocks == 0


def test_the_findings_reach_the_record_its_lines_and_check(tmp_path):
    """Through the reporter: the view's findings become the record's three provenance fields and
    one fault line per fault with its first offender; ``otel-swa check`` on the lines fails and
    names the block; a view without findings gives a record without provenance fields (no
    provenance line)."""
    import contextlib
    import io

    from otel_swa.cli import main as otel_swa_cli
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.views import vllm

    w = healthy()
    full = w.managers[0]
    full.req_to_blocks["c"][1] = full.req_to_blocks["a"][1]  # foreign: a's block in c's table
    stale = list(w.cache)[4]  # a's sliding-window block 0: its own hash made another
    w.cache[stale].block_hash = key(b"\5" * 32, 1)
    found = w.findings()
    assert (found.stale_entries, found.foreign_blocks) == (1, 2)  # the block's own table entry is foreign too
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda r, c: records.append(r)])
    swa = w.managers[1]
    reporter.step(vllm.read_window_table(swa, ["a"], [72]).view(kv_block_hashes=found))
    reporter.step(vllm.read_window_table(swa, ["a"], [72]).view())
    reporter.close()
    with_findings, without = records
    assert (with_findings.kv_cache_entries_checked, with_findings.kv_stale_cache_entries,
            with_findings.kv_foreign_blocks) == (found.entries_checked, 1, 2)
    # check order: request a first; its sliding-window block 0 carries the changed hash. The stale
    # entry's block is a's at index 0, whose own hash is the key: a took it through the entry.
    changed = w.cache[stale].block_id
    assert with_findings.offender("kv_foreign_blocks").location() == {
        "request": "a", "position": 0, "block": changed, "kv_cache_group": 1}
    assert with_findings.offender("kv_stale_cache_entries").location() == {
        "request": "a", "position": 0, "block": changed, "kv_cache_group": 1}
    assert without.kv_stale_cache_entries is None and without.provenance_line() is None
    log = tmp_path / "run.log"
    log.write_text("".join(line + "\n" for r in records for line in r.lines()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = otel_swa_cli(["check", str(log)])
    text = out.getvalue()
    assert status == 1, text
    assert "peak kv_stale_cache_entries=1" in text and "peak kv_foreign_blocks=2" in text, text
    assert f"request a, position 0, block {changed} (KV cache group 1)" in text, text
