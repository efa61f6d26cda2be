"""The hybrid KV cache of the reference engine: a FULL pool, an SWA pool and the tables between them.

Layout (the names and conventions of SGLang's ``ReqToTokenPool`` and ``SWATokenToKVPoolAllocator``):

- Slots are grouped in pages of ``page_size`` slots. Page ``k`` holds slots ``k * page_size ..
  (k + 1) * page_size - 1``. Page 0 is reserved in both pools and never handed out, so slot 0
  (and, with pages, the rest of page 0) never holds a token; a mapping value of 0 means "none".
- ``req_to_token``: ``int32``, shape ``[max_running + 1, max_context_len]``, on ``device``. Row ``r``
  holds the FULL slot of each position of the request in request row ``r``; row 0 is padding and
  never handed out.
- ``full_to_swa_index_mapping``: ``int64``, shape ``[full_size + page_size + 1]``, on ``device``
  (the size SGLang uses). The SWA slot of each FULL slot, 0 when the token has no SWA slot (not
  allocated, or freed because it left the sliding window).
- Position ``p`` of a request sits in its ``p // page_size``-th FULL page and SWA page, at offset
  ``p % page_size`` in both: each FULL page maps to one SWA page with the offset kept.

Free lists live on the host (Python deques of page numbers). With ``page_size == 1`` freed slots are
appended to the end of the free list; with larger pages freed pages go to the front and are reused
first (the behaviour of sglang 0.5.23's allocators). Either way SWA slots freed when tokens leave the
window are handed to later tokens while their FULL slots stay, so the SWA index of a token differs
from its FULL index: that is the divergence the reporter counts.

Eviction (:meth:`HybridKVPools.evict_out_of_window`): a token at position ``p`` of a request with
``seq_len`` tokens is out of the window when ``p < seq_len - window``. Only whole pages are freed,
always a prefix of the request: the evicted length is ``(seq_len - window) // page_size *
page_size``, so a request may still hold SWA slots for up to ``page_size - 1`` out-of-window tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from otel_swa.pool_usage import POOL_FULL, POOL_SWA, PoolUsage

__all__ = ["HybridKVPools", "RequestSlots", "PoolExhaustedError", "pages_for"]


class PoolExhaustedError(RuntimeError):
    """An allocation asked for more pages (or request rows) than are free.

    The scheduler reserves pages before it admits a request, so this signals a bug in the caller.
    """


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed for ``tokens`` positions starting at a page boundary (ceil division)."""
    return -(-tokens // page_size)


@dataclass
class RequestSlots:
    """Host state of one request in the pools.

    Attributes:
        row: the request's row in ``req_to_token`` (>= 1).
        seq_len: positions allocated so far (tokens with a FULL slot).
        full_pages: FULL page of each page-sized block of positions.
        swa_pages: SWA page of each block, 0 once freed (always a prefix of the list is 0).
        swa_evicted_len: positions ``< swa_evicted_len`` have no SWA slot (a multiple of page_size).
    """

    row: int
    seq_len: int = 0
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)
    swa_evicted_len: int = 0


class HybridKVPools:
    """FULL and SWA KV pools with page-granular host free lists and the device lookup tables.

    Args:
        full_size: usable slots of the FULL pool (a multiple of ``page_size``; slot 0 comes extra).
        swa_size: usable slots of the SWA pool (a multiple of ``page_size``).
        page_size: slots per page (>= 1).
        max_running: request rows of ``req_to_token`` (row 0 extra, reserved).
        max_context_len: positions per request row (the longest request, prompt plus output).
        device: where ``req_to_token`` and ``full_to_swa_index_mapping`` live.

    Raises:
        ValueError: a size is not a positive integer, or a pool size is not a multiple of
            ``page_size``.
    """

    def __init__(
        self,
        full_size: int,
        swa_size: int,
        page_size: int = 1,
        max_running: int = 32,
        max_context_len: int = 16384,
        device: "str | torch.device" = "cpu",
    ) -> None:
        for name, value in (
            ("full_size", full_size),
            ("swa_size", swa_size),
            ("page_size", page_size),
            ("max_running", max_running),
            ("max_context_len", max_context_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; expected an integer >= 1")
        for name, value in (("full_size", full_size), ("swa_size", swa_size)):
            if value % page_size:
                raise ValueError(f"{name}={value} is not a multiple of page_size={page_size}")
        self.full_size = full_size
        self.swa_size = swa_size
        self.page_size = page_size
        self.max_running = max_running
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.full_pages = full_size // page_size
        self.swa_pages = swa_size // page_size
        self.req_to_token = torch.zeros((max_running + 1, max_context_len), dtype=torch.int32, device=self.device)
        self.full_to_swa_index_mapping = torch.zeros(full_size + page_size + 1, dtype=torch.int64, device=self.device)
        self._full_free: deque[int] = deque(range(1, self.full_pages + 1))
        self._swa_free: deque[int] = deque(range(1, self.swa_pages + 1))
        self._free_rows: deque[int] = deque(range(1, max_running + 1))
        self.requests: dict[int, RequestSlots] = {}

    # -- host state -------------------------------------------------------------------------------

    @property
    def full_free_pages(self) -> int:
        return len(self._full_free)

    @property
    def swa_free_pages(self) -> int:
        return len(self._swa_free)

    @property
    def full_used_slots(self) -> int:
        """FULL slots held by requests (whole pages)."""
        return (self.full_pages - len(self._full_free)) * self.page_size

    @property
    def swa_used_slots(self) -> int:
        """SWA slots held by requests (whole pages)."""
        return (self.swa_pages - len(self._swa_free)) * self.page_size

    def usage(self) -> tuple[PoolUsage, PoolUsage]:
        """How full each pool is now, in slots (host ints; no device work): FULL and SWA.

        ``available`` is the free pages x page size, ``used`` the rest (whole pages held by
        requests), ``total`` the usable size (page 0, reserved, is not counted) and ``evictable``
        0: the reference engine has no prefix cache, a finished request frees its slots at once.
        """
        ps = self.page_size
        return (
            PoolUsage.from_free(POOL_FULL, total=self.full_size, available=len(self._full_free) * ps),
            PoolUsage.from_free(POOL_SWA, total=self.swa_size, available=len(self._swa_free) * ps),
        )

    def free_full_page_list(self) -> list[int]:
        """A copy of the FULL free list (page numbers, in allocation order)."""
        return list(self._full_free)

    def free_swa_page_list(self) -> list[int]:
        """A copy of the SWA free list (page numbers, in allocation order)."""
        return list(self._swa_free)

    def free_swa_page_array(self) -> np.ndarray:
        """The SWA free list as ``int64 [k]`` numpy (page numbers, in allocation order), read from
        the deque in one pass (no intermediate list)."""
        return np.fromiter(self._swa_free, dtype=np.int64, count=len(self._swa_free))

    def swa_pages_held(self, req: RequestSlots) -> int:
        """SWA pages ``req`` holds now (its pages not yet freed by eviction)."""
        return len(req.swa_pages) - req.swa_evicted_len // self.page_size

    def new_pages_needed(self, req: RequestSlots, extend_len: int) -> int:
        """Pages (in each pool) that extending ``req`` by ``extend_len`` positions allocates."""
        return pages_for(req.seq_len + extend_len, self.page_size) - len(req.full_pages)

    # -- allocation -------------------------------------------------------------------------------

    def open_request(self) -> RequestSlots:
        """Take a free ``req_to_token`` row for a new request.

        Raises:
            PoolExhaustedError: all ``max_running`` rows are in use.
        """
        if not self._free_rows:
            raise PoolExhaustedError(f"all {self.max_running} request rows are in use")
        req = RequestSlots(row=self._free_rows.popleft())
        self.requests[req.row] = req
        return req

    def extend(self, items: "list[tuple[RequestSlots, int]]") -> tuple[list[int], list[int]]:
        """Allocate FULL and SWA slots for ``extend_len`` new positions of each request, in order.

        Writes ``req_to_token[row, seq_len : seq_len + extend_len]`` and
        ``full_to_swa_index_mapping[full_slot] = swa_slot`` on the device (one batched write each).

        Returns:
            (FULL slots, SWA slots) of the new positions, flattened in item order (host lists).

        Raises:
            PoolExhaustedError: a pool has too few free pages (nothing is allocated then), or a
                request would exceed ``max_context_len``.
        """
        ps = self.page_size
        need = 0
        for req, n in items:
            if req.seq_len + n > self.max_context_len:
                raise PoolExhaustedError(
                    f"request row {req.row}: {req.seq_len} + {n} positions exceed max_context_len={self.max_context_len}"
                )
            need += self.new_pages_needed(req, n)
        if need > len(self._full_free) or need > len(self._swa_free):
            raise PoolExhaustedError(
                f"need {need} pages; free: FULL {len(self._full_free)}, SWA {len(self._swa_free)}"
            )
        rows: list[int] = []
        positions: list[int] = []
        full_slots: list[int] = []
        swa_slots: list[int] = []
        for req, n in items:
            for _ in range(self.new_pages_needed(req, n)):
                req.full_pages.append(self._full_free.popleft())
                req.swa_pages.append(self._swa_free.popleft())
            start = req.seq_len
            for p in range(start, start + n):
                page, offset = divmod(p, ps)
                full_slots.append(req.full_pages[page] * ps + offset)
                swa_slots.append(req.swa_pages[page] * ps + offset)
            rows.extend([req.row] * n)
            positions.extend(range(start, start + n))
            req.seq_len = start + n
        if full_slots:
            dev = self.device
            full_t = torch.tensor(full_slots, dtype=torch.int64, device=dev)
            self.req_to_token[
                torch.tensor(rows, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev)
            ] = full_t.to(torch.int32)
            self.full_to_swa_index_mapping[full_t] = torch.tensor(swa_slots, dtype=torch.int64, device=dev)
        return full_slots, swa_slots

    # -- freeing ----------------------------------------------------------------------------------

    def _full_page_slots(self, pages: list[int]) -> list[int]:
        ps = self.page_size
        return [page * ps + offset for page in pages for offset in range(ps)]

    def _release(self, free_list: deque, pages: list[int]) -> None:
        if self.page_size == 1:
            free_list.extend(pages)
        else:
            free_list.extendleft(reversed(pages))

    def evict_out_of_window(self, reqs: "list[RequestSlots]", window: int) -> int:
        """Free the SWA pages of positions that left the sliding window (whole pages, a prefix).

        For each request the evicted length becomes ``max(0, seq_len - window) // page_size *
        page_size``; the mapping of the FULL slots of the freed pages is set to 0 (one batched
        device write).

        Returns:
            The number of SWA slots freed (pages x page_size).
        """
        ps = self.page_size
        zero_slots: list[int] = []
        freed: list[int] = []
        for req in reqs:
            target = max(0, req.seq_len - window) // ps * ps
            if target <= req.swa_evicted_len:
                continue
            first, last = req.swa_evicted_len // ps, target // ps
            pages = req.swa_pages[first:last]
            freed.extend(pages)
            req.swa_pages[first:last] = [0] * (last - first)
            zero_slots.extend(self._full_page_slots(req.full_pages[first:last]))
            req.swa_evicted_len = target
        if zero_slots:
            self.full_to_swa_index_mapping[torch.tensor(zero_slots, dtype=torch.int64, device=self.device)] = 0
        self._release(self._swa_free, freed)
        return len(freed) * ps

    def free_requests(self, reqs: "list[RequestSlots]") -> None:
        """Free every FULL and SWA page and the ``req_to_token`` row of each finished request.

        The mapping of the freed FULL slots is set to 0 and the row is cleared to 0 (batched device
        writes).
        """
        zero_slots: list[int] = []
        rows: list[int] = []
        full_freed: list[int] = []
        swa_freed: list[int] = []
        for req in reqs:
            if self.requests.pop(req.row, None) is None:
                raise ValueError(f"request row {req.row} is not open")
            zero_slots.extend(self._full_page_slots(req.full_pages))
            full_freed.extend(req.full_pages)
            swa_freed.extend(page for page in req.swa_pages if page != 0)
            rows.append(req.row)
            req.full_pages, req.swa_pages, req.seq_len, req.swa_evicted_len = [], [], 0, 0
        if zero_slots:
            self.full_to_swa_index_mapping[torch.tensor(zero_slots, dtype=torch.int64, device=self.device)] = 0
        if rows:
            self.req_to_token[torch.tensor(rows, dtype=torch.int64, device=self.device)] = 0
        self._release(self._full_free, full_freed)
        self._release(self._swa_free, swa_freed)
        self._free_rows.extend(rows)
