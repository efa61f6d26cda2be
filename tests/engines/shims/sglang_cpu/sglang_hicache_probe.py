"""The engine suite's recount of HiCache's copies in the scheduler process (test environments only,
with the scheduler probe on: ``OTEL_SWA_TEST_SGLANG_PROBE``).

Stands in for nothing: it counts, in plain Python and apart from otel-swa, what sglang 0.5.23's host
pools copy (``pool_host/mha.MHATokenToKVPoolHost.backup_from_device_all_layer``: device -> host,
all layers; ``load_to_device_per_layer``: host -> device, one layer per call), per pool label
(``"full"``, ``"swa"``): calls and slots of backups, loads (their layer 0) and layers loaded. After
every forward step the probe's line gets ``hicache``: this recount, and ``tier``: what otel-swa's
host tables counted (``HostTier.counts`` of the runner's provenance wiring), to compare.
"""

from __future__ import annotations

import sys

import sglang_cpu_patches
import sglang_step_probe

_MHA = "sglang.srt.mem_cache.pool_host.mha"

#: pool label -> counter -> int
COUNTS: "dict[str, dict[str, int]]" = {}


def _count(label: str, name: str, slots: int) -> None:
    counts = COUNTS.setdefault(label, {"backups": 0, "backed_up_slots": 0, "loads": 0, "loaded_slots": 0,
                                       "layers_loaded": 0})
    counts[name] += 1
    if name == "backups":
        counts["backed_up_slots"] += slots
    elif name == "loads":
        counts["loaded_slots"] += slots


def _patch_mha(module) -> None:
    cls = module.MHATokenToKVPoolHost
    backup, load = cls.backup_from_device_all_layer, cls.load_to_device_per_layer

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        _count(self.pool_label, "backups", int(host_indices.numel()))
        return backup(self, device_pool, host_indices, device_indices, io_backend)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs):
        if not kwargs.get("is_draft"):
            _count(self.pool_label, "layers_loaded", 0)
            if layer_id == 0:
                _count(self.pool_label, "loads", int(host_indices.numel()))
        return load(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)

    cls.backup_from_device_all_layer = backup_from_device_all_layer
    cls.load_to_device_per_layer = load_to_device_per_layer


def tier_counts(runner) -> "dict | None":
    """otel-swa's host-table counts of ``runner`` (its wiring's ``host_tier``), or ``None`` (also when
    otel-swa's instrumentor was never imported in this process: the probe does not import it)."""
    attributes = sys.modules.get("opentelemetry.instrumentation.swa_sglang.attributes")
    wiring = runner.__dict__.get(attributes.RUNNER_ATTRIBUTE) if attributes is not None else None
    provenance = getattr(wiring, "provenance", None)
    tier = provenance[1].get("host_tier") if provenance else None
    return {pool: dict(counts) for pool, counts in tier.counts.items()} if tier is not None else None


def _after_forward(runner, forward_batch, step, line) -> None:
    if COUNTS:
        line["hicache"] = {label: dict(counts) for label, counts in COUNTS.items()}
    tier = tier_counts(runner)
    if tier is not None:
        line["tier"] = tier


def install() -> None:
    sglang_cpu_patches.add_patch(_MHA, _patch_mha)
    sglang_step_probe.after_forward(_after_forward)
