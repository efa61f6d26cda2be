"""A decode loop over a small hybrid KV cache with every in-forward check inside its forward: the
shape of an engine's CUDA-graph decode step (fixed inputs copied into static buffers, the forward
replayed), run eagerly, on the recorded path without a graph (the CPU), or captured and replayed
(CUDA). Used by ``test_graph_path.py`` and ``test_gpu_provenance.py``.

The cache: 4 requests of prefixes 10, 12, 14 and 16 tokens, FULL slot ``64 * (row - 1) + position +
1``, SWA slots a fixed permutation (``full_to_swa_index_mapping``), 2 KV heads of 8, window 6. A
forward step: stamps (``KvProvenance.stamp``), the full layer's K/V store then ``after_layer``, the
sliding-window layer's store (at ``write_at``: the SWA slots, or with ``fault_at`` from that step the
raw FULL slots, sgl-project/sglang#20181's class) then ``after_layer``, its attention through the
mapping, and the read check when ``reporter.checks_wanted()``.
"""

from __future__ import annotations

from unittest import mock

import torch

import otel_swa.sampling as sampling
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import SwaBatch

from sample_readings import reading_of

BATCH, WIDTH, HEADS, DIM, WINDOW, VOCAB = 4, 64, 2, 8, 6, 50
PREFIX = (10, 12, 14, 16)


def run(device: str, *, mode: str, steps: int = 8, interval: int = 2, fault_at: "int | None" = None,
        graph_mode: str = "masked") -> list:
    """Run the loop; return ``[(forward_ct, SampleReading)]``. ``mode``: ``"eager"`` (checks at
    sampled steps only), ``"recorded"`` (every step on the recorded path, no graph) or ``"graph"``
    (captured once, replayed; CUDA only)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    slots = 64 * BATCH + 1
    r2t = (torch.arange(BATCH * WIDTH, dtype=torch.int32) + 1).reshape(BATCH, WIDTH)
    r2t = torch.cat([torch.zeros((1, WIDTH), dtype=torch.int32), r2t]).to(dev)
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots - 1, generator=gen) + 1]).to(dev)
    tokens = torch.randint(0, VOCAB, (BATCH, WIDTH), generator=gen)
    table_k, table_v, table_q = (torch.randn((VOCAB, HEADS, DIM), generator=gen) for _ in range(3))
    buffers = [torch.zeros((slots, HEADS, DIM), device=dev) for _ in range(4)]  # full k, v; swa k, v
    kf, vf, ks, vs = buffers
    rows = torch.arange(1, BATCH + 1, device=dev)
    readings = []
    reporter = SwaDivergenceReporter(interval, device=dev, graph_mode=graph_mode)
    reporter.gate.force_recorded = mode == "recorded"
    prov = reporter.enable_provenance(full_slots=slots, swa_slots=slots)
    check = reporter.enable_read_check(max_queries=BATCH)

    def kv(ids: torch.Tensor, positions: torch.Tensor):
        scale = 1 + positions.float().view(-1, 1, 1) * 0.01
        return ((table_k[ids] * scale).to(dev), (table_v[ids] * scale).to(dev), (table_q[ids] * scale).to(dev))

    # the step's inputs, in static buffers (a captured graph reads them at each replay)
    static = {name: torch.zeros(BATCH, dtype=torch.int64, device=dev) for name in ("ids", "pos", "loc", "write_at")}
    static.update(k=torch.zeros((BATCH, HEADS, DIM), device=dev), v=torch.zeros((BATCH, HEADS, DIM), device=dev),
                  q=torch.zeros((BATCH, HEADS, DIM), device=dev))
    offsets = torch.arange(WINDOW, device=dev) - (WINDOW - 1)

    def forward() -> None:
        s = static
        prov.stamp(input_ids=s["ids"], positions=s["pos"], out_cache_loc=s["loc"], req_pool_indices=rows,
                   req_to_token=r2t, full_to_swa_index_mapping=mapping)
        kf.index_copy_(0, s["loc"], s["k"])
        vf.index_copy_(0, s["loc"], s["v"])
        prov.after_layer(layer_id=0, swa=False, k=s["k"], v=s["v"], k_buffer=kf, v_buffer=vf, out_cache_loc=s["loc"],
                         full_to_swa_index_mapping=mapping, positions=s["pos"])
        ks.index_copy_(0, s["write_at"], s["k"])
        vs.index_copy_(0, s["write_at"], s["v"])
        prov.after_layer(layer_id=1, swa=True, k=s["k"], v=s["v"], k_buffer=ks, v_buffer=vs, out_cache_loc=s["loc"],
                         full_to_swa_index_mapping=mapping, positions=s["pos"])
        keys = (s["pos"].unsqueeze(1) + offsets).clamp(min=0)
        swa = mapping[r2t[rows.unsqueeze(1), keys].long()]
        scores = torch.einsum("bhd,bwhd->bhw", s["q"], ks[swa]) / DIM**0.5
        out = torch.einsum("bhw,bwhd->bhd", scores.softmax(-1), vs[swa])
        if reporter.checks_wanted():
            check.check_layer(layer_id=1, q=s["q"], out=out, k_buffer=ks, v_buffer=vs, req_to_token=r2t,
                              full_to_swa_index_mapping=mapping, req_pool_indices=rows, seq_lens=s["pos"] + 1,
                              query_rows=None, window=WINDOW, scaling=1 / DIM**0.5, num_q_heads=HEADS)

    def load(step: int) -> None:
        pos = torch.tensor(PREFIX) + step
        ids = tokens[torch.arange(BATCH), pos]
        k, v, q = kv(ids, pos)
        loc = r2t[rows, pos.to(dev)].long()
        faulty = fault_at is not None and step + 1 >= fault_at
        for name, value in (("ids", ids), ("pos", pos), ("loc", loc), ("write_at", loc if faulty else mapping[loc]),
                            ("k", k), ("v", v), ("q", q)):
            static[name].copy_(value)

    load(0)
    graph = None
    side = torch.cuda.Stream() if dev.type == "cuda" else None
    if side is not None:  # warm-up on a side stream, as capture asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
    else:
        forward()
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
    prov.reset()  # forget the warm-up's writes: the loop starts from a clean cache
    for buffer in buffers:
        buffer.zero_()
    # the prefixes, written eagerly (an extend step)
    positions = torch.cat([torch.arange(n) for n in PREFIX])
    ids = torch.cat([tokens[i, :n] for i, n in enumerate(PREFIX)])
    loc = torch.cat([r2t[i + 1, :n].long().cpu() for i, n in enumerate(PREFIX)]).to(dev)
    starts = torch.tensor([0, *torch.tensor(PREFIX).cumsum(0)[:-1].tolist()], device=dev)
    k, v, _ = kv(ids, positions)
    prov.stamp(input_ids=ids.to(dev), positions=positions.to(dev), out_cache_loc=loc, req_pool_indices=rows,
               req_to_token=r2t, full_to_swa_index_mapping=mapping, extend_start_loc=starts)
    for layer, (kb, vb, at) in enumerate(((kf, vf, loc), (ks, vs, mapping[loc]))):
        kb.index_copy_(0, at, k)
        vb.index_copy_(0, at, v)
        prov.after_layer(layer_id=layer, swa=layer == 1, k=k, v=v, k_buffer=kb, v_buffer=vb, out_cache_loc=loc,
                         full_to_swa_index_mapping=mapping)

    original = sampling.SampleLayout.record

    def record(layout, values, pending, reading, verify_source):
        readings.append((reporter.forward_ct, reading_of(values, pending, layout)))
        return original(layout, values, pending, reading, verify_source)

    with mock.patch.object(sampling.SampleLayout, "record", record):
        for step in range(steps):
            load(step)
            reporter.before_forward()
            if graph is not None:
                graph.replay()
            else:
                forward()
            lens = [n + step + 1 for n in PREFIX]
            view = SwaBatch(r2t, mapping, rows, torch.tensor(lens, device=dev), seq_lens_cpu=lens,
                            sliding_window=WINDOW, request_ids=list(range(BATCH)),
                            token_ids=[tokens[i, :n].tolist() for i, n in enumerate(lens)])
            reporter.step(view)
        reporter.close()
    return readings


def summary(reading) -> tuple:
    """What the in-forward checks and the verification said in one sample, comparable across modes."""
    return reading.read, reading.read_offender, reading.write, reading.write_offender, reading.provenance
