"""The reference hybrid-SWA inference engine: pools, scheduler and tiny model tied into forward steps.

One call to :meth:`ReferenceEngine.step` is one forward step:

1. requests whose arrival time has come join the waiting queue; the scheduler plans the step
   (decodes, prefill chunks, admissions; see :mod:`otel_swa.reference.scheduler`);
2. inside ``forward_span(batch_info)`` (a null context unless set): FULL and SWA slots are
   allocated for the new tokens, the model runs (:mod:`otel_swa.reference.model`), then, when a
   reporter is attached, ``reporter.observe("full", n_full)``, ``reporter.observe("swa", n_swa)`` and
   ``reporter.step(view)``, with ``view`` an :class:`otel_swa.views.SwaBatch` of the batch exactly as
   the forward used it; ``reporter.before_forward()`` before the model runs (the sampling flag of
   the in-forward checks); with provenance on (``EngineConfig.provenance``, a reporter that has
   ``enable_provenance``), the step's stamps written before the model runs and each layer's
   checksums and write check after its write (:mod:`otel_swa.device.provenance`);
3. after the forward, the SWA slots of tokens that left the window are freed and finished requests
   release all their slots.

The KV entries each layer read in the step, per request with ``seq_len`` tokens after the step and
``extend_len`` new ones: FULL ``seq_len`` (every cached position), SWA ``min(seq_len, window +
extend_len - 1)`` (the union of the windows of its queries). These are the ``verify_full`` and
``verify_swa`` increments.

Time is virtual: each forward step advances ``clock_s`` by ``step_time_s``; when nothing runs and
nothing waits, the clock jumps to the next arrival.

Example::

    from otel_swa.reference.engine import EngineConfig, ReferenceEngine
    from otel_swa.reference.trace import load_trace

    engine = ReferenceEngine(EngineConfig(window=64, full_pool_size=8192, swa_pool_size=2048))
    for request in load_trace("conv", limit=20):
        engine.submit(request, arrival_s=0.0)
    engine.run_until_done()
    print(engine.stats)
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import numpy as np
import torch

from otel_swa.reference.model import ForwardBatch, KVStorage, TinyHybridModel, prompt_token_ids
from otel_swa.reference.config import EngineConfig
from otel_swa.reference.pools import HybridKVPools
from otel_swa.reference.scheduler import ForwardItem, RequestState, Scheduler
from otel_swa.views import JoinedTokenIds, SwaAuditInputs, SwaBatch

__all__ = ["EngineConfig", "ReferenceEngine", "BatchInfo", "StepResult", "EngineStats"]

_log = logging.getLogger("otel_swa.reference.engine")


@dataclass(frozen=True)
class BatchInfo:
    """What the forward-step span is told about the step before it runs."""

    forward_ct: int
    batch_size: int
    num_prefill: int
    num_decode: int
    request_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepResult:
    """The outcome of one forward step.

    Attributes:
        forward_ct: the engine's forward count after this step (1 for the first).
        batch_size, num_prefill, num_decode: requests in the step, by kind.
        prefill_tokens, decode_tokens: new tokens in the step, by kind.
        full_entries_read, swa_entries_read: KV entries each layer read (the ``observe`` counts).
        swa_slots_freed: SWA slots freed by window eviction after the step.
        finished: ids of the requests that finished in this step.
        clock_s: the virtual clock after the step.
    """

    forward_ct: int
    batch_size: int
    num_prefill: int
    num_decode: int
    prefill_tokens: int
    decode_tokens: int
    full_entries_read: int
    swa_entries_read: int
    swa_slots_freed: int
    finished: tuple[int, ...]
    clock_s: float


@dataclass
class EngineStats:
    """Cumulative counts of an engine (slots are counted in whole pages x page_size)."""

    forward_steps: int = 0
    submitted: int = 0
    finished_requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    full_entries_read: int = 0
    swa_entries_read: int = 0
    swa_slots_freed: int = 0
    peak_full_slots: int = 0
    peak_swa_slots: int = 0
    peak_running: int = 0
    admission_held: dict[str, int] = field(default_factory=dict)


def _null_span(info: BatchInfo) -> ContextManager[Any]:
    return contextlib.nullcontext()


class ReferenceEngine:
    """A small continuous-batching engine with a hybrid FULL + SWA KV cache (module docstring).

    Args:
        config: sizes and policy (:class:`EngineConfig`; defaults when ``None``).
        reporter: an ``otel_swa.reporter.SwaDivergenceReporter`` on ``device``, or ``None`` for no
            reporter work at all. With the model running and ``config.read_check`` not ``"off"``, its
            read check is switched on (``reporter.enable_read_check``): the sliding-window layer's
            output is checked at each sampled step; with ``config.provenance``, its provenance
            (``reporter.enable_provenance``, over both pools).
        device: where the KV cache, the tables and the model live.

    Attributes:
        forward_span: ``Callable[[BatchInfo], ContextManager]`` entered around each forward step
            (allocation, forward, ``reporter.observe`` and ``reporter.step``); the scheduler's plan
            is made just before, so the span knows the batch. Default: a null context. An
            exception raised by the hook when the span starts or ends is logged (logger
            ``otel_swa.reference.engine``) and the step goes on: telemetry never stops the engine.
        pools, scheduler, model, kv: the parts (read them for checks; do not mutate).
    """

    def __init__(self, config: EngineConfig | None = None, reporter: Any = None, device: "str | torch.device" = "cpu") -> None:
        self.config = config = config if config is not None else EngineConfig()
        self.device = torch.device(device)
        self.pools = HybridKVPools(
            config.full_pool_size, config.swa_pool_size, config.page_size, config.max_running,
            config.max_context_len, self.device,
        )
        self.scheduler = Scheduler(self.pools, config.window, config.max_running, config.token_budget)
        self.model = TinyHybridModel(
            config.window, config.vocab_size, config.num_heads, config.head_dim, config.seed, self.device
        )
        self.kv = KVStorage.for_pools(self.pools, config.num_heads, config.head_dim) if config.run_model else None
        self.reporter = reporter
        self.forward_span: Callable[[BatchInfo], ContextManager[Any]] = _null_span
        self.forward_ct = 0
        self.clock_s = 0.0
        self.stats = EngineStats()
        self.finished: list[RequestState] = []
        self._pending: list[tuple[float, int, RequestState]] = []
        self._order = itertools.count()
        self._next_rid = 0
        self._last_items: list[ForwardItem] = []

    @property
    def reporter(self) -> Any:
        """The engine's reporter (``None``: no reporter work). Setting one with the model running and
        ``config.read_check`` not ``"off"`` switches its read check on (``reporter.enable_read_check``,
        when it has one: any object with ``observe`` and ``step`` will do)."""
        return self._reporter

    @reporter.setter
    def reporter(self, reporter: Any) -> None:
        self._reporter = reporter
        self._read_check_due = None
        self._provenance = None
        self._before_forward = getattr(reporter, "before_forward", None)
        config = self.config
        if config.run_model and config.read_check != "off" and hasattr(reporter, "enable_read_check"):
            reporter.enable_read_check(max_queries=config.read_check_queries, layers=config.read_check)
            # a sampling step, or the checks' recorded path (the flag then decides at the sample)
            self._read_check_due = getattr(reporter, "checks_wanted", None) or reporter.read_check_due
        if config.run_model and config.provenance != "off" and hasattr(reporter, "enable_provenance"):
            self._provenance = reporter.enable_provenance(
                full_slots=self.kv.full_k.shape[0], swa_slots=self.kv.swa_k.shape[0], checksum=config.provenance,
                budget=config.provenance_budget, checksum_order={"full": (0,), "swa": (1,)})

    # -- input ------------------------------------------------------------------------------------

    def submit(self, request: Any, *, arrival_s: float | None = None, rid: int | None = None) -> RequestState:
        """Queue a request (any object with ``context_tokens``, ``generated_tokens`` and optionally
        ``arrival_s``, e.g. a :class:`otel_swa.reference.trace.TraceRequest`).

        Args:
            arrival_s: virtual arrival time overriding ``request.arrival_s`` (0 = at once).
            rid: request id; by default the number of requests submitted before.

        Raises:
            RequestTooLargeError: the request can never run with this configuration.
            ValueError: negative token counts or arrival time.
        """
        context, generated = int(request.context_tokens), int(request.generated_tokens)
        arrival = float(getattr(request, "arrival_s", 0.0) if arrival_s is None else arrival_s)
        rid = self._next_rid if rid is None else rid
        if context < 0 or generated < 0 or not arrival >= 0:
            raise ValueError(
                f"request {rid}: context_tokens={context}, generated_tokens={generated}, arrival_s={arrival}; "
                "expected counts >= 0 and a time >= 0"
            )
        state = RequestState(rid, max(1, context), generated, arrival)
        self.scheduler.check_fits(state)
        self._next_rid = max(self._next_rid, rid + 1)
        heapq.heappush(self._pending, (arrival, next(self._order), state))
        self.stats.submitted += 1
        return state

    def _admit_arrivals(self) -> None:
        if not self.scheduler.running and not self.scheduler.waiting and self._pending:
            self.clock_s = max(self.clock_s, self._pending[0][0])
        while self._pending and self._pending[0][0] <= self.clock_s:
            state = heapq.heappop(self._pending)[2]
            state.prompt_ids = prompt_token_ids(self.config.seed, state.rid, state.context_tokens, self.config.vocab_size)
            self.scheduler.add(state)

    @property
    def has_work(self) -> bool:
        """Whether requests are pending, waiting or running."""
        return bool(self._pending or self.scheduler.waiting or self.scheduler.running)

    # -- the forward step -------------------------------------------------------------------------

    def step(self) -> StepResult | None:
        """Run one forward step (module docstring). Returns ``None`` when there is no work left."""
        self._admit_arrivals()
        if not (self.scheduler.waiting or self.scheduler.running):
            return None
        items = self.scheduler.schedule(self.forward_ct + 1)
        if self.scheduler.last_hold is not None:
            held = self.stats.admission_held
            held[self.scheduler.last_hold] = held.get(self.scheduler.last_hold, 0) + 1
        if not items:  # the reservations make this impossible; guard against a silent stall
            raise RuntimeError(f"forward step {self.forward_ct + 1}: nothing could be scheduled")
        num_decode = sum(1 for it in items if it.decode)
        info = BatchInfo(self.forward_ct + 1, len(items), len(items) - num_decode, num_decode, tuple(it.req.rid for it in items))
        window = self.config.window
        full_read = sum(it.seq_len for it in items)
        swa_read = sum(min(it.seq_len, window + it.extend_len - 1) for it in items)
        span = self._open_span(info)
        exc_info: tuple = (None, None, None)
        try:
            next_ids = self._forward(items)
            self.forward_ct += 1
            self._last_items = items
            if self.reporter is not None:
                self.reporter.observe("full", full_read)
                self.reporter.observe("swa", swa_read)
                self.reporter.step(self.view)  # built only at sampling steps
        except BaseException:
            exc_info = sys.exc_info()
            raise
        finally:
            self._close_span(span, exc_info)
        return self._after_forward(items, next_ids, full_read, swa_read)

    def _open_span(self, info: BatchInfo) -> "ContextManager[Any] | None":
        """Enter ``forward_span(info)``; a failing hook is logged and skipped, never raised."""
        try:
            span = self.forward_span(info)
            span.__enter__()
            return span
        except Exception:
            _log.exception("forward_span hook failed to start the span of forward step %d", info.forward_ct)
            return None

    def _close_span(self, span: "ContextManager[Any] | None", exc_info: tuple) -> None:
        if span is None:
            return
        try:
            span.__exit__(*exc_info)
        except Exception:
            _log.exception("forward_span hook failed to end its span")

    def _forward(self, items: list[ForwardItem]) -> list[int]:
        pools, dev = self.pools, self.device
        full_slots, swa_slots = pools.extend([(it.req.slots, it.extend_len) for it in items])
        self.stats.peak_full_slots = max(self.stats.peak_full_slots, pools.full_used_slots)
        self.stats.peak_swa_slots = max(self.stats.peak_swa_slots, pools.swa_used_slots)
        self.stats.peak_running = max(self.stats.peak_running, len(self.scheduler.running))
        if not self.config.run_model:
            return [0] * len(items)
        if self._before_forward is not None:
            self._before_forward()
        batch = self._forward_batch(items, full_slots, swa_slots)
        hook = self._read_check_hook(items) if self._read_check_due is not None and self._read_check_due() else None
        on_layer = self._provenance_hooks(batch) if self._provenance is not None else None
        self.last_hidden, next_ids = self.model.forward(batch, pools, self.kv, hook, on_layer)
        return next_ids.tolist()

    def _forward_batch(self, items: list[ForwardItem], full_slots: list[int], swa_slots: list[int]) -> ForwardBatch:
        """The model's inputs for the step: new tokens, positions and slots on the device."""
        dev = self.device
        token_parts = []
        for it in items:
            if it.decode:
                token_parts.append(torch.tensor(it.req.output_ids[-1:], dtype=torch.int64))
            else:
                token_parts.append(it.req.prompt_ids[it.prefix_len : it.seq_len])
        positions = torch.cat([torch.arange(it.prefix_len, it.seq_len, dtype=torch.int64) for it in items])
        return ForwardBatch(
            token_ids=torch.cat(token_parts).to(dev),
            positions=positions.to(dev),
            full_slots=torch.tensor(full_slots, dtype=torch.int64, device=dev),
            swa_slots=torch.tensor(swa_slots, dtype=torch.int64, device=dev),
            rows=[it.req.slots.row for it in items],
            prefix_lens=[it.prefix_len for it in items],
            extend_lens=[it.extend_len for it in items],
        )

    def _provenance_hooks(self, batch: ForwardBatch) -> Callable[..., Any]:
        """Stamp the step's slots now (before the model writes them) and return the per-layer call
        that writes the checksums and runs the write check (:mod:`otel_swa.device.provenance`)."""
        dev, pools, provenance = self.device, self.pools, self._provenance
        tokens = batch.token_ids.shape[0]
        starts = None
        if tokens != len(batch.rows):  # an extend batch: each request's first token in the step
            starts = torch.tensor(np.cumsum(batch.extend_lens) - batch.extend_lens, dtype=torch.int64, device=dev)
        mapping = pools.full_to_swa_index_mapping
        provenance.stamp(
            input_ids=batch.token_ids, positions=batch.positions, out_cache_loc=batch.full_slots,
            req_pool_indices=torch.tensor(batch.rows, dtype=torch.int64, device=dev),
            req_to_token=pools.req_to_token, full_to_swa_index_mapping=mapping, extend_start_loc=starts,
        )

        def on_layer(*, layer_id, swa, k, v, k_buffer, v_buffer) -> None:
            provenance.after_layer(
                layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer,
                out_cache_loc=batch.full_slots, full_to_swa_index_mapping=mapping, positions=batch.positions,
                extend_start_loc=starts,
            )

        return on_layer

    def _read_check_hook(self, items: list[ForwardItem]) -> Callable[..., Any]:
        """The sliding-window layer's call into the reporter's read check at a sampled step: the
        batch's rows, lengths and last-query rows (the end of each request's new tokens), the
        engine's window and its mapping (:mod:`otel_swa.device.read_check`)."""
        dev = self.device
        rows = torch.tensor([it.req.slots.row for it in items], dtype=torch.int64, device=dev)
        seq_lens = torch.tensor([it.seq_len for it in items], dtype=torch.int64, device=dev)
        query_rows = torch.tensor(np.cumsum([it.extend_len for it in items]) - 1, dtype=torch.int64, device=dev)
        check, pools, window = self.reporter.read_check, self.pools, self.config.window

        def hook(*, layer_id, q, out, k_buffer, v_buffer, scaling, num_q_heads) -> None:
            if check.wants(layer_id):
                check.check_layer(
                    layer_id=layer_id, q=q, out=out, k_buffer=k_buffer, v_buffer=v_buffer,
                    req_to_token=pools.req_to_token, full_to_swa_index_mapping=pools.full_to_swa_index_mapping,
                    req_pool_indices=rows, seq_lens=seq_lens, query_rows=query_rows, window=window,
                    scaling=scaling, num_q_heads=num_q_heads,
                )

        return hook

    def _after_forward(self, items: list[ForwardItem], next_ids: list[int], full_read: int, swa_read: int) -> StepResult:
        finished: list[RequestState] = []
        prefill_tokens = decode_tokens = 0
        for it, token in zip(items, next_ids):
            req = it.req
            if it.decode:
                decode_tokens += 1
                req.output_ids.append(token)
            else:
                prefill_tokens += it.extend_len
                req.prefilled += it.extend_len
                if not req.in_prefill and req.generated_tokens > 0:
                    req.output_ids.append(token)
            if req.finished:
                req.finished_at = self.forward_ct
                finished.append(req)
        done = set(map(id, finished))
        freed = self.pools.evict_out_of_window(
            [req.slots for req in self.scheduler.running if id(req) not in done], self.config.window
        )
        self.pools.free_requests([req.slots for req in finished])
        self.scheduler.retire(finished)
        self.finished.extend(finished)
        self.clock_s += self.config.step_time_s
        s = self.stats
        s.forward_steps += 1
        s.finished_requests += len(finished)
        s.prefill_tokens += prefill_tokens
        s.decode_tokens += decode_tokens
        s.full_entries_read += full_read
        s.swa_entries_read += swa_read
        s.swa_slots_freed += freed
        return StepResult(
            self.forward_ct, len(items), len(items) - decode_tokens, decode_tokens, prefill_tokens, decode_tokens,
            full_read, swa_read, freed, tuple(req.rid for req in finished), self.clock_s,
        )

    def run_until_done(self, max_steps: int | None = None) -> EngineStats:
        """Step until every submitted request has finished (or ``max_steps`` steps ran)."""
        steps = 0
        while (max_steps is None or steps < max_steps) and self.step() is not None:
            steps += 1
        return self.stats

    # -- what the reporter and the checks read ----------------------------------------------------

    def view(self) -> SwaBatch:
        """The batch of the last forward step as the reporter's view (device tensors, by reference).

        Valid inside the step (where the reporter reads it): after the step, finished requests have
        released their rows.

        ``req_pool_indices`` and ``seq_lens`` are ``int64`` ``[batch]`` on the engine's device;
        ``seq_lens_cpu`` and ``req_pool_indices_cpu`` are the host lists of the same values (the
        reporter then does the rows' work on the host); ``swa_audit`` holds the SWA free list and the
        FULL slots of every request holding KV outside the batch, the batch's being holders through
        the sample's own gathers (``holders_include_batch``), so the reporter also audits the SWA
        pool for leaked slots, stale tokens and shared slots.

        ``sliding_window`` is ``config.window`` (the reference attention reads the last ``window``
        positions, the current one included: :mod:`otel_swa.reference.model`) and
        ``extend_lens_cpu`` each request's ``ForwardItem.extend_len`` (1 for a decode, the chunk for
        a prefill), so each sample also counts premature evictions among the positions the step's
        queries read (the last ``window + extend_len - 1``) and late-held SWA slots.
        ``swa_eviction_allowance`` is ``page_size``: the view is read inside the step, before this
        step's eviction; the previous one (:meth:`HybridKVPools.evict_out_of_window`, at ``seq_len
        - extend_len``) frees whole pages below ``seq_len - extend_len - window``, so a healthy
        engine holds SWA slots down to ``seq_len - window - extend_len - page_size + 1``, at most
        ``page_size`` positions older than the first query reads, and counts 0 late-held.

        Raises:
            RuntimeError: no forward step has run yet.
        """
        if not self._last_items:
            raise RuntimeError("no forward step has run yet")
        rows = [it.req.slots.row for it in self._last_items]
        seq_lens = [it.seq_len for it in self._last_items]
        page_size = self.pools.page_size
        return SwaBatch(
            req_to_token=self.pools.req_to_token,
            full_to_swa_index_mapping=self.pools.full_to_swa_index_mapping,
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            seq_lens_cpu=seq_lens,
            req_pool_indices_cpu=rows,
            swa_audit=self._swa_audit_inputs(),
            sliding_window=self.config.window,
            swa_eviction_allowance=page_size,
            extend_lens_cpu=[it.extend_len for it in self._last_items],
            request_ids=[it.req.rid for it in self._last_items],
            token_ids=([JoinedTokenIds(it.req.prompt_ids, it.req.output_ids) for it in self._last_items]
                       if self._provenance is not None else None),
        )

    def _swa_audit_inputs(self) -> SwaAuditInputs:
        """The audit's inputs at a sampling step: the batch's requests are holders through the
        sample's own gathers (``holders_include_batch``); the FULL slots of the other requests
        holding KV come from host arrays built without a Python loop per token (numpy over the
        requests) and one device gather. Both the free list and those holders are read only when
        the reporter's audit asks (at the first sample of a pass), inside the step."""
        pools = self.pools
        return SwaAuditInputs(
            swa_free_page_ids=lambda: torch.from_numpy(pools.free_swa_page_array()).to(self.device),
            num_swa_pages=pools.swa_pages,
            page_size=pools.page_size,
            holder_full_slots=self._holders_outside_batch,
            holders_include_batch=True,
        )

    def _holders_outside_batch(self) -> torch.Tensor:
        pools = self.pools
        in_batch = {it.req.slots.row for it in self._last_items}
        holders = [slots for slots in pools.requests.values() if slots.row not in in_batch]
        req_to_token = pools.req_to_token
        lens = np.fromiter((slots.seq_len for slots in holders), dtype=np.int64, count=len(holders))
        total = int(lens.sum())
        if total:
            rows = np.fromiter((slots.row for slots in holders), dtype=np.int64, count=len(holders))
            # flat index of position p of a holder in row r: r * width + p
            offsets = rows * req_to_token.stride(0) - (np.cumsum(lens) - lens)
            index = np.repeat(offsets, lens) + np.arange(total, dtype=np.int64)
            holder_full_slots = req_to_token.view(-1).index_select(0, torch.from_numpy(index).to(self.device))
        else:
            holder_full_slots = torch.zeros(0, dtype=torch.int64, device=self.device)
        return holder_full_slots

    @property
    def last_batch(self) -> tuple[ForwardItem, ...]:
        """The items of the last forward step (request, prefix length, extend length)."""
        return tuple(self._last_items)

    @property
    def running(self) -> list[RequestState]:
        """The running requests (a copy of the list)."""
        return list(self.scheduler.running)

    def free_full_slots(self) -> list[int]:
        """Every free FULL slot (the free pages expanded to slots)."""
        ps = self.pools.page_size
        pages = self.pools.free_full_page_list()
        return pages if ps == 1 else [page * ps + o for page in pages for o in range(ps)]

    def free_swa_slots(self) -> list[int]:
        """Every free SWA slot (the free pages expanded to slots)."""
        ps = self.pools.page_size
        pages = self.pools.free_swa_page_list()
        return pages if ps == 1 else [page * ps + o for page in pages for o in range(ps)]
