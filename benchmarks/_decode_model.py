"""A decode step at a model's attention shapes, with or without otel-swa's in-forward checks inside
(for ``bench_provenance.py`` and ``gpu_figures.py``).

The step, per layer: the QKV projection of the batch's hidden states, the store of the new K/V into
the layer's pool (FULL slots for full-attention layers, ``full_to_swa_index_mapping`` of them for
sliding-window ones: SGLang's hybrid layout), attention over the keys each query reads (the whole
context, or the window) gathered through ``req_to_token`` and the mapping, the output projection and
a dense MLP. A stand-in for the real kernels (paged attention reads the same bytes; a real MLP may
be a mixture of experts): it fixes the step's order of magnitude, not its exact time.

Memory: the layers of one kind share one pair of K/V buffers (each layer still writes and reads its
own K/V there, so the step's work is the model's; only the capacity is one layer's), and the
weights are random, made on the device.

The checks (``checks=True``): the stamps before the first layer
(:meth:`~otel_swa.device.provenance.KvProvenance.stamp`), each layer's
:meth:`~otel_swa.device.provenance.KvProvenance.after_layer` (every layer's checksum folded, the
layers given in their order; the write check), and the read check of the sliding-window layers
(:meth:`~otel_swa.device.read_check.ReadCheck.check_layer`), each called when
``reporter.checks_wanted()`` (always inside a capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from otel_swa.reporter import SwaDivergenceReporter

__all__ = ["Shape", "SHAPES", "DecodeModel"]


@dataclass(frozen=True)
class Shape:
    name: str
    layers: tuple  # per layer: True for sliding-window
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int  # keys one sliding-window query reads
    batch: int
    context: int  # tokens per request before the step
    mlp: int
    dtype: torch.dtype

    def small(self) -> "Shape":
        """The same layout at small sizes (a dry run on the CPU)."""
        return Shape(self.name, self.layers[:4], 64, 4, 2, 16, min(self.window, 8), min(self.batch, 4),
                     min(self.context, 32), 64, torch.float32)


SHAPES = (
    # the engine suite's tiny Mellum (tests/engines/sglang_engine/build_model.py): 3 sliding-window
    # layers and 1 full, hidden 64, 4 query / 2 KV heads of 16, window 8 (+1: its own), float32;
    # 16 requests of about 160 tokens (the suite's 16 x 160 generations)
    Shape("engine suite's Mellum", (True, True, True, False), 64, 4, 2, 16, 9, 16, 160, 128, torch.float32),
    # GPT-OSS-20B's attention: 24 layers alternating sliding window 128 and full, 64 / 8 heads of 64
    Shape("GPT-OSS-like", (True, False) * 12, 2880, 64, 8, 64, 128, 64, 2048, 2880, torch.bfloat16),
    # Gemma-3-4B's attention: 34 layers, 5 sliding (window 1024) to 1 full, 8 / 4 heads of 256
    Shape("Gemma-3-like", ((True,) * 5 + (False,)) * 5 + (True,) * 4, 2560, 8, 4, 256, 1024, 64, 4096, 2560,
          torch.bfloat16),
)


class DecodeModel:
    """One decode step of ``shape`` on ``device`` (module docstring); :meth:`forward` runs it.

    Args:
        checks: put otel-swa's in-forward checks in the step (``reporter`` then holds them; a call
            of :meth:`forward` may leave them out).
        graph_mode: the reporter's :data:`~otel_swa.device.gate.GRAPH_MODES` (its gate's
            ``graph_mode`` may be changed between captures).
    """

    def __init__(self, shape: Shape, device: "torch.device | str", *, checks: bool, graph_mode: str = "masked",
                 interval: int = 1) -> None:
        dev = self.device = torch.device(device)
        self.shape = s = shape
        torch.manual_seed(0)
        width = s.context + 8
        slots = s.batch * width + 1
        self.req_to_token = (torch.arange(s.batch * width, dtype=torch.int32, device=dev) + 1).reshape(s.batch, width)
        self.mapping = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev),
                                  torch.randperm(slots - 1, device=dev) + 1])
        self.rows = torch.arange(s.batch, device=dev)
        self.positions = torch.full((s.batch,), s.context, dtype=torch.int64, device=dev)
        self.seq_lens = self.positions + 1
        self.loc = self.req_to_token[self.rows, self.positions].long()
        self.input_ids = torch.randint(0, 1000, (s.batch,), device=dev)
        self.hidden = torch.randn((s.batch, s.hidden), device=dev, dtype=s.dtype)
        qkv = (s.q_heads + 2 * s.kv_heads) * s.head_dim

        def weight(*size):
            return torch.randn(size, device=dev, dtype=s.dtype) / size[0] ** 0.5

        self.weights = [(weight(s.hidden, qkv), weight(s.q_heads * s.head_dim, s.hidden), weight(s.hidden, s.mlp),
                         weight(s.mlp, s.hidden)) for _ in s.layers]
        pools = {kind: tuple(torch.randn((slots, s.kv_heads, s.head_dim), device=dev, dtype=s.dtype) for _ in range(2))
                 for kind in set(s.layers)}
        self.kv = [pools[sliding] for sliding in s.layers]
        self.reporter = SwaDivergenceReporter(interval, device=dev, graph_mode=graph_mode)
        self.checks = checks
        if checks:
            order = {"full": tuple(i for i, sliding in enumerate(s.layers) if not sliding),
                     "swa": tuple(i for i, sliding in enumerate(s.layers) if sliding)}
            try:  # the layers in call order, as the SGLang wiring gives them
                self.provenance = self.reporter.enable_provenance(full_slots=slots, swa_slots=slots,
                                                                  checksum_order=order)
            except TypeError:  # an otel-swa before checksum_order (a side-by-side run)
                self.provenance = self.reporter.enable_provenance(full_slots=slots, swa_slots=slots)
            self.read_check = self.reporter.enable_read_check()
        self._offsets = {r: torch.arange(r, device=dev) - (r - 1) for r in {s.window, s.context + 1}}

    def forward(self, checks: "bool | None" = None) -> torch.Tensor:
        s = self.shape
        on = self.checks if checks is None else checks and self.checks
        checks = on and self.reporter.checks_wanted()
        if on:  # the stamps: every step
            self.provenance.stamp(input_ids=self.input_ids, positions=self.positions, out_cache_loc=self.loc,
                                  req_pool_indices=self.rows, req_to_token=self.req_to_token,
                                  full_to_swa_index_mapping=self.mapping)
        h = self.hidden
        group = s.q_heads // s.kv_heads
        for layer, (sliding, (w_qkv, w_o, w_up, w_down), (k_buf, v_buf)) in enumerate(zip(s.layers, self.weights, self.kv)):
            qkv = h @ w_qkv
            q, k, v = qkv.split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=1)
            slot = self.mapping.index_select(0, self.loc) if sliding else self.loc
            k_buf.index_copy_(0, slot, k.view(-1, s.kv_heads, s.head_dim))
            v_buf.index_copy_(0, slot, v.view(-1, s.kv_heads, s.head_dim))
            reach = s.window if sliding else s.context + 1
            keys = (self.positions.unsqueeze(1) + self._offsets[reach]).clamp_(min=0)
            full = self.req_to_token[self.rows.unsqueeze(1), keys].long()
            at = self.mapping[full] if sliding else full
            kk = k_buf[at].transpose(1, 2)  # [B, Hkv, W, D]
            vv = v_buf[at].transpose(1, 2)
            qq = q.view(s.batch, s.kv_heads, group, s.head_dim)
            scores = torch.matmul(qq, kk.transpose(2, 3)) * s.head_dim ** -0.5
            out = torch.matmul(scores.softmax(-1), vv).reshape(s.batch, -1)
            if on:
                self.provenance.after_layer(layer_id=layer, swa=sliding, k=k, v=v, k_buffer=k_buf, v_buffer=v_buf,
                                            out_cache_loc=self.loc, full_to_swa_index_mapping=self.mapping,
                                            positions=self.positions)
                if checks and sliding and self.read_check.wants(layer):
                    self.read_check.check_layer(
                        layer_id=layer, q=q, out=out, k_buffer=k_buf, v_buffer=v_buf, req_to_token=self.req_to_token,
                        full_to_swa_index_mapping=self.mapping, req_pool_indices=self.rows, seq_lens=self.seq_lens,
                        query_rows=None, window=s.window, scaling=s.head_dim ** -0.5, num_q_heads=s.q_heads)
            h = h + out @ w_o
            h = h + torch.relu(h @ w_up) @ w_down
        return h

    def take(self) -> None:
        """Clear the checks' cells as a sample would (keeps the rotation going); no sample staged."""
        if self.checks:
            self.read_check.take()
            self.provenance.write_check.take()
