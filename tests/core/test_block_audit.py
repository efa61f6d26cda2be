"""The KV block audit against a plain-Python recount of its definition, and through the reporter."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_swa.device.block_audit import BLOCK_CELLS, stage_block_audit
from otel_swa.record import Offender
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views.base import KvBlockAuditInputs, SwaBatch


def _inputs(num_blocks, free, cached, held, null=0):
    t = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return KvBlockAuditInputs(
        num_blocks=num_blocks, free_block_ids=t(free), cached_block_ids=t(cached),
        held_block_ids=t([b for b, _, _, _ in held]), held_groups=t([g for _, g, _, _ in held]),
        held_rows=t([r for _, _, r, _ in held]), held_positions=t([p for _, _, _, p in held]),
        held_request_ids=[f"req-{i}" for i in range(8)], null_block_id=null,
    )


def recount(num_blocks, free, cached, held, null=0):
    """The definitions of otel_swa.device.block_audit, block by block."""
    valid = lambda b: 0 <= b < num_blocks  # noqa: E731
    free_set = {b for b in free if valid(b)}
    cached_set = {b for b in cached if valid(b)}
    held_set = {b for b, _, _, _ in held if valid(b)}
    leaked = [b for b in range(num_blocks) if b != null and b not in free_set | held_set | cached_set]
    exposed = [entry for entry in held if valid(entry[0]) and entry[0] in free_set]
    requests = {}
    for block, _, row, _ in held:
        if valid(block) and block not in cached_set:
            requests.setdefault(block, set()).add(row)
    shared_blocks = {block for block, rows in requests.items() if len(rows) > 1}
    return leaked, exposed, shared_blocks


def _stage(inputs):
    out = torch.zeros(len(BLOCK_CELLS), dtype=torch.int64)
    return dict(zip(BLOCK_CELLS, stage_block_audit(out, inputs).tolist()))


ids = st.integers(min_value=-2, max_value=40)


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(1, 36),
    free=st.lists(ids, max_size=30),
    cached=st.lists(ids, max_size=10),
    held=st.lists(st.tuples(ids, st.integers(0, 2), st.integers(0, 7), st.integers(0, 999)), max_size=30),
    null=st.integers(0, 3),
)
def test_counts_and_first_offenders_equal_the_recount(num_blocks, free, cached, held, null):
    null = min(null, num_blocks - 1)
    leaked, exposed, shared = recount(num_blocks, free, cached, held, null)
    cells = _stage(_inputs(num_blocks, free, cached, held, null))
    assert cells["leaked"] == len(leaked)
    assert cells["freed_in_use"] == len(exposed)
    assert cells["shared"] == len(shared)
    if shared:  # a held entry of a shared block, with its own group, request and position
        entry = (cells["shared_block"], cells["shared_group"], cells["shared_row"], cells["shared_position"])
        assert cells["shared_block"] in shared and entry in held
    if leaked:
        assert cells["leaked_block"] == leaked[0]
    if exposed:
        block, group, row, position = exposed[0]
        assert (cells["freed_block"], cells["freed_group"], cells["freed_row"], cells["freed_position"]) == (
            block, group, row, position)


def _view(inputs):
    empty = torch.zeros(0, dtype=torch.int64)
    return SwaBatch(torch.zeros((1, 4), dtype=torch.int32), torch.zeros(8, dtype=torch.int64), empty, empty,
                    seq_lens_cpu=[], divergence_applicable=False, kv_block_audit=inputs)


def test_the_reporter_records_the_block_audit_and_names_the_first_offenders():
    records = []
    reporter = SwaDivergenceReporter(1, sinks=[lambda record, context: records.append(record)])
    # 10 blocks: 0 null, 1-3 free, 4-6 held by two requests, 7 cached and free (evictable), 8 and 9
    # taken off the free queue by nobody: leaked; block 2 is also in req-1's table: freed in use;
    # block 5 is in both requests' tables and not cached: shared
    held = [(4, 0, 0, 0), (5, 0, 0, 16), (6, 1, 1, 0), (2, 1, 1, 16), (5, 1, 1, 32)]
    reporter.step(_view(_inputs(10, [1, 2, 3, 7], [7], held)))
    # healthy: block 7 cached, in both tables (a prefix hit), off the free queue
    healthy = [(7, 0, 0, 0), (4, 0, 0, 16), (5, 0, 0, 32), (7, 1, 1, 0), (6, 1, 1, 16), (8, 1, 1, 32), (9, 1, 1, 48)]
    reporter.step(_view(_inputs(10, [1, 2, 3], [7], healthy)))
    reporter.close()
    faulty, clean = records
    assert (faulty.kv_leaked_blocks, faulty.kv_freed_blocks_in_use, faulty.kv_shared_blocks) == (2, 1, 1)
    assert faulty.offenders[:2] == (
        Offender("kv_leaked_blocks", block=8),
        Offender("kv_freed_blocks_in_use", request="req-1", position=16, block=2, kv_cache_group=1),
    )
    shared = faulty.offenders[2]
    assert shared.fault == "kv_shared_blocks" and shared.block == 5 and (shared.request, shared.position) in (
        ("req-0", 16), ("req-1", 32))
    assert (clean.kv_leaked_blocks, clean.kv_freed_blocks_in_use, clean.kv_shared_blocks, clean.offenders) == (
        0, 0, 0, ())
    assert faulty.divergence_applicable is False


def test_a_view_with_bad_block_audit_inputs_is_refused_with_the_name():
    import pytest

    reporter = SwaDivergenceReporter(1)
    bad = _inputs(10, [1], [], [(4, 0, 0, 0)])
    bad = KvBlockAuditInputs(**{**bad.__dict__, "held_groups": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="kv_block_audit.held_groups has 3 entries but held_block_ids has 1"):
        reporter.step(_view(bad))
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        reporter.step(_view(KvBlockAuditInputs(**{**bad.__dict__, "num_blocks": 0})))
