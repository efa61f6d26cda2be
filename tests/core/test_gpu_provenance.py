"""The in-forward checks captured into a CUDA graph and replayed: stamps, checksums, the write check
and the read check, with and without a fault, against the same loop run eagerly. Every test needs
a CUDA device (marker ``gpu``; skipped without one)."""

from __future__ import annotations

import pytest
import torch

import decode_loop

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graph_mode", ["masked", "conditional"])
@pytest.mark.parametrize("fault_at", [None, 4])
def test_a_replayed_decode_step_is_checked_as_an_eager_one(graph_mode, fault_at):
    """One capture, eight replays with the sampling flag set before each (interval 2): every sample's
    read check, write check and provenance equal the eager loop's; a store at the raw FULL slots
    from step 4 is a write mismatch and a corrupt SWA slot at steps 4, 6 and 8, not before."""
    eager = decode_loop.run("cuda", mode="eager", fault_at=fault_at)
    graph = decode_loop.run("cuda", mode="graph", fault_at=fault_at, graph_mode=graph_mode)
    assert [step for step, _ in graph] == [step for step, _ in eager] == [2, 4, 6, 8]
    assert [decode_loop.summary(r) for _, r in graph] == [decode_loop.summary(r) for _, r in eager]
    for step, reading in graph:
        faulty = fault_at is not None and step >= fault_at
        assert reading.read == (4, 0, 0)
        assert reading.write[:2] == (8, 4 if faulty else 0)
        assert (reading.provenance.corrupt_tokens > 0) == faulty
        assert reading.provenance.foreign_tokens == 0 and reading.provenance.stamp_checks > 0


def test_the_stamps_written_by_replays_are_the_eager_ones():
    """The stamp and checksum tables after eight replays equal those after eight eager steps."""
    from otel_swa.device.stamps import write_stamps

    device = torch.device("cuda")
    r2t = (torch.arange(2 * 32, dtype=torch.int32) + 1).reshape(2, 32).to(device)
    tables = [torch.zeros(70, dtype=torch.int64, device=device) for _ in range(2)]
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    loc = torch.zeros(2, dtype=torch.int64, device=device)
    rows = torch.tensor([0, 1], device=device)

    def load(step):
        ids.copy_(torch.tensor([step * 7 % 11, step * 5 % 13]))
        pos.copy_(torch.tensor([step, step]))
        loc.copy_(r2t[rows, pos].long())

    def forward(table):
        write_stamps(table, ids, pos, loc, rows, r2t)

    load(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(tables[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(tables[1])
    tables[1].zero_()
    for step in range(8):
        load(step)
        forward(tables[0])
        graph.replay()
    torch.cuda.synchronize()
    assert tables[0].tolist() == tables[1].tolist()
    assert int((tables[0] != 0).sum()) == 16
