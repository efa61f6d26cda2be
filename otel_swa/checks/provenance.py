"""Provenance: does each live slot hold the KV of the token the tables name, with its bytes unchanged?

Every forward step stamps each written slot (token, position, a chain over the request's prefix) and
hashes its K/V rows (:class:`~otel_swa.device.provenance.KvProvenance`, switched on by the engine
with :meth:`~otel_swa.reporter.SwaDivergenceReporter.enable_provenance`); a sampled step verifies
the live slots of the batch (and a sweep of the slots the prefix cache holds) against the stamps
expected from each request's own token ids and against the bytes the pool holds now. The module
docstring of :mod:`otel_swa.device.provenance` gives the stamps, the hash and the bounds.
"""

from __future__ import annotations

from typing import Any, Sequence

from otel_swa.checks.protocol import Check, CheckField, SampleBatch, Staging, first_fault_text, outcome_counter

__all__ = ["PROVENANCE_POOLS", "PROVENANCE_CELLS", "PROVENANCE_WIDTH", "ProvenanceCheck", "CHECK"]

#: The pools verified, in the order of the cells and of the search for a first offender.
PROVENANCE_POOLS = ("full", "swa")
#: The cells of one pool's verification (:data:`PROVENANCE_WIDTH` = both pools', FULL first), staged by
#: :meth:`otel_swa.device.provenance.KvProvenance.stage` and read by
#: :meth:`otel_swa.device.provenance_reading.ProvenanceMeta.read`.
PROVENANCE_CELLS = (
    "live",  # SWA: taken slots whose mapping is not 0 (FULL: unused, every taken slot is live)
    "stamp_checks",  # live and the request's token ids known (and stamped, with never_stamped="unchecked"): compared
    "foreign",  # of which the stamp was another token's
    "foreign_index",  # the first foreign's index among the taken slots
    "foreign_row", "foreign_stamp", "foreign_full_slot", "foreign_swa_slot",
    "checksum_checks",  # live and hashed: hashed again and compared
    "corrupt",  # of which the bytes changed
    "corrupt_index", "corrupt_row", "corrupt_full_slot", "corrupt_swa_slot",
    "sweep_checks",  # swept slots (the prefix cache's, beyond the batch) hashed and compared
    "sweep_corrupt",  # of which the bytes changed
    "sweep_full_slot", "sweep_swa_slot",  # the first of them
    "corrupt_d1", "corrupt_d2",  # the first corrupt slot's differences of the folds (the layer changed)
    "sweep_d1", "sweep_d2",  # the same for the first corrupt swept slot
)
_PER_POOL = len(PROVENANCE_CELLS)
PROVENANCE_WIDTH = 2 * _PER_POOL

#: The keys a foreign or corrupt token's offender may name beyond its batch entry (``block`` and
#: ``kv_cache_group``: a paged engine's, :mod:`otel_swa.device.paged_provenance`).
_WHERE = ("expected_token", "expected_position", "found_token", "found_position", "layer", "block", "kv_cache_group",
          "host_slot")


class ProvenanceCheck(Check):
    name = "provenance"
    title = "provenance"
    line = "provenance"
    fields = (
        CheckField("kv_stamp_checks", "{slot}",
                   "live token slots (FULL and SWA pools together) whose provenance stamp was compared with the "
                   "stamp expected from the request's own tokens"),
        CheckField("kv_foreign_tokens", "{token}",
                   "live token slots whose provenance stamp is not the one the request's own tokens give",
                   role="fault", label="foreign tokens",
                   explain="{peak} live token slot(s) hold another token's KV (their provenance stamp is not the "
                           "request's own: swapped ownership, a stale prefix reuse, a slot overwritten, a wrong "
                           "position)",
                   nothing_found="found a slot never stamped",
                   gauge=("tokens.foreign", "Live token slots of the sampled step whose provenance stamp is another "
                          "token's: the slot holds other KV than the tables say (swapped ownership, stale prefix "
                          "reuse, a slot overwritten, a wrong position); must be 0")),
        CheckField("kv_stamp_unchecked", "{slot}",
                   "live token slots whose provenance stamp was not judged (token ids unknown, over the per-sample "
                   "budget; never stamped, for an engine wired after it held KV)",
                   role="info", label="unchecked stamps"),
        CheckField("kv_checksum_checks", "{slot}",
                   "live token slots whose K/V bytes were hashed again and compared with the hash taken at the write"),
        CheckField("kv_corrupt_tokens", "{token}",
                   "live token slots whose K/V bytes changed after they were written",
                   role="fault", label="corrupt tokens",
                   explain="{peak} live token slot(s) hold K/V bytes that changed after they were written (their "
                           "checksum differs: a stray write, a bad load-back, a bit flip)",
                   gauge=("tokens.corrupt", "Live token slots of the sampled step whose K/V bytes changed after they "
                          "were written (a stray write, a bad load-back, a bit flip); must be 0")),
    )
    ran_when = "when the engine stamps and checksums its slots"
    counters = (
        outcome_counter(
            "provenance.stamps", "{slot}",
            "Live token slots (FULL and SWA pools) whose provenance stamp was compared with the one the request's "
            "own tokens give, by outcome (kv_cache.swa.provenance.outcome): agree, disagree (the slot holds another "
            "token's KV, or none: never stamped; must stay 0), unchecked (token ids unknown, over the per-sample "
            "budget; never stamped, for an engine wired after it held KV)",
            "provenance.outcome", ("kv_stamp_checks", "kv_foreign_tokens", "kv_stamp_unchecked"),
            "when the engine stamps its slots"),
        outcome_counter(
            "provenance.checksums", "{slot}",
            "Live token slots whose K/V bytes were hashed again and compared with the hash taken at the write, by "
            "outcome (kv_cache.swa.provenance.outcome): agree, disagree (the bytes changed after the write; must "
            "stay 0)",
            "provenance.outcome", ("kv_checksum_checks", "kv_corrupt_tokens", None), "when the engine checksums its slots"),
    )
    reason = ("the write check and provenance found KV that is not the KV of the token the tables name (peak "
              "{found}); exit status 1")

    width = PROVENANCE_WIDTH

    def stage(self, staging: Staging, cells: Any) -> Any:
        provenance = staging.parts.get(self.name)
        if provenance is None:
            return None
        return provenance.stage(cells, view=staging.view, upload=lambda host: staging.upload(host, self.name))

    def read(self, cells: Sequence[int], kept: Any, batch: SampleBatch) -> "tuple[dict, list[dict]]":
        reading = kept.read(cells)  # kept: the ProvenanceMeta of the staged verification
        fields = {"kv_stamp_checks": reading.stamp_checks, "kv_foreign_tokens": reading.foreign_tokens,
                  "kv_stamp_unchecked": reading.stamp_unchecked, "kv_checksum_checks": reading.checksum_checks,
                  "kv_corrupt_tokens": reading.corrupt_tokens}
        offenders = []
        for fault, where in (("kv_foreign_tokens", reading.foreign_offender),
                             ("kv_corrupt_tokens", reading.corrupt_offender)):
            if where is None:
                continue
            swa = where["swa_slot"]
            offenders.append(dict(fault=fault, request=batch.request(where["entry"]), row=where["row"],
                                  position=where["position"], full_slot=where["full_slot"], swa_slot=swa,
                                  swa_page=batch.swa_page(swa), pool=where["pool"],
                                  **{key: where.get(key) for key in _WHERE}))
        return fields, offenders

    def summary(self, records: Sequence[Any]) -> str:
        checked = [r for r in records if self.present(r)]
        stamps = sum(r.kv_stamp_checks for r in checked)
        foreign = sum(r.kv_foreign_tokens for r in checked)
        unchecked = sum(r.kv_stamp_unchecked for r in checked)
        hashed = [r for r in checked if r.kv_checksum_checks is not None]
        corrupt = sum(r.kv_corrupt_tokens for r in hashed)
        verdict = "clean" if not foreign and not corrupt else "FOREIGN OR CORRUPT KV"
        text = f"{verdict}: {foreign} foreign of {stamps} slots stamped ({unchecked} unchecked)"
        if hashed:
            text += f", {corrupt} corrupt of {sum(r.kv_checksum_checks for r in hashed)} hashed"
        return (f"{text} ({len(checked)} samples){first_fault_text(checked, 'kv_foreign_tokens')}"
                f"{first_fault_text(hashed, 'kv_corrupt_tokens')}")


#: Provenance: the stamps and the content checksums.
CHECK = ProvenanceCheck()
