"""The device side of the data path (torch only): accumulator, sample computation, device-to-host ring."""

from otel_swa.device.accumulator import KVPool, PoolAccumulator, pool_index
from otel_swa.device.audit import (
    AUDIT_WIDTH,
    SwaSlotAudit,
    audit_counts,
    audit_swa_slots,
)
from otel_swa.device.audit_sweep import SwaAuditSweep
from otel_swa.device.block_audit import stage_block_audit
from otel_swa.device.d2h_ring import DeviceToHostRing
from otel_swa.device.sample import (
    DENSE_FILL_RATIO,
    FAULTS,
    STAGE_WIDTH,
    SampleMeta,
    SampleReading,
    count_divergence,
    live_full_slots,
    read_sample,
    stage_sample,
)
from otel_swa.device.workspace import Workspace

__all__ = [
    "AUDIT_WIDTH",
    "SwaSlotAudit",
    "audit_counts",
    "audit_swa_slots",
    "KVPool",
    "PoolAccumulator",
    "pool_index",
    "DeviceToHostRing",
    "DENSE_FILL_RATIO",
    "FAULTS",
    "STAGE_WIDTH",
    "SampleMeta",
    "SampleReading",
    "count_divergence",
    "live_full_slots",
    "read_sample",
    "stage_sample",
    "Workspace",
    "SwaAuditSweep",
    "stage_block_audit",
]
