"""A tiny real forward over the hybrid KV cache: one full-attention layer, one sliding-window layer.

The model: token embedding plus a sinusoidal position signal, then

1. a full-attention layer (causal; query at position ``p`` attends to keys ``0 .. p``) whose K/V
   live in the FULL pool, indexed by FULL slot (``req_to_token``);
2. a sliding-window layer (query at ``p`` attends to keys ``p - window + 1 .. p``) whose K/V live in
   the SWA pool, indexed by the SWA slot ``full_to_swa_index_mapping[full_slot]``;

each a residual multi-head attention, and a greedy output head (argmax over a small vocabulary).
Weights are random with a fixed seed. A forward step first writes the K/V of its new tokens into
the pools, then attends through the slot tables, like a paged-attention kernel.

Shapes: ``hidden = num_heads * head_dim``; the K/V storage of a pool is ``float32``
``[num_slots, num_heads, head_dim]`` on the model's device, ``num_slots`` covering every slot the
pool's pages can address (page 0 included, never written).

Decode items (one new token) of a step are computed together: their keys are gathered into one flat
list and the softmax runs per request segment. Longer prefill chunks are computed per request in
blocks of queries, with a dense mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from otel_swa.reference.pools import HybridKVPools

__all__ = ["TinyHybridModel", "KVStorage", "ForwardBatch", "prompt_token_ids"]

_QUERY_BLOCK = 512


def prompt_token_ids(seed: int, rid: int, length: int, vocab_size: int) -> torch.Tensor:
    """Deterministic prompt token ids for request ``rid``: ``int64`` CPU tensor of shape ``[length]``.

    An integer hash of (seed, rid, position), reduced modulo ``vocab_size``; the same arguments give
    the same ids on every platform.
    """
    x = torch.arange(length, dtype=torch.int64) * 0x27D4EB2F + (rid * 0x165667B1 + seed * 0x61C88647 + 0x9E3779B)
    x = x & 0x7FFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0x7FFFFFFF
    x = x ^ (x >> 12)
    return x % vocab_size


@dataclass
class KVStorage:
    """K/V storage of both pools: ``float32`` tensors ``[num_slots, num_heads, head_dim]``."""

    full_k: torch.Tensor
    full_v: torch.Tensor
    swa_k: torch.Tensor
    swa_v: torch.Tensor

    @classmethod
    def for_pools(cls, pools: HybridKVPools, num_heads: int, head_dim: int) -> "KVStorage":
        full_slots = (pools.full_pages + 1) * pools.page_size
        swa_slots = (pools.swa_pages + 1) * pools.page_size
        dev = pools.device

        def make(n: int) -> torch.Tensor:
            return torch.zeros((n, num_heads, head_dim), dtype=torch.float32, device=dev)

        return cls(make(full_slots), make(full_slots), make(swa_slots), make(swa_slots))

    @property
    def swa_bytes_per_token(self) -> int:
        """K and V bytes one token takes in the sliding-window layer (from the shapes and dtypes;
        no device access)."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in (self.swa_k, self.swa_v))


@dataclass
class ForwardBatch:
    """The inputs of one forward step (``T`` = new tokens in the step, ``N`` = requests).

    Attributes:
        token_ids: ``int64`` ``[T]`` on the device, the new tokens in item order.
        positions: ``int64`` ``[T]`` on the device.
        full_slots: ``int64`` ``[T]`` on the device, the FULL slot of each new token.
        swa_slots: ``int64`` ``[T]`` on the device, the SWA slot of each new token.
        rows: ``req_to_token`` row of each request (host, length ``N``).
        prefix_lens: tokens already cached per request before the step (host, length ``N``).
        extend_lens: new tokens per request (host, length ``N``).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    full_slots: torch.Tensor
    swa_slots: torch.Tensor
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]


class TinyHybridModel:
    """The reference forward (see the module docstring).

    Args:
        window: sliding window of the SWA layer, in tokens (>= 1).
        vocab_size, num_heads, head_dim: sizes; ``hidden = num_heads * head_dim``.
        seed: seed of the weights (a CPU ``torch.Generator``, so the same on every device).
        device: where the weights and activations live.

    Raises:
        ValueError: a size is below 1.
    """

    def __init__(
        self,
        window: int,
        vocab_size: int = 128,
        num_heads: int = 1,
        head_dim: int = 16,
        seed: int = 0,
        device: "str | torch.device" = "cpu",
    ) -> None:
        for name, value in (("window", window), ("vocab_size", vocab_size), ("num_heads", num_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name}={value!r}; expected an integer >= 1")
        self.window = window
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.hidden = num_heads * head_dim
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        h = self.hidden

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=gen) / math.sqrt(shape[0])).to(self.device)

        self.embed = weight(vocab_size, h) * math.sqrt(vocab_size)
        # per layer: wq, wk, wv, wo, each [hidden, hidden]; layer 0 full, layer 1 sliding window
        self.layers = [tuple(weight(h, h) for _ in range(4)) for _ in range(2)]
        self.lm_head = weight(h, vocab_size)
        self._inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, h, 2, dtype=torch.float32) / h).to(self.device)

    # -- pieces shared with a dense reference --------------------------------------------------

    def embed_tokens(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids and positions -> ``float32`` ``[T, hidden]``."""
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        pos = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)[:, : self.hidden]
        return self.embed[token_ids] + 0.5 * pos

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, hidden]`` -> q, k, v, each ``[T, num_heads, head_dim]``."""
        wq, wk, wv, _ = self.layers[layer]
        shape = (h.shape[0], self.num_heads, self.head_dim)
        return (h @ wq).view(shape), (h @ wk).view(shape), (h @ wv).view(shape)

    def output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update: ``h + attn.flatten(1) @ wo``."""
        return h + attn.reshape(h.shape[0], self.hidden) @ self.layers[layer][3]

    def next_token(self, h_last: torch.Tensor) -> torch.Tensor:
        """Greedy ids: ``[N, hidden]`` -> ``int64`` ``[N]``."""
        return (h_last @ self.lm_head).argmax(dim=-1)

    # -- the paged forward ---------------------------------------------------------------------

    def forward(
        self, batch: ForwardBatch, pools: HybridKVPools, kv: KVStorage,
        on_sliding_attention: "Callable[..., Any] | None" = None,
        on_layer: "Callable[..., Any] | None" = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one forward step over the pools.

        Writes the K/V of the new tokens into ``kv`` (FULL layer at ``batch.full_slots``, SWA layer
        at ``batch.swa_slots``), then attends through ``pools.req_to_token`` and
        ``pools.full_to_swa_index_mapping``. The slots of the new tokens must already be in both
        tables (:meth:`HybridKVPools.extend`).

        Args:
            on_sliding_attention: called after the sliding-window layer's attention with keyword
                arguments ``layer_id`` (1), ``q`` and ``out`` (``float32 [T, num_heads,
                head_dim]``: its queries and its attention output), ``k_buffer`` and ``v_buffer``
                (the SWA pool's K/V, indexed by SWA slot), ``scaling`` and ``num_q_heads``: the
                engine's read check (:mod:`otel_swa.device.read_check`); ``None``: nothing called.
            on_layer: called after each layer's write and attention with keyword arguments
                ``layer_id`` (0 full, 1 sliding window), ``swa`` (its K/V are the SWA pool's), ``k`` and
                ``v`` (``float32 [T, num_heads, head_dim]``: what the layer stored) and ``k_buffer``,
                ``v_buffer`` (the pool's K/V it stored them in): the engine's provenance
                (:mod:`otel_swa.device.provenance`); ``None``: nothing called.

        Returns:
            (hidden ``float32`` ``[T, hidden]``, next token id of each request ``int64`` ``[N]``).
        """
        h = self.embed_tokens(batch.token_ids, batch.positions)
        for layer, (k_cache, v_cache, new_slots) in enumerate(
            ((kv.full_k, kv.full_v, batch.full_slots), (kv.swa_k, kv.swa_v, batch.swa_slots))
        ):
            q, k, v = self.qkv(layer, h)
            k_cache.index_copy_(0, new_slots, k)
            v_cache.index_copy_(0, new_slots, v)
            attn = self._attend(q, layer == 1, batch, pools, k_cache, v_cache)
            if layer == 1 and on_sliding_attention is not None:
                on_sliding_attention(layer_id=1, q=q, out=attn, k_buffer=k_cache, v_buffer=v_cache,
                                     scaling=1.0 / math.sqrt(self.head_dim), num_q_heads=self.num_heads)
            if on_layer is not None:
                on_layer(layer_id=layer, swa=layer == 1, k=k, v=v, k_buffer=k_cache, v_buffer=v_cache)
            h = self.output(layer, h, attn)
        ends = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
        return h, self.next_token(h[ends.to(self.device)])

    def _key_slots(self, sliding: bool, pools: HybridKVPools, full: torch.Tensor) -> torch.Tensor:
        # index_select, not advanced indexing: on CPU it is an order of magnitude faster
        full = full.to(torch.int64)
        return pools.full_to_swa_index_mapping.index_select(0, full) if sliding else full

    def _attend(
        self,
        q: torch.Tensor,
        sliding: bool,
        batch: ForwardBatch,
        pools: HybridKVPools,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        dev = self.device
        scale = 1.0 / math.sqrt(self.head_dim)
        out = torch.empty_like(q)
        single_q: list[int] = []
        single_rows: list[int] = []
        single_start: list[int] = []
        single_count: list[int] = []
        offset = 0
        for row, prefix, extend in zip(batch.rows, batch.prefix_lens, batch.extend_lens):
            seq_len = prefix + extend
            key_start = max(0, prefix - self.window + 1) if sliding else 0
            if extend == 1:
                single_q.append(offset)
                single_rows.append(row)
                single_start.append(key_start)
                single_count.append(seq_len - key_start)
            else:
                key_pos = torch.arange(key_start, seq_len, device=dev)
                slots = self._key_slots(sliding, pools, pools.req_to_token[row, key_start:seq_len])
                keys, values = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
                for block in range(0, extend, _QUERY_BLOCK):
                    n = min(_QUERY_BLOCK, extend - block)
                    q_pos = torch.arange(prefix + block, prefix + block + n, device=dev)
                    allowed = key_pos[None, :] <= q_pos[:, None]
                    if sliding:
                        allowed &= key_pos[None, :] > q_pos[:, None] - self.window
                    scores = torch.einsum("qhd,khd->hqk", q[offset + block : offset + block + n], keys) * scale
                    scores = scores.masked_fill(~allowed[None], float("-inf"))
                    out[offset + block : offset + block + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            offset += extend
        if single_q:
            index = torch.tensor(single_q, device=dev)
            out[index] = self._attend_single(
                q.index_select(0, index), sliding, pools, k_cache, v_cache, single_rows, single_start, single_count, scale
            )
        return out

    def _attend_single(
        self,
        q: torch.Tensor,
        sliding: bool,
        pools: HybridKVPools,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: list[int],
        starts: list[int],
        counts: list[int],
        scale: float,
    ) -> torch.Tensor:
        """One query per request (``q``: ``[B, heads, head_dim]``), keys gathered into one flat list."""
        dev = self.device
        b = len(rows)
        counts_t = torch.tensor(counts, dtype=torch.int64, device=dev)
        total = int(sum(counts))
        seg = torch.repeat_interleave(torch.arange(b, device=dev), counts_t)
        seg_first = torch.cumsum(counts_t, 0) - counts_t
        shift = torch.tensor(starts, dtype=torch.int64, device=dev) - seg_first
        positions = torch.arange(total, device=dev) + shift.index_select(0, seg)
        row_base = torch.tensor(rows, dtype=torch.int64, device=dev) * pools.req_to_token.shape[1]
        full = pools.req_to_token.view(-1).index_select(0, row_base.index_select(0, seg) + positions)
        slots = self._key_slots(sliding, pools, full)
        scores = (k_cache.index_select(0, slots) * q.index_select(0, seg)).sum(-1) * scale  # [total, heads]
        peak = torch.segment_reduce(scores, "max", lengths=counts_t, axis=0)  # [b, heads]
        weights = (scores - peak.index_select(0, seg)).exp()
        denom = torch.segment_reduce(weights, "sum", lengths=counts_t, axis=0)
        weighted = weights[..., None] * v_cache.index_select(0, slots)
        acc = torch.segment_reduce(weighted, "sum", lengths=counts_t, axis=0)
        return acc / denom[..., None]
