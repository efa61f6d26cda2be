"""The read check: did a sliding-window attention layer read the KV the mapping says?

torch only; runs on the KV cache's device, on the current stream, with no host synchronisation and
fixed shapes (``Q`` queries x ``W`` keys), so it can run in an eager forward step or be captured in
a CUDA graph.

The allocator's bookkeeping (the sample, the audit, the window check) says which SWA slot each live
token should be read from; an attention kernel may still read others (sglang 0.5.23's torch-native
backend writes sliding-window layers at the translated SWA slots and reads them at the raw FULL
slots of ``req_to_token``; a kernel whose window is one position off, sgl-project/sglang#34354; a
stale page table that still points at freed slots). The read check compares what the layer
produced with what the mapping implies, for a few queries of the step:

for each checked query (the last token of a request of the batch, at position ``p = seq_len - 1``),
the keys and values at positions ``max(0, p - W + 1) .. p`` (``W``: the keys one query reads, its own
included) are gathered from the layer's KV buffers at the slots
``full_to_swa_index_mapping[req_to_token[row, position]]`` (the FULL slots themselves for a layer
without a mapping), the attention output is recomputed in float32 (``softmax(scaling * q k^T)``,
grouped-query heads, optional tanh logit capping ``cap * tanh(s / cap)`` and optional per-head
attention sinks, an extra logit in the softmax denominator with no value), and compared with the
engine's output for that token, element by element.

The tolerance is what a correct kernel's rounding can move the output by: ``4 u (|o| + max|V| x
||w||_2)`` per element, ``o`` the recomputed output, ``max|V|`` the largest value in the window,
``||w||_2`` the 2-norm of the attention weights (``1/sqrt(W)`` for attention spread evenly over
``W`` keys, 1 for attention on one key: the error of weights rounded to the dtype before the
weighted sum, as flash kernels do, grows so), and ``u`` the unit roundoff of the least precise of
the output's and the KV buffers' dtypes, at least ``2**-11`` (:func:`rounding`: TF32, in which
float32 products are often made on GPUs). A non-finite output always disagrees.

Sensitivity, from the tolerance: a read that differs from the mapping's in keys carrying a total
attention weight ``a`` changes the output by about ``a |v - v'|``; it is seen when that exceeds the
tolerance. A misread of a whole window (raw FULL slots once the SWA allocator remaps, a slot
reused by another request) always is. A single key misread, or a window one position short or
long, moves the output by about ``max|V| / W`` under evenly spread attention, against a tolerance
of about ``4 u max|V| / sqrt(W)``: seen while ``sqrt(W) < 1 / (4 u)``, i.e. at every window in
float32 (``u = 2**-11``: ``W`` up to about 260,000), up to ``W`` of about 1,000 in bfloat16 and
16,000 in float16, and beyond that as attention is sharper than even (as it is in trained models:
``||w||_2`` larger and the key's weight larger than ``1/W``). ``benchmarks/bench_read_check.py``
prints the measured detection of such faults at several shapes.

Results accumulate over the layers checked in one forward step into :attr:`ReadCheck.cells`
(``int64 [READ_WIDTH]`` on the device, layout :data:`READ_CELLS`): queries checked, queries that
disagreed, queries that could not be checked, and the first disagreeing query (the first in call
order: layer by layer, then query by query): its batch entry, ``req_to_token`` row, position,
its own FULL and SWA slot (the query's, not the misread key's: which key was misread is not known)
and the layer. The reporter copies the cells with the step's sample and clears them
(:meth:`ReadCheck.take`).

Inside CUDA graphs. With a :class:`~otel_swa.device.gate.SamplingGate` (the reporter gives its own),
the check has one device path with fixed shapes and no host read: the requests checked rotate with
a device counter (advanced by :meth:`ReadCheck.take`), and on the recorded path (a capture under way,
or the gate's ``force_recorded``) every count is masked by the gate's sampling flag, or the work put
in a conditional node (:mod:`otel_swa.device.gate`). A forward replayed from a graph that holds the
check is then checked at its sampled steps exactly as an eager one; :attr:`ReadCheck.recorded_calls`
says that a graph holds it. The layer a graph checks under ``rotate`` is the one whose turn it was
when the graph was captured. Padding entries of a captured batch (SGLang's ``req_pool_indices`` 0,
``seq_lens`` 1) are checked like any request: their output is computed from the same slots.

Cost per checked layer: about 30 device operations (about 70 on the recorded path, which keeps the
first offender on the device and masks every count) on ``Q x W`` keys (the gathers of ``Q x W x
kv_heads x head_dim`` K and V values and two batched products), ``Q = max_queries`` (8) or the
batch when smaller. The window is taken in chunks that keep the gathered K and V within
``kv_budget_bytes`` (default 16 MiB; one chunk unless ``Q x W x kv_heads x (head_dim +
v_head_dim) x 4`` bytes exceed it), with an online softmax over the chunks: the memory is bounded
at every window, each further chunk about 20 more operations.
"""

from __future__ import annotations


import torch

from otel_swa.checks.read import READ_CELLS, READ_WIDTH, read_counts, read_offender_fields
from otel_swa.device.gate import SamplingGate, commit_counts

__all__ = ["READ_WIDTH", "READ_CELLS", "READ_CHECK_MODES", "ReadCheck", "rounding", "read_counts", "read_offender_fields"]

_C = {name: index for index, name in enumerate(READ_CELLS)}

#: Which sliding-window layers a sampled forward step checks: ``rotate`` (default: one layer per
#: sampled step, in turn, so the cost does not grow with the model's depth), ``all``.
READ_CHECK_MODES = ("rotate", "all")

#: KV and output dtypes the check recomputes; any other (fp8 KV caches, which need their scales) is
#: counted as unchecked.
_CHECKED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def rounding(*dtypes: torch.dtype) -> float:
    """The unit roundoff the comparison allows for outputs and KV buffers of ``dtypes``: the
    largest ``eps`` among them, and at least ``2**-11`` (TF32, in which float32 matrix products on
    GPUs are often made: Triton's ``tl.dot`` default, ``torch.set_float32_matmul_precision("high")``).

    Raises:
        ValueError: a dtype that is not a floating-point one.
    """
    for dtype in dtypes:
        if not dtype.is_floating_point:
            raise ValueError(f"rounding: {dtype} is not a floating-point dtype")
    return max(max(torch.finfo(dtype).eps for dtype in dtypes), 2.0**-11)


class ReadCheck:
    """Accumulates the read checks of the sliding-window layers of one forward step (module
    docstring) on ``device``.

    Args:
        device: the KV cache's device.
        max_queries: queries checked per layer (int >= 1; the batch's requests in turn across
            sampled steps, the last token of each).
        layers: :data:`READ_CHECK_MODES`.
        kv_budget_bytes: the most float32 K and V bytes one gather of the check holds (int >= 1):
            the window is taken in chunks of that size (module docstring); the queries checked are
            always ``max_queries`` or the batch when smaller.
        gate: the reporter's :class:`~otel_swa.device.gate.SamplingGate` (the recorded path inside
            CUDA graphs); ``None``: a gate of its own whose flag is always set (every call counts,
            replayed from a graph or not: the caller decides when to check).

    Raises:
        ValueError: a bad argument (named, with the value).
    """

    def __init__(
        self,
        device: "torch.device | str",
        *,
        max_queries: int = 8,
        layers: str = READ_CHECK_MODES[0],
        kv_budget_bytes: int = 16 << 20,
        gate: "SamplingGate | None" = None,
    ) -> None:
        if type(max_queries) is not int or max_queries < 1:  # noqa: E721
            raise ValueError(f"max_queries must be an int >= 1, got {max_queries!r}")
        if layers not in READ_CHECK_MODES:
            raise ValueError(f"layers must be one of {', '.join(READ_CHECK_MODES)}, got {layers!r}")
        if type(kv_budget_bytes) is not int or kv_budget_bytes < 1:  # noqa: E721
            raise ValueError(f"kv_budget_bytes must be an int >= 1, got {kv_budget_bytes!r}")
        self.device = torch.device(device)
        self.max_queries = max_queries
        self.layers = layers
        self.kv_budget_bytes = kv_budget_bytes
        if gate is None:
            gate = SamplingGate(self.device)
            gate.set(True)
        self.gate = gate
        #: check_layer calls made on the recorded path (host): > 0 once a captured graph holds the check.
        self.recorded_calls = 0
        self._start = torch.zeros((), dtype=torch.int64, device=self.device)  # the first query's entry, rotated
        #: ``int64 [READ_WIDTH]`` on ``device``: this step's results so far (:data:`READ_CELLS`).
        self.cells = torch.zeros(READ_WIDTH, dtype=torch.int64, device=self.device)
        self._turn = 0  # sampled steps taken so far: which layer and which requests come next
        self._seen: list[int] = []  # sliding-window layer ids in the order first called
        self._arange = torch.arange(max_queries, dtype=torch.int64, device=self.device)
        self._window_offsets: dict[int, torch.Tensor] = {}
        #: ``check_layer`` and :meth:`unchecked` calls since the last :meth:`take` (host): 0 at a sampled step means no
        #: layer was checked (the step was replayed from a CUDA graph, or no sliding-window layer ran).
        self.layer_calls = 0

    # ------------------------------------------------------------------ which layers, which queries
    def wants(self, layer_id: int) -> bool:
        """Whether this step checks layer ``layer_id`` (``rotate``: one layer per sampled step, the
        layers in the order they were first called; ``all``: every one). Host work only."""
        if layer_id not in self._seen:
            self._seen.append(layer_id)
        if self.layers == "all":
            return True
        return self._seen.index(layer_id) == self._turn % len(self._seen)

    def _offsets(self, window: int, device: torch.device, capturing: bool) -> torch.Tensor:
        """``[1, W]``: ``-W + 1 .. 0``, made once per window (outside a capture: one made inside is a
        temporary of the graph, recomputed at each replay, never kept)."""
        cached = self._window_offsets.get(window)
        if cached is None:
            cached = (torch.arange(window, device=device) - (window - 1)).unsqueeze(0)
            if not capturing:
                self._window_offsets[window] = cached
        return cached

    # ------------------------------------------------------------------ the check
    def unchecked(self, queries: int) -> None:
        """Count ``queries`` queries of this step that could not be checked (a layer of a variant
        the check does not cover, a step replayed from a CUDA graph that does not hold the check);
        counts as a layer call (:attr:`layer_calls`). One in-place device add (masked by the
        sampling flag on the recorded path)."""
        self.layer_calls += 1
        with self.gate.region() as mask:
            self._unchecked(queries, mask)

    def _unchecked(self, queries: int, mask: "torch.Tensor | None") -> None:
        if queries > 0:
            self.cells[_C["unchecked"]] += queries if mask is None else mask * queries

    def check_layer(
        self,
        *,
        layer_id: int,
        q: torch.Tensor,
        out: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        full_to_swa_index_mapping: "torch.Tensor | None",
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        query_rows: "torch.Tensor | None",
        window: int,
        scaling: float,
        num_q_heads: int,
        logit_cap: float = 0.0,
        sinks: "torch.Tensor | None" = None,
        block_size: int = 1,
    ) -> int:
        """Check one layer's output for up to ``max_queries`` requests of the batch; return how
        many queries were checked (a host int, known without a sync).

        Args:
            layer_id: the layer's id, recorded with a disagreement (int >= 0).
            q: the layer's queries, ``[tokens, num_q_heads * head_dim]`` or ``[tokens,
                num_q_heads, head_dim]``, float.
            out: the engine's attention output for them, ``[tokens, num_q_heads * v_head_dim]``
                (or 3-D), float.
            k_buffer, v_buffer: the layer's KV buffers, ``[slots, kv_heads, head_dim]`` and
                ``[slots, kv_heads, v_head_dim]``, indexed by the slot the mapping gives; or paged,
                ``[blocks, block_size, kv_heads, head_dim]`` and ``[blocks, block_size, kv_heads,
                v_head_dim]`` (views of any strides: vLLM's, :mod:`otel_swa.device.paged_write`),
                slot ``s`` at ``[s // block_size, s % block_size]``.
            req_to_token: ``int32``/``int64 [rows, max_context_len]``, FULL slot per position; with
                ``block_size`` > 1 a block table, ``[rows, max_blocks]``: position ``p``'s slot is
                ``req_to_token[row, p // block_size] * block_size + p % block_size`` (vLLM's
                ``block_table``, the layer's KV cache group's).
            full_to_swa_index_mapping: ``int [num_full_slots]``, FULL slot -> slot of these
                buffers; ``None`` for a layer whose buffers are indexed by FULL slot.
            req_pool_indices, seq_lens: ``int [batch]`` on the device: each request's row and
                length (its last token, the one checked, is at ``seq_len - 1``).
            query_rows: ``int [batch]`` on the device: the row of ``q`` / ``out`` holding each
                request's last token (extend batches: ``extend_start_loc + extend_seq_len - 1``);
                ``None``: row ``i`` for request ``i`` (a decode batch).
            window: keys one query reads, its own included (int >= 1; SGLang's
                ``sliding_window_size + 1``).
            scaling: the softmax scale of the scores.
            num_q_heads: query heads of this rank (a multiple of the KV heads).
            logit_cap: tanh soft-capping of the scores when > 0.
            sinks: ``float [num_q_heads]`` attention sink logits, or ``None``.
            block_size: positions per entry of ``req_to_token`` (int >= 1; 1: SGLang's
                ``req_to_token``, a slot per position).

        Unsupported inputs (a KV or output dtype outside float32/64/16/bfloat16, heads that do not
        divide or are not a positive int, a window that is not an int >= 1, ``seq_lens`` or
        ``query_rows`` not one per request, a ``q``/``out`` with fewer rows than the batch's
        requests, sinks that are not one per query head, paged buffers whose block size is not
        ``block_size``) are counted as unchecked, never raised: the engine's forward goes on.
        ``req_to_token`` may have any strides (a column slice of a wider table).
        """
        self.layer_calls += 1
        batch = int(req_pool_indices.shape[0])
        if batch == 0:
            return 0
        recording = self.gate.recording()
        if recording:
            self.recorded_calls += 1
        with self.gate.region() as mask:
            return self._check(mask, recording, batch, layer_id, q, out, k_buffer, v_buffer, req_to_token,
                               full_to_swa_index_mapping, req_pool_indices, seq_lens, query_rows, window,
                               scaling, num_q_heads, logit_cap, sinks, block_size)

    def _check(self, mask, recording, batch, layer_id, q, out, k_buffer, v_buffer, req_to_token,
               full_to_swa_index_mapping, req_pool_indices, seq_lens, query_rows, window, scaling,
               num_q_heads, logit_cap, sinks, block_size) -> int:
        checked = min(self.max_queries, batch)
        paged = type(block_size) is int and block_size > 1  # noqa: E721
        dims = 4 if paged else 3
        shaped = (k_buffer.dim() == dims and v_buffer.dim() == dims
                  and (not paged or (k_buffer.shape[:2] == v_buffer.shape[:2] and k_buffer.shape[1] == block_size)))
        kv_heads = int(k_buffer.shape[-2]) if shaped else 0
        head_dim = int(k_buffer.shape[-1]) if shaped else 0
        v_dim = int(v_buffer.shape[-1]) if shaped else 0
        rows_needed = batch * num_q_heads  # every request has a query row (its last token) at least
        supported = (
            kv_heads > 0 and (block_size == 1 or paged) and type(num_q_heads) is int and num_q_heads > 0 and num_q_heads % kv_heads == 0  # noqa: E721
            and type(window) is int and window >= 1 and req_to_token.dim() == 2  # noqa: E721
            and tuple(seq_lens.shape) == (batch,) and (query_rows is None or tuple(query_rows.shape) == (batch,))
            and all(t.dtype in _CHECKED_DTYPES for t in (q, out, k_buffer, v_buffer))
            and q.numel() % (num_q_heads * head_dim) == 0 and out.numel() % (num_q_heads * v_dim) == 0
            and q.numel() // head_dim >= rows_needed and out.numel() // v_dim >= rows_needed
            and (sinks is None or sinks.numel() == num_q_heads)
        )
        if not supported:
            self._unchecked(checked, mask)
            return 0
        dev = k_buffer.device
        cells = self.cells
        entries = torch.remainder(self._arange[:checked] + self._start, batch)  # [Q], no host data
        rows = req_pool_indices.index_select(0, entries).long().clamp_(0, req_to_token.shape[0] - 1)
        position = seq_lens.index_select(0, entries).long() - 1  # the last token
        qrow = entries if query_rows is None else query_rows.index_select(0, entries).long()
        q3 = q.reshape(-1, num_q_heads, head_dim)
        o3 = out.reshape(-1, num_q_heads, v_dim)
        group = num_q_heads // kv_heads
        width = req_to_token.shape[1]
        mapping = full_to_swa_index_mapping
        bs = block_size if paged else 1
        slots_in_buffer = int(k_buffer.shape[0]) * bs

        def table(keys: torch.Tensor) -> torch.Tensor:
            """The FULL slot (the group's slot, paged) of positions ``keys`` ``[Q, C]`` of ``rows``."""
            if not paged:
                return req_to_token[rows.unsqueeze(1) if keys.dim() == 2 else rows, keys.clamp(0, width - 1)].long()
            keys = keys.clamp(0, width * bs - 1)
            page = req_to_token[rows.unsqueeze(1) if keys.dim() == 2 else rows, torch.div(keys, bs, rounding_mode="floor")]
            return page.long() * bs + torch.remainder(keys, bs)

        def rows_of(buffer: torch.Tensor, slots_c: torch.Tensor) -> torch.Tensor:
            """``buffer``'s rows at ``slots_c`` (clamped), ``[n, kv_heads, dim]``."""
            if not paged:
                return buffer.index_select(0, slots_c)
            return buffer[torch.div(slots_c, bs, rounding_mode="floor"), torch.remainder(slots_c, bs)]
        qq = q3.index_select(0, qrow.clamp(0, q3.shape[0] - 1)).float().view(checked, kv_heads, group, head_dim)
        # the window in chunks that keep the gathered K and V within the budget (one chunk normally)
        chunk = max(1, min(window, self.kv_budget_bytes // (checked * kv_heads * (head_dim + v_dim) * 4)))
        shape = (checked, kv_heads, group)
        offsets = self._offsets(window, dev, self.gate.capturing())

        def gather(begin: int, span: int):
            """Scores ``[Q, Hkv, g, C]`` and values ``[Q, Hkv, C, Dv]`` of keys ``begin ..``."""
            keys = position.unsqueeze(1) + offsets[:, begin:begin + span]  # [Q, C]
            full = table(keys)  # any strides
            slots = full if mapping is None else mapping.index_select(
                0, full.clamp(0, mapping.shape[0] - 1).reshape(-1)).long().view(checked, span)
            slots_c = slots.clamp(0, slots_in_buffer - 1).reshape(-1)
            k = rows_of(k_buffer, slots_c).float().view(checked, span, kv_heads, head_dim).transpose(1, 2)
            v = rows_of(v_buffer, slots_c).float().view(checked, span, kv_heads, v_dim).transpose(1, 2)
            scores = torch.matmul(qq, k.transpose(2, 3)).mul_(float(scaling))
            if logit_cap and logit_cap > 0:
                scores = torch.tanh(scores.div_(float(logit_cap))).mul_(float(logit_cap))
            # positions before the request's first token: -inf (a bias, added: cheaper than masked_fill)
            scores.add_(torch.where(keys.ge(0), 0.0, float("-inf")).view(checked, 1, 1, span))
            return scores, v

        sink = None if sinks is None else sinks.float().reshape(1, kv_heads, group, 1).expand(shape + (1,))
        if chunk >= window:  # one gather: a plain softmax, the sink as one more logit
            scores, v = gather(0, window)
            if sink is not None:
                scores = torch.cat([scores, sink], dim=-1)
            w = torch.softmax(scores, dim=-1)
            if sink is not None:
                w = w[..., :window]
            ours = torch.matmul(w, v)  # [Q, Hkv, g, Dv]
            spread = torch.linalg.vector_norm(w, dim=-1)  # the attention weights' 2-norm, [Q, Hkv, g]
            vmax = v.abs().amax(dim=(2, 3))
        else:  # an online softmax over the chunks: running max, sum of weights and of their squares
            top = torch.full(shape, float("-inf"), device=dev)
            weight = torch.zeros(shape, device=dev)
            squares = torch.zeros(shape, device=dev)
            acc = torch.zeros(shape + (v_dim,), device=dev)
            vmax = torch.zeros((checked, kv_heads), device=dev)
            for begin in range(0, window, chunk):
                scores, v = gather(begin, min(chunk, window - begin))
                new_top = torch.maximum(top, scores.amax(-1))
                base = torch.where(torch.isinf(new_top), 0.0, new_top)  # every key so far masked: nothing yet
                decay = torch.exp(top - base)
                p = torch.exp(scores - base.unsqueeze(-1))
                weight = weight * decay + p.sum(-1)
                squares = squares * decay.square() + p.square().sum(-1)
                acc = acc * decay.unsqueeze(-1) + torch.matmul(p, v)
                vmax = torch.maximum(vmax, v.abs().amax(dim=(2, 3)))
                top = new_top
            if sink is not None:  # an extra logit per head in the denominator, with no value
                sink = sink[..., 0]
                new_top = torch.maximum(top, sink)
                decay = torch.exp(top - new_top)
                weight = weight * decay + torch.exp(sink - new_top)
                squares = squares * decay.square()
                acc = acc * decay.unsqueeze(-1)
            ours = acc / weight.unsqueeze(-1)  # [Q, Hkv, g, Dv]
            spread = squares.sqrt() / weight  # the attention weights' 2-norm, [Q, Hkv, g]
        theirs = o3.index_select(0, qrow.clamp(0, o3.shape[0] - 1)).float().view(shape + (v_dim,))
        # what a kernel's rounding can move the output by (the tolerance, module docstring)
        bound = (vmax.unsqueeze(-1) * spread).unsqueeze(-1) + ours.abs()
        bound.mul_(4.0 * rounding(q.dtype, out.dtype, k_buffer.dtype, v_buffer.dtype)).add_(1e-30)
        agree = (ours - theirs).abs_().le(bound).view(checked, -1).all(-1)  # NaN compares False
        disagree = agree.logical_not_().logical_and_(position.ge(0))  # a request without tokens has no query
        count = disagree.sum()
        if dev.type == "cpu" and not recording and not int(count):  # a host read costs no sync on the CPU
            cells[_C["checked"]] += checked
            return checked
        first = torch.max(disagree, 0).indices.reshape(1)  # the first disagreeing query (0 when none)
        own = table(position)  # the query's own FULL slot (the group's slot, paged)
        own_slot = own if mapping is None else mapping.index_select(0, own.clamp(0, mapping.shape[0] - 1)).long()
        where = torch.stack([entries, rows, position, own, own_slot,
                             entries.new_full((checked,), int(layer_id))]).index_select(1, first).reshape(-1)
        commit_counts(cells, disagree.new_full((), checked, dtype=torch.int64), count, where, mask)
        return checked

    # ------------------------------------------------------------------ the reporter's side
    def take(self, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """This step's cells, copied into ``out`` (``int64 [READ_WIDTH]`` on the device; default a
        new tensor), then cleared for the next sampled step, and the rotation advanced. Device
        work in stream order; no sync."""
        if out is None:
            out = torch.empty_like(self.cells)
        out.copy_(self.cells)
        self.cells.zero_()
        self._turn += 1
        self._start += self.max_queries
        self.layer_calls = 0
        return out

    def reset(self) -> None:
        """Forget this step's results (a forward that raised; a forked child)."""
        self.cells.zero_()
        self.layer_calls = 0
