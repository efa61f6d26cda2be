"""Provenance of a hybrid KV cache: is the KV in every slot the tables name the KV of the token they name it for?

torch only (numpy on the host side of a sample). Two device tables per pool (FULL, and SWA when the
engine has one) on the KV cache's device, 24 bytes per slot together:

* **stamps** (:mod:`otel_swa.device.stamps`, ``int64 [num_slots]``): the token id, the position and a
  20-bit chain over the request's prefix of the token whose KV was last written to the slot; 0:
  never stamped;
* **checksums** (:mod:`otel_swa.device.kv_folds`, ``int64 [num_slots, 2]``): two folds over the
  pool's attention layers of a hash of every byte of the K and V rows written for that token in
  each layer (:mod:`otel_swa.device.checksum`), taken from the tensors each layer was given to
  store; a change in one layer names that layer; 0: never written. ``checksum="prefix"`` folds
  only the first ``checksum_bytes`` of each row of one designated layer per pool (the first such
  layer called, as SGLang's KV canary hashes layer 0 of each sub-pool): cheaper, blind to every
  other layer and byte.

Both are written at every forward step with fixed shapes and no host read (so a CUDA graph capture
records them), and verified at sampled steps (:meth:`KvProvenance.stage`, called by the reporter with
the sample) for the live tokens the batch reads, against:

* the stamps expected from each request's own token ids (the view's ``token_ids``): a mismatch is a
  **foreign token** (the slot holds another token's KV: swapped ownership, a stale prefix or radix
  re-use, a slot overwritten by another request, a wrong position written), and so is a slot never
  stamped (no forward step wrote any token there: a write that went to another slot, a prefix that
  names slots nothing wrote), unless provenance was switched on over a KV cache that already held
  KV (``never_stamped="unchecked"``);
* the hash of the bytes the pool holds now at the slot: a mismatch is a **corrupt token** (bytes
  changed after the write: a stray kernel, a bad load-back, a flipped bit, or a write of this layer
  at another index, which leaves the named slot's old bytes there).

The write check (:mod:`otel_swa.device.write_check`) runs from the same per-layer call.

API for an engine's instrumentation (shapes and dtypes on the calls' docstrings)::

    provenance = reporter.enable_provenance(full_slots=..., swa_slots=...)   # once
    # ModelRunner.forward (before the original):
    reporter.before_forward()                  # the sampling flag: one tiny device write at most
    # in the forward, where a CUDA graph capture records it (e.g. before the first attention layer):
    provenance.stamp(input_ids=..., positions=..., out_cache_loc=..., req_pool_indices=...,
                     req_to_token=..., full_to_swa_index_mapping=..., extend_start_loc=None)
    # each attention layer, after its forward (which wrote the step's K/V):
    provenance.after_layer(layer_id=..., swa=..., k=..., v=..., k_buffer=..., v_buffer=...,
                           out_cache_loc=..., full_to_swa_index_mapping=..., positions=...)
    # after the forward, as before:
    reporter.step(view)                        # view.token_ids: each request's token ids

What the view gives the verification (:mod:`otel_swa.views.base`): ``seq_lens_cpu`` (without host
lengths nothing is verified: the fields stay absent), ``token_ids`` (one host sequence per batch
entry holding the request's token ids at positions ``0 .. seq_len - 1`` at least; ``len()`` and
slicing ``ids[a:b]`` are all that is used, so SGLang's ``origin_input_ids`` and ``output_ids`` can be
joined lazily, :class:`otel_swa.views.base.JoinedTokenIds`; a missing entry makes that request's
slots unchecked, a short one the positions past its ids: SGLang's overlap scheduler runs a decode
step before the host has the token it feeds), ``request_ids`` (keys of the host's chain cache below; without them every
sample computes each request's chain from position 0), and for the SWA pool the window fields
(``sliding_window``, ``extend_lens_cpu``, ``swa_eviction_allowance``): the SWA slots verified are the
positions the step reads, ``seq_len - (window + extend_len - 1) - allowance`` onwards, those whose
mapping is 0 skipped (out of the window); without a window every position, the zeros skipped.

Bounded work. A sample verifies at most ``budget`` (default 4096) live slots per pool: the batch's
candidates in a fixed order (request by request, position by position) are taken ``budget`` at a
time from where the previous sample stopped, and the rest counted unchecked. While the batch and its
lengths stay as they are, every live slot of a pool with ``N`` candidates is verified once every
``ceil(N / budget)`` samples (a fault stays unseen at most that many samples; as requests grow the
order shifts by the growth of the requests before a slot, which delays it by at most that many
positions). Host work per sample: the expected stamps of the taken positions (numpy), from a cache
of each request's chain every 1,024 positions (8 bytes per 1,024 tokens of a request), so each
token id is converted once over the request's life plus up to 1,024 per range re-read; the upload:
``3 x 8`` bytes per taken slot (batch entry, position, expected stamp), 192 KiB at the default budget
with both pools full, through the reporter's pinned ring. Device work per pool and sample: about 40
operations over the taken slots (the gathers of ``req_to_token``, the mapping, the stamps and the
folds, the comparisons and the first offenders) and the recomputed folds: two gathers per layer (its
K and V rows) and about 10 operations over ``[slots, layers, words]`` for all the pool's layers at
once (``benchmarks/bench_provenance.py`` table 2 measures it).

The sweep. KV that no running request reads (a prefix cache's) is not in any batch: a byte changed
there is read, wrongly, only by a later prefix hit. A view that names such slots
(``kv_sweep_full_slots``: SGLang's radix cache) has their checksums verified too, in both pools, at
most ``budget`` FULL slots per sample from a list read at the start of each pass (what SGLang's KV
canary does with its sweep of the radix cache, ``--kv-canary-sweep-interval``). The sweep compares no
stamps (the cache's token ids are not given) and names a corrupt slot by its FULL and SWA slot only.

Slots the engine fills without a forward step (SGLang's HiCache load-back, a disaggregated
prefill's transfer) keep the stamps of what was there before unless the engine moves the provenance
with the KV: :meth:`KvProvenance.move_slots`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from otel_swa.device.checksum import CHECKSUM_MODES
from otel_swa.device.gate import SamplingGate
from otel_swa.device.kernel_select import write_kernels
from otel_swa.device.kv_folds import PoolFolds
from otel_swa.device.live_tokens import host_lengths
from otel_swa.device.provenance_reading import (
    _C,
    _PER_POOL,
    NEVER_STAMPED,
    PROVENANCE_CELLS,
    PROVENANCE_POOLS,
    PROVENANCE_WIDTH,
    ProvenanceMeta,
    ProvenanceReading,
    take_ranges,
)
from otel_swa.device.stamps import (
    ChainCache,
    TOKEN_POSITION_MASK,
    write_stamps,
)
from otel_swa.device.step_folds import StepFolds
from otel_swa.device.window import host_allowance, host_reach
from otel_swa.device.write_check import WRITE_CHECK_MODES, LayerStore, WriteCheck

__all__ = [
    "PROVENANCE_POOLS",
    "PROVENANCE_CELLS",
    "PROVENANCE_WIDTH",
    "NEVER_STAMPED",
    "KvProvenance",
    "ProvenanceMeta",
    "ProvenanceReading",
    "ChainCache",
]

class KvProvenance:
    """Stamps and checksums of a hybrid KV cache, and the write check (module docstring).

    Args:
        device: the KV cache's device.
        gate: the reporter's :class:`~otel_swa.device.gate.SamplingGate`.
        full_slots: slots of the FULL pool (the first dimension of its K/V buffers), int >= 1.
        swa_slots: slots of the SWA pool, or ``None`` for an engine without one.
        checksum: :data:`~otel_swa.device.checksum.CHECKSUM_MODES`: ``"all"`` (default: every byte
            of every layer that calls :meth:`after_layer`, folded per slot,
            :mod:`otel_swa.device.kv_folds`), ``"prefix"`` (the first ``checksum_bytes`` of each row
            of one designated layer per pool), ``"off"``.
        checksum_bytes: bytes hashed at the start of each K and V row with ``checksum="prefix"``.
        checksum_layers: with ``checksum="prefix"``, ``{"full": layer_id, "swa": layer_id}``, the
            designated layer of each pool; a pool not named takes the first layer of its kind that
            calls :meth:`after_layer`.
        checksum_order: with ``checksum="all"``, ``{"full": (layer_id, ...), "swa": (...)}``: each
            pool's attention layers in the order a forward step calls them (each once per step that
            writes K/V); the layers of both pools then fill one step buffer that the step's last
            layer hashes and folds into both pools (:class:`~otel_swa.device.step_folds.StepFolds`:
            1 device operation per layer and 10 per step, instead of 9 per layer). A pool not named
            folds each layer alone.
        budget: live slots verified per pool and sample (int >= 1).
        write_check: whether :meth:`after_layer` runs the write check at sampled steps.
        write_check_tokens, write_check_layers: the write check's ``max_tokens`` and ``layers``.
        never_stamped: what a live slot the tables name whose stamp is 0 is (no forward step wrote
            a token there since provenance was switched on): ``"foreign"`` (default: the KV read
            there is not the token's; a write to the wrong slot left it unwritten, a prefix names
            slots nothing wrote) or ``"unchecked"`` (for provenance switched on while the KV cache
            already held KV: an engine wired after its first forward steps).

    Raises:
        ValueError: a bad argument (named, with the value).
    """

    def __init__(
        self,
        device: "torch.device | str",
        gate: SamplingGate,
        *,
        full_slots: int,
        swa_slots: "int | None" = None,
        checksum: str = CHECKSUM_MODES[0],
        checksum_bytes: int = 64,
        checksum_layers: "dict[str, int] | None" = None,
        checksum_order: "dict[str, Sequence[int]] | None" = None,
        budget: int = 4096,
        write_check: bool = True,
        write_check_tokens: int = 8,
        write_check_layers: str = WRITE_CHECK_MODES[0],
        never_stamped: str = NEVER_STAMPED[0],
    ) -> None:
        for name, value in (("full_slots", full_slots), ("budget", budget), ("checksum_bytes", checksum_bytes)):
            if type(value) is not int or value < 1:  # noqa: E721
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if swa_slots is not None and (type(swa_slots) is not int or swa_slots < 1):  # noqa: E721
            raise ValueError(f"swa_slots must be None or an int >= 1, got {swa_slots!r}")
        if checksum not in CHECKSUM_MODES:
            raise ValueError(f"checksum must be one of {', '.join(CHECKSUM_MODES)}, got {checksum!r}")
        if never_stamped not in NEVER_STAMPED:
            raise ValueError(f"never_stamped must be one of {', '.join(NEVER_STAMPED)}, got {never_stamped!r}")
        layers = dict(checksum_layers or {})
        if set(layers) - set(PROVENANCE_POOLS) or not all(type(v) is int for v in layers.values()):  # noqa: E721
            raise ValueError(f"checksum_layers must map 'full' / 'swa' to layer ids, got {checksum_layers!r}")
        self.device = torch.device(device)
        self.gate = gate
        self.budget = budget
        self.checksum = checksum
        self.never_stamped = never_stamped
        self._prefix = checksum_bytes if checksum == "prefix" else None

        def table(slots: "int | None") -> "torch.Tensor | None":
            return None if slots is None else torch.zeros(slots, dtype=torch.int64, device=self.device)

        #: ``int64 [slots]`` per pool (index 0 FULL, 1 SWA; ``None`` without that pool).
        self.stamps = (table(full_slots), table(swa_slots))
        #: the folds of the layer hashes per pool (:class:`~otel_swa.device.kv_folds.PoolFolds`), or
        #: ``None`` (checksums off, no such pool).
        order = dict(checksum_order or {}) if checksum == "all" else {}
        if set(order) - set(PROVENANCE_POOLS):
            raise ValueError(f"checksum_order must map 'full' / 'swa' to layer ids, got {checksum_order!r}")
        self.folds = tuple(
            None if checksum == "off" or slots is None
            else PoolFolds(slots, self.device, self._prefix,
                           tuple(order[name]) if order.get(name) else None)
            for name, slots in zip(PROVENANCE_POOLS, (full_slots, swa_slots)))
        # the ordered layers of both pools share one step buffer, hashed once per step
        orders = [tuple(order.get(name) or ()) if self.folds[p] is not None else ()
                  for p, name in enumerate(PROVENANCE_POOLS)]
        # (a layer id named in both pools' orders: each pool folds alone, as without an order)
        named = [layer_id for order in orders for layer_id in order]
        self._step_folds = StepFolds(self.folds, orders) if named and len(set(named)) == len(named) else None
        self.write_check = (WriteCheck(self.device, gate, max_tokens=write_check_tokens, layers=write_check_layers)
                            if write_check else None)
        self._designated: "list[int | None]" = [layers.get("full"), layers.get("swa")]
        self._written: "tuple | None" = None  # (out_cache_loc, FULL slots, SWA slots) of the last stamp call
        self._cursor = [0, 0]
        self.chains = ChainCache()
        #: the host tier whose tables follow these slots (:class:`~otel_swa.device.host_tier.HostTier`
        #: sets itself here), or ``None``
        self.host_tier: Any = None
        self._sweep: "torch.Tensor | None" = None  # the FULL slots of the sweep pass under way
        self._sweep_at = 0
        #: the Triton kernels of provenance (:mod:`otel_swa.device.kernel_select`: a CUDA cache), or
        #: ``None``: the torch path
        self.kernels = write_kernels(self.device)
        # constants of the verification, made once: the compared bits of a stamp with an unknown
        # chain and of one with a known chain, and zeros for the cells a pool leaves at 0
        self._compare = (torch.tensor(TOKEN_POSITION_MASK, device=self.device), torch.tensor(-1, device=self.device))
        self._zeros = torch.zeros(8, dtype=torch.int64, device=self.device)

    @property
    def bytes_per_slot(self) -> "tuple[int, int]":
        """Device bytes the tables take per slot of the FULL and of the SWA pool (0 without it)."""
        return tuple(8 + 16 * (self.folds[p] is not None) if self.stamps[p] is not None else 0 for p in (0, 1))

    # ------------------------------------------------------------------ engine-facing: every forward
    def stamp(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        full_to_swa_index_mapping: "torch.Tensor | None" = None,
        extend_start_loc: "torch.Tensor | None" = None,
    ) -> None:
        """Stamp the slots this forward step writes (:func:`otel_swa.device.stamps.write_stamps`),
        in the FULL pool at ``out_cache_loc`` and in the SWA pool at its mapping. Call once per
        forward step, anywhere before the sample; fixed shapes, no host read: inside a captured
        forward it is recorded and every replay stamps its tokens. 31 device operations on ``[T]``
        for a decode step in both pools (8 more for an extend batch); with checksums, the reset of
        the written slots' folds (1 per pool), which the layers' calls that follow add to.

        Args:
            input_ids: ``int [T]``, the step's input token ids, on the device.
            positions: ``int [T]``, their positions.
            out_cache_loc: ``int [T]``, the FULL slot each is written to (0: padding).
            req_pool_indices: ``int [B]``, the requests' ``req_to_token`` rows.
            req_to_token: ``int32``/``int64 [rows, max_context_len]``.
            full_to_swa_index_mapping: ``int64 [num_full_slots]``, or ``None`` without an SWA pool.
            extend_start_loc: ``int [B]``: each request's first token in the step (extend and mixed
                batches), or ``None`` when ``T == B`` and token ``i`` is request ``i``'s (decode).
        """
        full, swa = self.stamps
        if self.kernels is not None:
            self.kernels.stamp_and_reset(full, input_ids, positions, out_cache_loc, req_pool_indices, req_to_token,
                                         extend_start_loc, swa, full_to_swa_index_mapping,
                                         *(f.table if f is not None else None for f in self.folds))
            return
        full_folds, swa_folds = self.folds
        extra = ()
        swa_slots = clamped = None
        mapped = swa is not None and full_to_swa_index_mapping is not None
        if full_folds is not None or mapped:
            clamped = out_cache_loc.long().clamp(0, full.shape[0] - 1)
        if mapped:
            # the FULL pool's clamp serves the mapping (SGLang's holds one more entry) when it is no
            # longer: a slot past the FULL pool makes the stamps' write (unclamped) raise anyway
            loc = (clamped if full_to_swa_index_mapping.shape[0] >= full.shape[0]
                   else out_cache_loc.long().clamp(0, full_to_swa_index_mapping.shape[0] - 1))
            swa_slots = full_to_swa_index_mapping.index_select(0, loc).clamp_(0, swa.shape[0] - 1)
            extra = ((swa, swa_slots),)
        write_stamps(full, input_ids, positions, out_cache_loc, req_pool_indices, req_to_token, extend_start_loc, extra)
        if full_folds is None:
            return
        if self._step_folds is not None:
            self._step_folds.start()
        full_slots = clamped
        full_folds.reset(full_slots)
        if swa_folds is not None and swa_slots is not None:
            swa_folds.reset(swa_slots)
        self._written = (out_cache_loc, full_slots, swa_slots, full_to_swa_index_mapping)

    def wants_layer(self, layer_id: int, swa: bool) -> bool:
        """Whether :meth:`after_layer` would do anything for layer ``layer_id`` (whose buffers are
        the SWA pool's when ``swa``) now: it is its pool's checksum layer (or none is designated yet),
        or the write check runs on it this step. Host work only, no device operation; an engine calls
        it first so that the other layers of a step that is not sampled cost it nothing (not even
        reading their buffers)."""
        check = self.write_check
        if check is not None and self.gate.wanted() and check.wants(layer_id, swa):
            return True
        pool = 1 if swa else 0
        return self.folds[pool] is not None and (self._prefix is None or self._designated[pool] in (None, layer_id))

    def after_layer(self, **store: Any) -> None:
        """One attention layer's part, after its forward stored this step's K/V; keyword arguments:
        the fields of :class:`~otel_swa.device.write_check.LayerStore` (``layer_id``, ``swa``, ``k``,
        ``v``, ``k_buffer``, ``v_buffer``, ``out_cache_loc``, and optionally
        ``full_to_swa_index_mapping``, ``positions``, ``extend_start_loc``; their shapes and dtypes
        there). The layer's hash folded into its pool's folds at the slots the step writes (every
        step; with ``checksum="prefix"`` only its pool's designated layer), the write check when the
        step is sampled or recorded
        (:meth:`~otel_swa.device.write_check.WriteCheck.check_layer`). Never raises for inputs it
        cannot use (they are counted unchecked at the sample); a missing or unknown keyword is a
        ``TypeError``, at every call."""
        layer = LayerStore(**store)
        pool = 1 if layer.swa else 0
        if self.folds[pool] is not None:
            if self._prefix is None:
                self._write_checksums(pool, layer)
            else:
                if self._designated[pool] is None:
                    self._designated[pool] = layer.layer_id
                if self._designated[pool] == layer.layer_id:
                    self._write_checksums(pool, layer)
        check = self.write_check
        if check is not None and self.gate.wanted() and check.wants(layer.layer_id, layer.swa):
            check.check_layer(layer)

    def _write_checksums(self, pool: int, layer: LayerStore) -> None:
        """Fold ``layer``'s hash into its pool's folds at the slots the step writes: 9 device
        operations (the slots are the stamp call's when it was given the same ``out_cache_loc``)."""
        folds = self.folds[pool]
        entry = folds.layer(layer.layer_id, layer.k_buffer, layer.v_buffer)
        k, v, loc, mapping = layer.k, layer.v, layer.out_cache_loc, layer.full_to_swa_index_mapping
        tokens = int(loc.shape[0])
        own = layer.block_size is not None  # a paged store: out_cache_loc holds the pool's own slots
        if (entry is None or k is None or v is None or tokens == 0 or not entry.hasher.given_shape_ok(k, v, tokens)
                or (pool == 1 and mapping is None and not own)):
            return  # nothing hashed: the pool's slots are counted unchecked (or their folds differ: a fault)
        if self.kernels is not None:
            self.kernels.fold_layer(folds.table, entry.hasher, k, v, entry.layer_id, loc, mapping if pool else None)
            return
        written = self._written
        if written is not None and written[0] is loc and (pool == 0 or written[3] is mapping):
            slots = written[1 + pool]
        else:
            slots = loc.long()
            if pool == 1 and not own:
                slots = mapping.index_select(0, slots.clamp(0, mapping.shape[0] - 1))
            slots = slots.clamp(0, folds.table.shape[0] - 1)
        step = self._step_folds
        if step is not None and step.takes(layer.layer_id) and step.pool_of[layer.layer_id] == pool:
            step.add(pool, entry, k, v, slots, self.gate.capturing())
        else:
            folds.add(entry, k, v, slots, self.gate.capturing())

    def move_slots(self, pool: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Carry the stamps and checksums of slots ``src`` to ``dst`` (``int [n]`` each) in ``pool``
        (``"full"``/``"swa"``): call where the engine copies KV between slots without a forward step
        (a load-back from host memory, a transfer), so the moved KV keeps its provenance."""
        p = PROVENANCE_POOLS.index(pool)
        if self.stamps[p] is not None:
            self.stamps[p].index_copy_(0, dst.long(), self.stamps[p].index_select(0, src.long()))
        if self.folds[p] is not None:
            self.folds[p].move(src.long(), dst.long())

    def reset(self) -> None:
        """Forget every stamp and checksum (the engine emptied its cache)."""
        for table in self.stamps + tuple(f.table for f in self.folds if f is not None):
            if table is not None:
                table.zero_()

    # ------------------------------------------------------------------ the sample (reporter)
    def stage(self, out: torch.Tensor, view: Any, upload: "Callable[[np.ndarray], torch.Tensor] | None" = None
              ) -> "ProvenanceMeta | None":
        """Verify the live slots of ``view``'s batch (module docstring) into ``out`` (``int64
        [PROVENANCE_WIDTH]`` on the device), in stream order; ``None`` (nothing staged) when the view
        has no ``seq_lens_cpu``. ``upload``: how the host's ``int64`` array reaches the device
        (default ``torch.from_numpy(...).to(device)``)."""
        lens_host = getattr(view, "seq_lens_cpu", None)
        if lens_host is None:
            return None
        lens = np.minimum(np.maximum(host_lengths(lens_host), 0), view.req_to_token.shape[1])
        batch = len(lens)
        mapping = view.full_to_swa_index_mapping
        pools = [0]
        if self.stamps[1] is not None and getattr(view, "divergence_applicable", True) is not False:
            pools.append(1)
        token_ids = getattr(view, "token_ids", None)
        request_ids = getattr(view, "request_ids", None)
        window = getattr(view, "sliding_window", None)
        low = np.zeros(batch, dtype=np.int64)
        swa_low = low
        if window is not None and 1 in pools:
            reach = host_reach(window, getattr(view, "extend_lens_cpu", None), batch)
            allowance = getattr(view, "swa_eviction_allowance", None)
            allowance = host_allowance(allowance, batch) if allowance is not None else 0
            swa_low = np.maximum(lens - reach - allowance, 0)
        taken: "list[tuple | None]" = [None, None]
        over = [0, 0]
        pieces_of = []
        for p in pools:
            pieces, over[p], self._cursor[p] = take_ranges(swa_low if p == 1 else low, lens, self.budget,
                                                           self._cursor[p])
            pieces_of.append(pieces)
        parts = []
        for p, arrays in zip(pools, self._expected(pieces_of, token_ids, request_ids)):
            taken[p] = arrays
            parts.append(np.stack(arrays))
        self.chains.end_sample()
        host = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)
        up = upload(host) if upload is not None else torch.from_numpy(host).to(out.device)
        out.zero_()
        offset = 0
        for p in pools:
            n = len(taken[p][0])
            if n:
                self._verify(out[p * _PER_POOL:(p + 1) * _PER_POOL], up[:, offset:offset + n], p, view, mapping)
            offset += n
        swept = self._next_sweep(getattr(view, "kv_sweep_full_slots", None))
        if swept is not None:
            for p in pools:
                self._verify_swept(out[p * _PER_POOL:(p + 1) * _PER_POOL], swept, p, mapping)
        tier = self.host_tier
        return ProvenanceMeta(tuple(taken), tuple(over), self.checksum != "off",
                              tuple(f.layer_ids if f is not None else frozenset() for f in self.folds),
                              tier.host_slot_of if tier is not None else None)

    def _next_sweep(self, source: Any) -> "torch.Tensor | None":
        """The FULL slots this sample sweeps (``int64 [<= budget]`` on the device): the next part of
        the pass under way, or of a new pass over what ``source`` (a view's ``kv_sweep_full_slots``:
        a tensor, or a zero-argument callable returning one or ``None``) gives now; ``None`` when
        there is nothing to sweep. A slot listed at a pass's start and written again since keeps a
        matching checksum (the write hashed it anew), so the list may be read over several samples."""
        if source is None or self.folds[0] is None:
            return None
        if self._sweep is None or self._sweep_at >= int(self._sweep.shape[0]):
            slots = source() if callable(source) else source
            if slots is None:
                self._sweep = None
                return None
            slots = slots.reshape(-1).to(self.device, torch.int64)
            self._sweep = torch.unique(slots[slots.gt(0)])
            self._sweep_at = 0
        part = self._sweep[self._sweep_at:self._sweep_at + self.budget]
        self._sweep_at += self.budget
        return part if part.numel() else None

    def _verify_swept(self, out: torch.Tensor, full: torch.Tensor, pool: int, mapping: "torch.Tensor | None") -> None:
        """The folds of the swept FULL slots ``full`` (their SWA slots for the SWA pool, those
        mapped) against the bytes the pool holds, into ``out``'s sweep cells."""
        folds = self.folds[pool]
        if folds is None:
            return
        size = folds.table.shape[0]
        if pool == 1:
            if mapping is None:
                return
            swa = mapping.index_select(0, full.clamp(0, mapping.shape[0] - 1)).long()
            if swa.device.type == "cpu":
                # only the mapped ones: most of a prefix cache's SWA slots are out of the window
                # (mapping 0), their hashes never compared; on the CPU the compaction reads no
                # device (a GPU keeps the fixed shape: no host sync)
                mapped = swa.gt(0).nonzero().reshape(-1)
                if mapped.numel() == 0:
                    return  # no swept slot in the SWA pool: its sweep cells stay 0
                full, swa = full.index_select(0, mapped), swa.index_select(0, mapped)
            slot = swa.clamp(0, size - 1)
            checked = swa.gt(0)
        else:
            swa = torch.full_like(full, -1)
            slot = full.clamp(0, size - 1)
            checked = full.lt(size)
        verified = self._verify_folds(folds, slot)
        if verified is None:
            return
        written, delta = verified
        checked.logical_and_(written)
        corrupt = delta.ne(0).any(dim=1).logical_and_(checked)
        first = torch.max(corrupt, 0).indices.reshape(1)
        at = torch.cat([torch.stack([full, swa]), delta.t()]).index_select(1, first).reshape(-1)
        base = _C["sweep_checks"]
        out[base:base + 4].copy_(torch.stack([checked.sum(), corrupt.sum(), at[0], at[1]]))
        out[_C["sweep_d1"]:_C["sweep_d1"] + 2].copy_(at[2:])

    def _verify_folds(self, folds: PoolFolds, slots: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor] | None":
        """``folds.verify(slots)``, by the Triton kernel where one is chosen and applies."""
        verified = self.kernels.verify_folds(folds, slots) if self.kernels is not None else None
        return verified if verified is not None else folds.verify(slots)

    def _expected(self, pieces_of, token_ids, request_ids) -> "list[tuple[np.ndarray, np.ndarray, np.ndarray]]":
        """Per pool, ``(entries, positions, expected)`` of its pieces ``(entry, lo, hi)``: each
        request's expected stamps computed once over the union of its pieces in both pools (one
        numpy pass for the batch), 0 where its token ids are not known."""
        union: dict[int, list[int]] = {}
        for pieces in pieces_of:
            for i, lo, hi in pieces:
                span = union.setdefault(i, [lo, hi])
                span[0], span[1] = min(span[0], lo), max(span[1], hi)
        known = []
        if token_ids is not None:
            for i, (lo, hi) in union.items():
                ids = token_ids[i]
                end = min(hi, len(ids)) if ids is not None else lo  # positions past the ids: unchecked
                if end > lo:
                    known.append((request_ids[i] if request_ids is not None else None, ids, lo, end, i))
        values = dict(zip((r[4] for r in known), self.chains.expected_many([r[:4] for r in known])))
        out = []
        for pieces in pieces_of:
            sizes = np.fromiter((hi - lo for _, lo, hi in pieces), dtype=np.int64, count=len(pieces))
            entries = np.repeat(np.fromiter((i for i, _, _ in pieces), dtype=np.int64, count=len(pieces)), sizes)
            starts = np.cumsum(sizes) - sizes
            lows = np.fromiter((lo for _, lo, _ in pieces), dtype=np.int64, count=len(pieces))
            positions = np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(lows - starts, sizes)
            expected = np.zeros(len(positions), dtype=np.int64)
            for (i, lo, hi), start in zip(pieces, starts.tolist()):
                stamps = values.get(i)
                if stamps is not None:
                    first = union[i][0]
                    part = stamps[lo - first:hi - first]  # shorter where the ids end before hi
                    expected[start:start + len(part)] = part
            out.append((entries, positions, expected))
        return out

    def _swa_slots(self, view: Any, mapping: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                   full: torch.Tensor) -> torch.Tensor:
        """The SWA slot of each taken position (``int64 [n]``, 0: none, out of the window), from
        ``mapping`` (``full_to_swa_index_mapping``) at its FULL slot ``full``; ``rows`` and
        ``positions`` (``int64 [n]``) are for a pool that keeps its own table
        (:class:`otel_swa.device.paged_provenance.PagedProvenance`)."""
        return mapping.index_select(0, full.clamp(0, mapping.shape[0] - 1)).long()

    def _verify(self, out: torch.Tensor, up: torch.Tensor, pool: int, view: Any, mapping: torch.Tensor) -> None:
        """One pool's verification of the taken slots ``up`` (``int64 [3, n]``: entry, position,
        expected) into ``out`` (:data:`PROVENANCE_CELLS`)."""
        if self.kernels is not None and self.kernels.stage_pool(self, out, up, pool, view, mapping):
            return
        entries, positions, expected = up[0], up[1], up[2]
        req_to_token = view.req_to_token
        rows = view.req_pool_indices.index_select(0, entries).long().clamp_(0, req_to_token.shape[0] - 1)
        full = req_to_token[rows, positions.clamp(0, req_to_token.shape[1] - 1)].long()
        swa_slot = self._swa_slots(view, mapping, rows, positions, full)
        stamps = self.stamps[pool]
        if pool == 1:
            live = swa_slot.ne(0)
            slot = swa_slot.clamp(0, stamps.shape[0] - 1)
        else:
            live = None
            slot = full.clamp(0, stamps.shape[0] - 1)
        found = stamps.index_select(0, slot)
        judged = expected.ne(0)  # a known token: its stamp is what the request's own ids give
        if self.never_stamped != "foreign":
            judged.logical_and_(found.ne(0))
        if live is not None:
            judged.logical_and_(live)
        compare = torch.where((found >> 62).eq(-1), *self._compare)
        foreign = (found ^ expected).bitwise_and_(compare).ne_(0).logical_and_(judged)
        swa_named = swa_slot if self.stamps[1] is not None else torch.full_like(full, -1)
        folds = self.folds[pool]
        verified = self._verify_folds(folds, slot) if folds is not None else None
        # every count in one reduction over the stacked masks, both first offenders in one, the
        # offenders' cells in one gather of the stacked columns, all cells in one copy
        masks = [judged, foreign]
        columns = [rows, found, full, swa_named]
        if verified is not None:
            checked, delta = verified
            if live is not None:
                checked.logical_and_(live)
            corrupt = delta.ne(0).any(dim=1).logical_and_(checked)
            masks += [checked, corrupt]
            columns.append(delta.t())
        if live is not None:
            masks.append(live)
        masks = torch.stack(masks)  # [2 | 3 | 4 | 5, n]: judged, foreign, (checked, corrupt), (live)
        sums = masks.sum(dim=1)
        firsts = torch.max(masks[1:4:2] if verified is not None else masks[1:2], 1).indices  # foreign, (corrupt)
        picked = torch.cat([c.reshape(-1, c.shape[-1]) for c in columns]).index_select(1, firsts)  # [4 | 6, 1 | 2]
        zeros = self._zeros
        cells = [sums[-1:] if live is not None else zeros[:1], sums[0:2], firsts[0:1], picked[0:4, 0]]
        if verified is not None:  # ... checked, corrupt, its index, row, FULL and SWA slot; the sweep's; d1, d2
            cells += [sums[2:4], firsts[1:2], picked[0:1, 1], picked[2:4, 1], zeros[:4], picked[4:6, 1]]
        else:  # no checksum to compare: every live slot unchecked
            cells.append(zeros[:6])
        width = sum(int(c.shape[0]) for c in cells)
        torch.cat(cells, out=out[:width])
