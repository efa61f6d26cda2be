"""The device side of the data path (torch only): accumulator, sample computation, device-to-host ring."""

from otel_swa.device.accumulator import KVPool, PoolAccumulator, pool_index
from otel_swa.device.audit import (
    AUDIT_WIDTH,
    SwaSlotAudit,
    audit_counts,
    audit_swa_slots,
)
from otel_swa.device.d2h_ring import DeviceToHostRing
from otel_swa.device.sample import (
    STAGE_WIDTH,
    count_divergence,
    live_full_slots,
    stage_sample,
)

__all__ = [
    "AUDIT_WIDTH",
    "SwaSlotAudit",
    "audit_counts",
    "audit_swa_slots",
    "KVPool",
    "PoolAccumulator",
    "pool_index",
    "DeviceToHostRing",
    "STAGE_WIDTH",
    "count_divergence",
    "live_full_slots",
    "stage_sample",
]
