"""A paged KV cache as vLLM's CPU_ATTN keeps it, with an attention computed query by query from its
block table: the stand-in engine of the paged read-check tests."""

from __future__ import annotations

import math

import torch

from otel_swa.device.paged_write import cpu_attn_kv_views
from otel_swa.device.read_check import ReadCheck


class PagedPool:
    """``batch`` requests of lengths ``lens`` in a pool of ``blocks`` blocks of ``block_size``
    slots; each request's blocks drawn at random (block 0 is vLLM's null block, never handed out);
    the KV cache one tensor ``[blocks, kv_heads, block_size, 2 * head_dim]`` as CPU_ATTN keeps it."""

    def __init__(self, *, lens=(70, 33, 5, 64, 96), block_size=32, blocks=24, kv_heads=2, q_heads=4, head_dim=16,
                 dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size, self.kv_heads, self.q_heads, self.head_dim = block_size, kv_heads, q_heads, head_dim
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        width = max(-(-n // block_size) for n in lens) + 1  # a column more than needed, as vLLM pads
        order = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
        self.block_table = torch.zeros((len(lens), width), dtype=torch.int32)
        for i, n in enumerate(lens):
            for b in range(-(-n // block_size)):
                self.block_table[i, b] = order.pop()
        self.kv_cache = torch.randn((blocks, kv_heads, block_size, 2 * head_dim), generator=gen).to(dtype)
        self.k, self.v = cpu_attn_kv_views(self.kv_cache, head_dim)  # [blocks, block_size, heads, dim] views
        self.q = torch.randn((len(lens), q_heads, head_dim), generator=gen).to(dtype)
        self.scaling = 1.0 / math.sqrt(head_dim)

    def slot(self, request: int, position: int, table=None) -> int:
        table = self.block_table if table is None else table
        return int(table[request, position // self.block_size]) * self.block_size + position % self.block_size

    def engine_output(self, window: int, table=None) -> torch.Tensor:
        """The attention of each request's last token over the last ``window`` positions, read
        through ``table`` (default: the block table, the right one), in float64."""
        out = torch.empty((self.q.shape[0], self.q_heads, self.head_dim), dtype=self.q.dtype)
        group = self.q_heads // self.kv_heads
        for i in range(self.q.shape[0]):
            p = int(self.seq_lens[i]) - 1
            slots = [self.slot(i, pos, table) for pos in range(max(0, p - window + 1), p + 1)]
            at = (torch.tensor([s // self.block_size for s in slots]), torch.tensor([s % self.block_size for s in slots]))
            for h in range(self.q_heads):
                keys, values = self.k[at][:, h // group].double(), self.v[at][:, h // group].double()
                probs = torch.softmax(keys @ self.q[i, h].double() * self.scaling, 0)
                out[i, h] = (probs @ values).to(self.q.dtype)
        return out

    def check(self, out: torch.Tensor, window: int, *, block_size=None, k=None) -> list:
        check = ReadCheck("cpu", max_queries=8)
        batch = self.q.shape[0]
        check.check_layer(
            layer_id=2, q=self.q, out=out, k_buffer=self.k if k is None else k, v_buffer=self.v,
            req_to_token=self.block_table, full_to_swa_index_mapping=None,
            req_pool_indices=torch.arange(batch), seq_lens=self.seq_lens, query_rows=None, window=window,
            scaling=self.scaling, num_q_heads=self.q_heads, block_size=self.block_size if block_size is None else block_size)
        return check.take().tolist()
