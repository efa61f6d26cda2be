"""The reporter inside CUDA graph capture, and the sample and audit on CUDA against
a plain recount. Every test here needs a CUDA device (marker ``gpu``; skipped without one)."""

import random

import pytest
import torch

from otel_swa.device import DENSE_FILL_RATIO, STAGE_WIDTH, Workspace, audit_counts, read_sample, stage_sample
from otel_swa.reporter import KVPool, SwaDivergenceReporter
from otel_swa.views import SwaBatch

pytestmark = pytest.mark.gpu

REPLAYS = 100


def small_view(device):
    """One request of 4 tokens: FULL slots 1..4, mapped to 1 (same), 6 (remapped), 0, 0 (freed)."""
    req_to_token = torch.tensor([[0, 0, 0, 0], [1, 2, 3, 4]], dtype=torch.int32, device=device)
    mapping = torch.tensor([0, 1, 6, 0, 0, 0, 0, 0], dtype=torch.int64, device=device)
    return SwaBatch(req_to_token, mapping, torch.tensor([1], device=device), torch.tensor([4], device=device),
                    seq_lens_cpu=[4], req_pool_indices_cpu=[1])


@pytest.mark.parametrize("interval", [1, 64])
def test_reporter_inside_captured_forwards_replayed_with_eager_steps_between(interval):
    """Several forwards are captured with the reporter's calls inside them (device-tensor counts, a
    device sum as SGLang's wrapper observes, a Python int, and step(), which capture must ignore);
    the graphs are replayed 100 times with eager steps after each forward. Every total is exact."""
    device = torch.device("cuda")
    records = []
    reporter = SwaDivergenceReporter(interval, device=device, ring_size=4, sinks=[lambda r, c: records.append(r)])
    view = small_view(device)
    seq_lens = torch.tensor([5, 9, 2], device=device)  # a batch's lengths, on the device
    window = 4

    def forward(scale):
        # what the engine's forward counts, as device reductions (no sync), plus a constant
        reporter.observe(KVPool.FULL, seq_lens.sum() * scale)  # 16 * scale
        reporter.observe(KVPool.SWA, seq_lens.clamp(max=window).sum())  # 4 + 4 + 2 = 10
        reporter.observe(KVPool.SWA, 1)  # a Python int: captured as a constant
        reporter.step(view)  # inside capture: ignored

    expected_full = expected_swa = 0
    steps = 0

    def eager_step():
        nonlocal steps
        steps += 1
        reporter.step(view)  # after the replayed forward, outside capture

    # warm-up on a side stream, eagerly (as PyTorch asks before capture): 3 forwards, 3 steps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward(1)
            steps += 1
            expected_full += 16
            expected_swa += 11
    torch.cuda.current_stream().wait_stream(side)
    assert reporter.forward_ct == 3
    # a sample may be pending now (interval 1): capture must not poll its event
    two_forwards, one_forward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(two_forwards):
        forward(1)
        forward(2)
    with torch.cuda.graph(one_forward):
        forward(3)
    assert reporter.forward_ct == 3  # capture ran no forward: host state unchanged
    assert reporter.stats.skipped_captures == 3
    for _ in range(REPLAYS):
        two_forwards.replay()
        eager_step()
        eager_step()
        one_forward.replay()
        eager_step()
        expected_full += 16 * (1 + 2 + 3)
        expected_swa += 11 * 3
    reporter.close()
    torch.cuda.synchronize()
    assert reporter.totals.tolist() == [expected_full, expected_swa]
    assert reporter.forward_ct == steps == 3 + 3 * REPLAYS
    assert reporter.stats.skipped_captures == 3
    assert [r.forward_ct for r in records] == list(range(interval, steps + 1, interval))
    assert {(r.swa_full_idx_divergence, r.swa_out_of_window_tokens) for r in records} == {(1, 2)}
    # each record's totals: recomputed from the step it was taken at
    for record in records:
        step = record.forward_ct
        if step <= 3:
            full, swa = 16 * step, 11 * step
        else:
            done, part = divmod(step - 3, 3)  # whole replay rounds, then steps into the next one
            full = 48 + 96 * done + 16 * (0, 3, 3)[part]
            swa = 33 + 33 * done + 11 * (0, 2, 2)[part]
        assert (record.verify_full, record.verify_swa) == (full, swa), step


def test_flush_and_close_inside_capture_do_nothing_and_keep_the_reporter_open():
    device = torch.device("cuda")
    records = []
    reporter = SwaDivergenceReporter(1, device=device, sinks=[lambda r, c: records.append(r)])
    view = small_view(device)
    reporter.step(view)
    graph = torch.cuda.CUDAGraph()
    one, two = torch.tensor(1, device=device), torch.tensor(2, device=device)  # made before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reporter.observe("full", one)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        reporter.observe("full", two)
        reporter.flush()
        reporter.close()
    assert not reporter.closed
    graph.replay()
    reporter.close()
    assert [r.forward_ct for r in records] == [1] and reporter.closed
    assert reporter.totals.tolist() == [1 + 2, 0]  # warm-up and one replay (capture itself adds nothing)


@pytest.mark.parametrize("path", ["live", "dense", "no host lengths"])
def test_sample_on_cuda_equals_the_recount(path):
    rng = random.Random(5)
    ws = Workspace("cuda")
    for _ in range(30):
        num_rows, width, full_size = rng.randint(1, 9), rng.randint(1, 300), rng.randint(2, 5000)
        req_to_token = [[rng.randrange(0, full_size) for _ in range(width)] for _ in range(num_rows)]
        mapping = [0] + [rng.choice([0, s, rng.randrange(1, full_size)]) for s in range(1, full_size)]
        rows = [rng.randrange(0, num_rows) for _ in range(rng.randint(1, 12))]
        lens = [rng.choice([0, width, rng.randint(0, width)]) for _ in rows]
        out = torch.zeros(STAGE_WIDTH, dtype=torch.int64, device="cuda")
        meta = stage_sample(
            out, torch.zeros(2, dtype=torch.int64, device="cuda"), torch.tensor(req_to_token, dtype=torch.int32, device="cuda"),
            torch.tensor(mapping, device="cuda"), torch.tensor(rows, device="cuda"), torch.tensor(lens, device="cuda"),
            None if path == "no host lengths" else lens, workspace=ws,
            dense_fill_ratio={"live": float("inf"), "dense": 0.0}.get(path, DENSE_FILL_RATIO),
        )
        reading = read_sample(out.tolist(), meta)
        expected = [0, 0]
        for row, n in zip(rows, lens):
            for full in req_to_token[row][:n]:
                swa = mapping[full]
                expected[1] += swa == 0
                expected[0] += swa != 0 and swa != full
        assert reading.faults == () and [reading.divergence, reading.out_of_window] == expected


def test_audit_on_cuda_equals_the_cpu_audit():
    rng = random.Random(8)
    for _ in range(20):
        pages, page_size = rng.randint(1, 500), rng.choice([1, 16])
        full_size = rng.randint(2, 20000)
        swa_slots = (pages + 1) * page_size
        mapping = torch.tensor([0] + [rng.choice([0, rng.randrange(0, swa_slots + 3)]) for _ in range(full_size - 1)])
        free = torch.tensor([rng.randrange(-1, pages + 2) for _ in range(rng.randint(0, pages))], dtype=torch.int64)
        holders = torch.tensor([rng.randrange(-2, full_size + 3) for _ in range(rng.randint(0, 4000))], dtype=torch.int64)
        cpu, gpu = torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64, device="cuda")
        audit_counts(cpu, mapping, free, pages, page_size, holders)
        audit_counts(gpu, mapping.cuda(), free.cuda(), pages, page_size, holders.cuda(), Workspace("cuda"))
        assert gpu.tolist() == cpu.tolist()


def test_the_read_check_is_captured_in_a_cuda_graph_and_replayed():
    """The read check's device work has fixed shapes and no host read: captured once, replayed, it
    counts each replay's queries, and a wrong read written into the pool between replays is seen."""
    from otel_swa.device.read_check import ReadCheck, read_counts

    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch, width, heads, dim, window = 4, 32, 2, 16, 8
    req_to_token = (torch.arange(batch * width, dtype=torch.int32) + 1).reshape(batch, width).to(device)
    slots = batch * width + 1
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots - 1, generator=gen) + 1]).to(device)
    k = torch.randn((slots, heads, dim), generator=gen).to(device)
    v = torch.randn((slots, heads, dim), generator=gen).to(device)
    q = torch.randn((batch, heads, dim), generator=gen).to(device)
    rows = torch.arange(batch, device=device)
    lens = torch.full((batch,), width, device=device)
    # the engine's output: attention over each last token's window at the mapping's slots
    keys = req_to_token[:, width - window:].long()
    swa = mapping[keys]
    scores = torch.einsum("bhd,bwhd->bhw", q, k[swa]) / dim**0.5
    out = torch.einsum("bhw,bwhd->bhd", scores.softmax(-1), v[swa])
    check = ReadCheck(device, max_queries=batch)

    def run():
        check.check_layer(layer_id=0, q=q, out=out, k_buffer=k, v_buffer=v, req_to_token=req_to_token,
                          full_to_swa_index_mapping=mapping, req_pool_indices=rows, seq_lens=lens, query_rows=None,
                          window=window, scaling=1 / dim**0.5, num_q_heads=heads)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    assert read_counts(check.take().tolist()) == (batch, 0, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    check.reset()
    for _ in range(5):
        graph.replay()
    assert read_counts(check.cells.tolist()) == (5 * batch, 0, 0)
    check.reset()
    k[swa[2, -1]] += 3.0  # request 2's own newest key changed behind the engine's back
    graph.replay()
    assert read_counts(check.cells.tolist()) == (batch, 1, 0)
