"""The host side of a provenance verification (:meth:`otel_swa.device.provenance.KvProvenance.stage`):
the cells it stages per pool, what the host knew when it staged them (:class:`ProvenanceMeta`) and how
they read (:class:`ProvenanceReading`: counts and first offenders).

numpy on the host; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from otel_swa.checks.provenance import _PER_POOL, PROVENANCE_CELLS, PROVENANCE_POOLS, PROVENANCE_WIDTH
from otel_swa.device.kv_folds import layer_of
from otel_swa.device.stamps import decode_stamp

__all__ = ["take_ranges", "PROVENANCE_POOLS", "PROVENANCE_CELLS", "PROVENANCE_WIDTH", "NEVER_STAMPED", "ProvenanceMeta",
           "ProvenanceReading"]

#: What a live slot whose stamp is 0 (never written since provenance was on) is: the first is the default.
NEVER_STAMPED = ("foreign", "unchecked")
_C = {name: index for index, name in enumerate(PROVENANCE_CELLS)}


@dataclass(frozen=True)
class ProvenanceReading:
    """One sample's verification, read on the host (all ints).

    Attributes:
        stamp_checks: live slots (both pools) whose stamp was compared with the expected one.
        foreign_tokens: of which the stamp was another token's (a fault).
        stamp_unchecked: live slots not judged: over the sample's budget, token ids not given by
            the view, or (with ``never_stamped="unchecked"``) never stamped.
        checksum_checks, corrupt_tokens, checksum_unchecked: the same for the content checksum
            (``None`` when checksums are off); unchecked also counts slots of a pool whose
            designated layer was never seen or whose cache dtype is not hashed (fp8).
        foreign_offender: the first foreign slot (FULL pool first, then SWA; in each, the order
            slots were taken): ``entry``, ``row``, ``position``, ``pool`` (``"full"``/``"swa"``),
            ``full_slot``, ``swa_slot`` (``None`` without a mapping), ``expected_token``,
            ``expected_position``, ``found_token``, ``found_position`` (decoded from the stamps, token
            ids mod 2**20, positions mod 2**22), ``found_chain_known``; ``None`` when none.
        corrupt_offender: the first corrupt slot: ``entry``, ``row``, ``position``, ``pool``,
            ``full_slot``, ``swa_slot``, ``layer`` (the one attention layer whose bytes changed, from
            the folds, :func:`otel_swa.device.kv_folds.layer_of`; ``None`` when several did);
            ``None`` when none. A slot found by the sweep of the
            prefix cache (:meth:`KvProvenance.stage`) has ``entry``, ``row`` and ``position``
            ``None`` (no request of the batch reads it); the batch's come first.

    ``checksum_checks`` and ``corrupt_tokens`` count the batch's live slots and the swept ones
    (a slot both held by the prefix cache and read by the batch may count twice).
    """

    stamp_checks: int
    foreign_tokens: int
    stamp_unchecked: int
    checksum_checks: "int | None"
    corrupt_tokens: "int | None"
    checksum_unchecked: "int | None"
    foreign_offender: "dict[str, Any] | None" = None
    corrupt_offender: "dict[str, Any] | None" = None


@dataclass(frozen=True)
class ProvenanceMeta:
    """What the host knew when it staged a verification (:meth:`KvProvenance.stage`).

    Attributes:
        taken: per pool, ``(entries, positions, expected)``: ``int64`` host arrays of the slots taken
            (expected 0 where the request's token ids were not known), or ``None`` for a pool not
            verified.
        over_budget: per pool, candidate slots not taken at this sample.
        checksums: whether checksums are on.
        layer_ids: per pool, the ids of the layers its folds cover (what a corrupt slot's layer is
            read among).
    """

    taken: "tuple[tuple[np.ndarray, np.ndarray, np.ndarray] | None, ...]"
    over_budget: "tuple[int, ...]"
    checksums: bool
    layer_ids: "tuple[frozenset, ...]" = (frozenset(), frozenset())
    #: ``host_slot_of(pool, slot)``: the host slot a loaded device slot came from (a host tier's,
    #: :meth:`otel_swa.device.host_tier.HostTier.host_slot_of`), or ``None`` without a host tier
    host_slot_of: "Any" = None

    def read(self, values: Sequence[int]) -> ProvenanceReading:
        """The reading of the :data:`PROVENANCE_WIDTH` staged ints."""
        stamp_checks = foreign = stamp_unchecked = checksum_checks = corrupt = checksum_unchecked = 0
        foreign_at = corrupt_at = None
        swept_at = None
        for p, pool in enumerate(PROVENANCE_POOLS):
            taken = self.taken[p]
            if taken is None:
                continue
            cells = values[p * _PER_POOL:(p + 1) * _PER_POOL]
            checksum_checks += cells[_C["sweep_checks"]]
            corrupt += cells[_C["sweep_corrupt"]]
            if swept_at is None and cells[_C["sweep_corrupt"]] > 0:
                swa = int(cells[_C["sweep_swa_slot"]])
                swept_at = {"entry": None, "row": None, "position": None, "pool": pool,
                            "full_slot": int(cells[_C["sweep_full_slot"]]), "swa_slot": swa if swa >= 0 else None,
                            "layer": layer_of(int(cells[_C["sweep_d1"]]), int(cells[_C["sweep_d2"]]),
                                              self.layer_ids[p])}
            live = int(cells[_C["live"]]) if pool == "swa" else len(taken[0])
            stamp_checks += cells[_C["stamp_checks"]]
            foreign += cells[_C["foreign"]]
            stamp_unchecked += self.over_budget[p] + live - cells[_C["stamp_checks"]]
            checksum_checks += cells[_C["checksum_checks"]]
            corrupt += cells[_C["corrupt"]]
            checksum_unchecked += self.over_budget[p] + live - cells[_C["checksum_checks"]]
            if foreign_at is None and cells[_C["foreign"]] > 0:
                foreign_at = _foreign(pool, taken, cells)
            if corrupt_at is None and cells[_C["corrupt"]] > 0:
                corrupt_at = _slot_fields(pool, taken, cells, "corrupt")
                corrupt_at["layer"] = layer_of(int(cells[_C["corrupt_d1"]]), int(cells[_C["corrupt_d2"]]),
                                               self.layer_ids[p])
        if corrupt_at is None:
            corrupt_at = swept_at
        if self.host_slot_of is not None:
            for where in (foreign_at, corrupt_at):
                if where is not None:
                    slot = where["swa_slot"] if where["pool"] == "swa" else where["full_slot"]
                    host = self.host_slot_of(where["pool"], slot) if slot is not None else None
                    if host is not None:
                        where["host_slot"] = host
        on = self.checksums
        return ProvenanceReading(
            stamp_checks, foreign, stamp_unchecked,
            checksum_checks if on else None, corrupt if on else None, checksum_unchecked if on else None,
            foreign_at, corrupt_at if on else None,
        )


def _slot_fields(pool: str, taken, cells, prefix: str) -> "dict[str, Any]":
    index = int(cells[_C[f"{prefix}_index"]])
    swa = int(cells[_C[f"{prefix}_swa_slot"]])
    return {
        "entry": int(taken[0][index]), "row": int(cells[_C[f"{prefix}_row"]]), "position": int(taken[1][index]),
        # SWA slot 0 is no slot (SGLang's mapping holds 0 for a token without one): not named
        "pool": pool, "full_slot": int(cells[_C[f"{prefix}_full_slot"]]), "swa_slot": swa if swa > 0 else None,
    }


def _foreign(pool: str, taken, cells) -> "dict[str, Any]":
    fields = _slot_fields(pool, taken, cells, "foreign")
    expected = decode_stamp(int(taken[2][int(cells[_C["foreign_index"]])]))
    found = decode_stamp(int(cells[_C["foreign_stamp"]]))
    fields.update(expected_token=expected["token"], expected_position=expected["position"])
    if found is not None:
        fields.update(found_token=found["token"], found_position=found["position"],
                      found_chain_known=found["chain_known"])
    return fields


def take_ranges(low: np.ndarray, lens: np.ndarray, budget: int, cursor: int
                ) -> "tuple[list[tuple[int, int, int]], int, int]":
    """The ranges ``(entry, lo, hi)`` a sample verifies in a pool (entry ``i``'s candidate positions
    ``low[i] .. lens[i] - 1``; at most ``budget`` positions, from ``cursor`` over the candidates
    counted in entry order, so that successive samples go round them), the candidates left over, and
    the next cursor."""
    counts = np.maximum(lens - low, 0)
    total = int(counts.sum())
    if total <= budget:
        return [(i, int(low[i]), int(lens[i])) for i in range(len(lens)) if counts[i]], 0, cursor
    start = cursor % total
    ends = np.cumsum(counts)
    pieces = []
    need, at = budget, start
    while need:
        i = int(np.searchsorted(ends, at, side="right"))
        first = int(ends[i] - counts[i])
        lo = int(low[i]) + (at - first)
        take = min(need, int(ends[i]) - at)
        pieces.append((i, lo, lo + take))
        need -= take
        at = (at + take) % total
    return pieces, total - budget, (start + budget) % total
