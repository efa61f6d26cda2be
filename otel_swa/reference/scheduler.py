"""Continuous batching for the reference engine: a waiting queue, a running set, chunked prefill.

Each forward step is planned by :meth:`Scheduler.schedule`:

1. every running request whose prompt is done decodes one token (the token it produced last);
2. running requests still in prefill get their next chunk of the prompt, in admission order;
3. waiting requests are admitted in arrival order (first come, first served: when the head of the
   queue cannot be admitted, nobody behind it is) and get their first chunk;

while the forward's token budget (``token_budget`` tokens, decode tokens included) lasts and at most
``max_running`` requests run. A request whose prompt does not fit in the budget is prefilled in
chunks over several forward steps.

Admission is held back (the request stays queued, it never fails) unless both pools can take it:

- FULL pool: a request keeps every FULL slot until it finishes, so it reserves the pages of its
  whole life, ``ceil(kv_len / page_size)`` with ``kv_len = context_tokens + generated_tokens - 1``
  (the last generated token is never fed back, so it gets no KV entry);
- SWA pool: after each forward the engine frees the SWA pages of tokens that left the window, so
  between forward steps a request holds at most ``ceil((window + page_size - 1) / page_size)`` SWA
  pages. It reserves that plus one page (the next token), or the pages of its whole life if fewer.
  Prefill chunks longer than that borrow free SWA pages that no reservation claims; after the
  forward, eviction gives them back.

The reservations never exceed the pools, so a running request can always make progress and the
engine cannot deadlock. A request that could never be admitted even into empty pools (longer than
``max_context_len``, or a reservation larger than a pool) is rejected at :meth:`Scheduler.add`
with :class:`RequestTooLargeError`.

A request with 0 context tokens is given a one-token prompt; a request with 0 generated tokens
finishes after its prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from otel_swa.reference.pools import HybridKVPools, RequestSlots, pages_for

__all__ = ["RequestState", "ForwardItem", "Scheduler", "RequestTooLargeError", "AdmissionStats"]


class RequestTooLargeError(ValueError):
    """A request can never run with this engine configuration (the message names it and the sizes)."""


@dataclass(eq=False)
class RequestState:
    """One request inside the engine.

    Attributes:
        rid: request id (the index in the submitted trace by default).
        context_tokens: prompt length in tokens (>= 1).
        generated_tokens: number of tokens to generate (>= 0).
        arrival_s: arrival time on the engine's virtual clock, in seconds.
        prompt_ids: the prompt's token ids, ``int64`` CPU tensor of shape ``[context_tokens]``.
        output_ids: the generated token ids so far.
        slots: the request's host state in the pools while it runs.
        prefilled: prompt positions already in the KV cache.
        admitted_at: the forward step (engine count) of its first chunk, -1 while queued.
        finished_at: the forward step it finished in, -1 before.
    """

    rid: int
    context_tokens: int
    generated_tokens: int
    arrival_s: float = 0.0
    prompt_ids: "torch.Tensor | None" = None
    output_ids: list[int] = field(default_factory=list)
    slots: "RequestSlots | None" = None
    prefilled: int = 0
    admitted_at: int = -1
    finished_at: int = -1

    @property
    def kv_len(self) -> int:
        """KV entries the request holds at the end of its life (prompt + output - 1)."""
        return self.context_tokens + max(0, self.generated_tokens - 1)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.context_tokens

    @property
    def finished(self) -> bool:
        return not self.in_prefill and len(self.output_ids) >= self.generated_tokens

    def token_ids(self) -> list[int]:
        """Every token fed to the model so far, in position order (prompt then output)."""
        fed = self.prefilled + max(0, len(self.output_ids) - 1)  # the newest output is not fed yet
        return (self.prompt_ids.tolist() + self.output_ids)[:fed]


@dataclass(frozen=True)
class ForwardItem:
    """One request's share of a forward step: positions ``prefix_len .. prefix_len + extend_len - 1``."""

    req: RequestState
    prefix_len: int
    extend_len: int
    decode: bool

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache after the forward."""
        return self.prefix_len + self.extend_len


@dataclass
class AdmissionStats:
    """Why admissions were held back, counted once per forward step in which the queue head waited.

    Attributes:
        held_full: the FULL pool could not take the head's reservation.
        held_swa: the SWA pool could not take the head's reservation.
        held_running: ``max_running`` requests were running.
        held_budget: the token budget was used up.
    """

    held_full: int = 0
    held_swa: int = 0
    held_running: int = 0
    held_budget: int = 0


class Scheduler:
    """Plans forward steps over a :class:`HybridKVPools` (see the module docstring for the policy).

    Args:
        pools: the KV cache; the scheduler opens request rows in it and reads its free pages.
        window: the sliding window in tokens (>= 1).
        max_running: the most requests in one forward step.
        token_budget: the most tokens in one forward step (>= ``max_running``, so every running
            request can always decode).

    Raises:
        ValueError: ``token_budget < max_running`` or ``max_running`` above the pools' request rows.
    """

    def __init__(self, pools: HybridKVPools, window: int, max_running: int, token_budget: int) -> None:
        if token_budget < max_running:
            raise ValueError(f"token_budget={token_budget} is below max_running={max_running}; every running request must be able to decode")
        if max_running > pools.max_running:
            raise ValueError(f"max_running={max_running} exceeds the pools' {pools.max_running} request rows")
        self.pools = pools
        self.window = window
        self.max_running = max_running
        self.token_budget = token_budget
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.admission = AdmissionStats()
        self.last_hold: str | None = None
        self._full_reserved = 0
        self._swa_reserved = 0

    # -- reservations -----------------------------------------------------------------------------

    def full_reservation(self, req: RequestState) -> int:
        """FULL pages reserved for ``req`` while it runs."""
        return pages_for(req.kv_len, self.pools.page_size)

    def swa_reservation(self, req: RequestState) -> int:
        """SWA pages reserved for ``req`` while it runs."""
        ps = self.pools.page_size
        return min(pages_for(req.kv_len, ps), pages_for(self.window + ps - 1, ps) + 1)

    def check_fits(self, req: RequestState) -> None:
        """Reject a request that could never run.

        Raises:
            RequestTooLargeError: the request needs more positions than ``max_context_len`` or more
                pages than a pool has; the message names the request and the sizes.
        """
        pools = self.pools
        what = f"request {req.rid} (context {req.context_tokens} + generated {req.generated_tokens} tokens)"
        if req.kv_len > pools.max_context_len:
            raise RequestTooLargeError(
                f"{what} needs {req.kv_len} KV positions; max_context_len is {pools.max_context_len}"
            )
        full, swa = self.full_reservation(req), self.swa_reservation(req)
        if full > pools.full_pages:
            raise RequestTooLargeError(
                f"{what} needs {full * pools.page_size} FULL slots; the FULL pool has {pools.full_size}"
            )
        if swa > pools.swa_pages:
            raise RequestTooLargeError(
                f"{what} needs {swa * pools.page_size} SWA slots (window {self.window}); the SWA pool has {pools.swa_size}"
            )

    def add(self, req: RequestState) -> None:
        """Queue an arrived request. Raises :class:`RequestTooLargeError` (see :meth:`check_fits`)."""
        self.check_fits(req)
        self.waiting.append(req)

    # -- planning ---------------------------------------------------------------------------------

    def _swa_unreserved(self) -> int:
        """Free SWA pages that no running request's reservation claims (``swa_pages`` minus the
        sum of reservations, as every running request holds at most its reservation here)."""
        claimed = 0
        for req in self.running:
            claimed += max(0, self.swa_reservation(req) - self.pools.swa_pages_held(req.slots))
        return self.pools.swa_free_pages - claimed

    def _chunk(self, req: RequestState, budget: int, borrowable: int) -> tuple[int, int]:
        """Largest next prompt chunk for ``req`` -> (tokens, pages borrowed beyond its reservation)."""
        pools, ps = self.pools, self.pools.page_size
        slots = req.slots
        own = max(0, self.swa_reservation(req) - pools.swa_pages_held(slots))
        max_pages = len(slots.full_pages) + own + borrowable
        tokens = min(req.context_tokens - req.prefilled, budget, max_pages * ps - slots.seq_len)
        if tokens <= 0:
            return 0, 0
        new_pages = pools.new_pages_needed(slots, tokens)
        return tokens, max(0, new_pages - own)

    def schedule(self, forward_ct: int = 0) -> list[ForwardItem]:
        """Plan the next forward step; admits waiting requests (opening their rows in the pools).

        Returns:
            The items of the step, decode items first; empty when nothing can run.
        """
        items: list[ForwardItem] = []
        budget = self.token_budget
        for req in self.running:
            if not req.in_prefill:
                items.append(ForwardItem(req, req.slots.seq_len, 1, True))
                budget -= 1
        borrowable = self._swa_unreserved()
        for req in self.running:
            if req.in_prefill and budget > 0:
                tokens, borrowed = self._chunk(req, budget, borrowable)
                if tokens:
                    items.append(ForwardItem(req, req.prefilled, tokens, False))
                    budget -= tokens
                    borrowable -= borrowed
        self.last_hold = None
        pools = self.pools
        while self.waiting:
            req = self.waiting[0]
            if len(self.running) >= self.max_running:
                self.last_hold = "running"
            elif budget <= 0:
                self.last_hold = "budget"
            elif self._full_reserved + self.full_reservation(req) > pools.full_pages:
                self.last_hold = "full"
            elif self.swa_reservation(req) > borrowable:
                # borrowable <= swa_pages - (sum of reservations), less what this step's chunks borrow
                self.last_hold = "swa"
            if self.last_hold is not None:
                setattr(self.admission, f"held_{self.last_hold}", getattr(self.admission, f"held_{self.last_hold}") + 1)
                break
            self.waiting.popleft()
            req.slots = pools.open_request()
            req.admitted_at = forward_ct
            self.running.append(req)
            self._full_reserved += self.full_reservation(req)
            self._swa_reserved += self.swa_reservation(req)
            borrowable -= self.swa_reservation(req)
            tokens, borrowed = self._chunk(req, budget, borrowable)
            items.append(ForwardItem(req, 0, tokens, False))
            budget -= tokens
            borrowable -= borrowed
        return items

    def retire(self, finished: "list[RequestState]") -> None:
        """Remove finished requests from the running set and release their reservations.

        The caller frees their slots in the pools.
        """
        gone = set(map(id, finished))
        self.running = [req for req in self.running if id(req) not in gone]
        for req in finished:
            self._full_reserved -= self.full_reservation(req)
            self._swa_reserved -= self.swa_reservation(req)
