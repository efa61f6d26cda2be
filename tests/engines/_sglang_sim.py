"""A driver for SGLang's real hybrid SWA allocator on CPU (imported only where SGLang is installed).

It plays the scheduler's part around SGLang's own classes: ``SWAKVPool`` + ``SWATokenToKVPoolAllocator``
allocate, ``ReqToTokenPool`` holds the rows, ``free_swa_out_of_window_slots`` (``mem_cache.common``)
evicts what left the window, and ``free_kv_row_segments`` releases a finished request. Nothing of
the allocator is re-implemented here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from recount_support import recount
from sglang.srt.kv_canary.buffer_group import PoolKind
from sglang.srt.kv_canary.runner.swa_divergence import (
    SwaDivergenceLog,
    compute_swa_full_idx_divergence,
    compute_swa_out_of_window_tokens,
)
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.common import free_kv_row_segments, free_swa_out_of_window_slots
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

__all__ = [
    "PoolKind",
    "SwaDivergenceLog",
    "compute_swa_full_idx_divergence",
    "compute_swa_out_of_window_tokens",
    "SglangSim",
]


@dataclass
class SimRequest:
    req: SimpleNamespace  # .kv is SGLang's ReqKvInfo
    seq_len: int
    target_len: int

    @property
    def row(self) -> int:
        return int(self.req.kv.req_pool_idx)


@dataclass
class SglangSim:
    """Real allocator + pools; ``step()`` runs one scheduler round (admit, decode, evict, finish)."""

    page_size: int
    window: int
    size: int = 512
    size_swa: int = 160
    max_reqs: int = 8
    max_context_len: int = 192
    seed: int = 0
    requests: list[SimRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.kv_pool = SWAKVPool(
            size=self.size,
            size_swa=self.size_swa,
            page_size=self.page_size,
            dtype=torch.float16,
            head_num=1,
            head_dim=4,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[1],
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = SWATokenToKVPoolAllocator(
            self.size, self.size_swa, self.page_size, torch.float16, "cpu", self.kv_pool, False
        )
        self.req_to_token_pool = ReqToTokenPool(
            size=self.max_reqs, max_context_len=self.max_context_len, device="cpu", enable_memory_saver=False
        )

    # ------------------------------------------------------------------ allocation
    def _alloc_tokens(self, sim_req: SimRequest | None, row: int, start: int, count: int) -> torch.Tensor | None:
        """FULL slots for positions [start, start + count) of ``row``, from the real allocator."""
        alloc = self.allocator
        if self.page_size == 1:
            return alloc.alloc(count)
        r2t = self.req_to_token_pool.req_to_token
        last = int(r2t[row, start - 1]) if start > 0 else -1
        prefix = torch.tensor([start], dtype=torch.int64)
        seq = torch.tensor([start + count], dtype=torch.int64)
        last_loc = torch.tensor([last], dtype=torch.int64)
        if start > 0 and count == 1:
            return alloc.alloc_decode(seq, seq, last_loc)
        return alloc.alloc_extend(prefix, prefix, seq, seq, last_loc, count)

    def admit(self, prompt_len: int, target_len: int) -> SimRequest | None:
        req = SimpleNamespace(kv=ReqKvInfo())
        if self.req_to_token_pool.alloc([req]) is None:
            return None
        sim_req = SimRequest(req, 0, target_len)
        slots = self._alloc_tokens(sim_req, sim_req.row, 0, prompt_len)
        if slots is None:
            self.req_to_token_pool.free(req)
            return None
        self.req_to_token_pool.req_to_token[sim_req.row, :prompt_len] = slots.to(torch.int32)
        sim_req.seq_len = prompt_len
        req.kv.kv_allocated_len = prompt_len
        self.requests.append(sim_req)
        self.evict(sim_req)
        return sim_req

    def decode(self, sim_req: SimRequest) -> bool:
        pos = sim_req.seq_len
        slots = self._alloc_tokens(sim_req, sim_req.row, pos, 1)
        if slots is None:
            return False
        self.req_to_token_pool.req_to_token[sim_req.row, pos] = int(slots[0])
        sim_req.seq_len += 1
        sim_req.req.kv.kv_allocated_len = sim_req.seq_len
        self.evict(sim_req)
        return True

    def evict(self, sim_req: SimRequest) -> None:
        free_swa_out_of_window_slots(
            sim_req.req,
            sim_req.seq_len,
            sliding_window_size=self.window,
            page_size=self.page_size,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            supports_prefix_sharing=False,
        )

    def finish(self, sim_req: SimRequest) -> None:
        kv = sim_req.req.kv
        row_slots = self.req_to_token_pool.req_to_token[sim_req.row, : sim_req.seq_len].long()
        free_kv_row_segments(
            self.allocator,
            [(row_slots, 0)],
            swa_evicted_seqlen=kv.get_evicted_seqlen(_swa_component()),
            swa_dead_lo=kv.swa_dead_lo(self.page_size),
        )
        self.req_to_token_pool.free(sim_req.req)
        kv.mark_kv_released()
        self.requests.remove(sim_req)

    # ------------------------------------------------------------------ scheduling round
    def step(self) -> None:
        """Admit with some probability, decode every running request once, finish the done ones."""
        rng = self.rng
        if len(self.requests) < self.max_reqs and rng.random() < 0.4:
            prompt = rng.randint(1, 48)
            self.admit(prompt, min(self.max_context_len, prompt + rng.randint(1, 100)))
        for sim_req in list(self.requests):
            if sim_req.seq_len >= sim_req.target_len or not self.decode(sim_req):
                self.finish(sim_req)

    # ------------------------------------------------------------------ what a forward batch holds
    def forward_batch(self) -> SimpleNamespace:
        rows = [r.row for r in self.requests]
        lens = [r.seq_len for r in self.requests]
        return SimpleNamespace(
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        )

    def recount(self) -> tuple[int, int]:
        """(divergence, out-of-window) by a plain loop over the live tokens (the rule in the docs)."""
        return recount(self.req_to_token_pool.req_to_token.tolist(), self.allocator.full_to_swa_index_mapping.tolist(),
                       [r.row for r in self.requests], [r.seq_len for r in self.requests])


def _swa_component():
    from sglang.srt.mem_cache.common import ComponentType

    return ComponentType.SWA
