"""The write check over vLLM 0.33's paged KV cache captured into a CUDA graph with the store it
checks, replayed with the sampling flag set and unset, with and without a faulty store, against the
same steps run eagerly. Needs a CUDA device (marker ``gpu``; skipped without one).

The store is ``reshape_and_cache_flash``'s semantics in torch (token ``i`` at block ``slot //
block_size``, offset ``slot % block_size`` of the split ``kv_cache.transpose(1, 2).split(head_size,
-1)``; ``-1`` not stored, here sent to slot 0 of the null block, which the check never counts), with
a device-side fault switch (``shift``: every token written one slot further) so that one capture
replays both. One layer of each KV cache group kind, cache layout ``LBNHC`` (physical ``[blocks,
tokens, heads, K|V]``), bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.paged_write import paged_layer_store
from otel_swa.device.write_check import WriteCheck, write_counts, write_offender_fields

pytestmark = pytest.mark.gpu

BLOCKS, BS, H, D = 32, 16, 2, 64
T, VALID, PAD = 8, 6, 3  # slot mapping length, tokens not padding, extra key rows
STEPS = 8


class Step:
    """The static buffers one captured step reads (the runner's persistent inputs)."""

    def __init__(self, device):
        self.slots = torch.full((T,), -1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(T, dtype=torch.int64, device=device)
        self.key = torch.zeros(2, T + PAD, H, D, device=device)
        self.value = torch.zeros(2, T + PAD, H, D, device=device)
        self.shift = torch.zeros((), dtype=torch.int64, device=device)
        self.caches = [torch.zeros(BLOCKS, BS, H, 2 * D, dtype=torch.bfloat16, device=device).permute(0, 2, 1, 3)
                       for _ in range(2)]

    def load(self, step: int, fault: bool) -> None:
        g = torch.Generator().manual_seed(step)
        base = 16 + (step * VALID) % (BLOCKS * BS - 64)
        self.slots.copy_(torch.tensor(list(range(base, base + VALID)) + [-1] * (T - VALID)))
        self.positions.copy_(torch.arange(step, step + T))
        self.key.copy_(torch.randn(2, T + PAD, H, D, generator=g))
        self.value.copy_(torch.randn(2, T + PAD, H, D, generator=g))
        self.shift.fill_(1 if fault else 0)

    def forward(self, check: WriteCheck) -> None:
        for layer, cache in enumerate(self.caches):
            key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
            slots = torch.where(self.slots.ge(0), self.slots + self.shift, torch.zeros_like(self.slots))
            key_cache[slots // BS, slots % BS] = self.key[layer, :T].to(cache.dtype)
            value_cache[slots // BS, slots % BS] = self.value[layer, :T].to(cache.dtype)
            swa = layer == 1
            if check.gate.wanted() and check.wants(layer, swa):
                check.check_layer(paged_layer_store(layer, swa, self.key[layer], self.value[layer], cache, self.slots,
                                                    head_size=D, positions=self.positions))


def run(mode: str, fault_from: "int | None", graph_mode: str = "masked") -> list:
    """The cells taken after each sampled step (interval 2: steps 1, 3, 5, 7 sampled)."""
    device = torch.device("cuda")
    gate = SamplingGate(device, graph_mode=graph_mode)
    check = WriteCheck(device, gate)
    step = Step(device)
    graph = None
    if mode == "graph":
        step.load(0, False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step.forward(check)  # warm-up, not sampled: the check does not run
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.forward(check)
        assert gate.recorded_calls == 2
    taken = []
    for i in range(STEPS):
        step.load(i, fault_from is not None and i >= fault_from)
        due = i % 2 == 1
        gate.set(due)
        if graph is None:
            step.forward(check)
        else:
            graph.replay()
        if due:
            taken.append(check.take().tolist())
    torch.cuda.synchronize()
    return taken


@pytest.mark.parametrize("graph_mode", ["masked", "conditional"])
@pytest.mark.parametrize("fault_from", [None, 4])
def test_replayed_store_and_check_equal_the_eager_ones(graph_mode, fault_from):
    eager = run("eager", fault_from)
    graph = run("graph", fault_from, graph_mode)
    assert graph == eager
    for i, cells in zip((1, 3, 5, 7), graph):
        faulty = fault_from is not None and i >= fault_from
        assert write_counts(cells) == (2 * VALID, 2 * VALID if faulty else 0, 0)
        first = write_offender_fields(cells)
        assert (first is not None) == faulty
        if faulty:
            assert first["layer"] == 0 and first["pool"] == "full" and first["swa_slot"] is None
            assert first["position"] == i + first["entry"]


def test_unsampled_replays_count_nothing():
    device = torch.device("cuda")
    gate = SamplingGate(device)
    check = WriteCheck(device, gate)
    step = Step(device)
    step.load(0, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.forward(check)
    gate.set(False)
    for i in range(4):
        step.load(i, True)
        graph.replay()
    assert write_counts(check.take().tolist()) == (0, 0, 0)
