"""Faults of HiCache's host tier, made inside a real sglang 0.5.23 Engine (the engine suite's HiCache
runs; never for users). Each stands for a class of bug of the tier where KV leaves the device and
comes back (sgl-project/sglang#33656: DeepSeek-V4 + HiCache wrote SWA KV wrong; SGLang's KV canary
does not follow its stamps through HiCache, #30098, #32476):

``hicache_load_bytes_changed``
    Host memory corruption, or a bad host -> device transfer: at the first load of the FULL pool
    from step ``at_step`` on, the K rows of every host slot loaded (the FULL pool's layer) are
    changed by +0.5 in host memory before the copy, so the device gets bytes other than those backed
    up.
``hicache_load_wrong_slots``
    A load into the wrong device slots (a bad index translation before the copy): at the first load
    of the FULL pool from ``at_step`` on, the transfer's device slots are rotated by one, so each
    token's KV (and everything the copy carries) lands in the slot of the next position.
``hicache_stale_host_copy``
    A stale host copy: a host slot freed and handed out to another backup while the radix tree still
    points to it. At the first load of the FULL pool from ``at_step`` on, the first host slot loaded
    is written, just before the load, by a backup of another device slot (one an earlier backup of
    the FULL pool named), through the host pool's own backup call, as its reuse would.
``hicache_skipped_swa_backup``
    A skipped backup of the SWA window tail: from ``at_step`` on, every device -> host transfer of the
    SWA pool is dropped while the FULL pool's goes on; the radix tree records the node as backed up,
    so a later load of it brings back whatever the host slots held.

Made at ``mem_cache/l2_transfer.L2TransferEngine.submit_host_to_device`` / ``submit_device_to_host``
(above the host pools' copy calls): what the bug changes is what the copy calls get. Each records in
the probe's directory (``sglang_faults.record``) the step whose forward first reads the result
(``step``), the pool, the host and device slots touched, and the layer changed.
"""

from __future__ import annotations

import sglang_cpu_patches
import sglang_faults
import sglang_step_probe

NAMES = ("hicache_load_bytes_changed", "hicache_load_wrong_slots", "hicache_stale_host_copy",
         "hicache_skipped_swa_backup")
_L2 = "sglang.srt.mem_cache.l2_transfer"


def _model_layer(runner, swa: bool, index: int) -> "int | None":
    """The model layer id of index ``index`` of the FULL (``swa`` False) or SWA sub-pool."""
    mapping = getattr(getattr(runner, "token_to_kv_pool", None), "layers_mapping", None) or {}
    return next((int(layer) for layer, (i, is_swa) in mapping.items() if i == index and is_swa == swa), None)


def install(name: str, at_step: int) -> None:
    state = {"made": False, "runner": None, "backed_up": None}

    def remember_runner(runner, forward_batch, step) -> None:
        state["runner"] = runner

    def pool_of(transfer) -> str:
        return str(getattr(transfer.host_pool, "pool_label", ""))

    def on_load(engine, transfers) -> list:
        step = sglang_step_probe.current_step() + 1
        if state["made"] or step < at_step:
            return transfers
        index = next((i for i, t in enumerate(transfers) if pool_of(t) == "full" and t.host_indices.numel() >= 2), None)
        if index is None:
            return transfers
        transfer = transfers[index]
        host, device = transfer.host_indices, transfer.device_indices
        details = {"pool": "full", "host_slot": int(host[0]), "full_slot": int(device[0]),
                   "host_slots": [int(x) for x in host]}
        if name == "hicache_load_bytes_changed":
            rows = host.long()
            transfer.host_pool.k_buffer[0][rows] += 0.5
            details.update(layer=_model_layer(state["runner"], False, 0), full_slots=[int(x) for x in device])
        elif name == "hicache_load_wrong_slots":
            transfers = list(transfers)
            transfers[index] = transfer._replace(device_indices=device.roll(1))
            details.update(full_slots=[int(x) for x in device], loaded_into=[int(x) for x in device.roll(1)])
        else:  # hicache_stale_host_copy
            other = state["backed_up"]
            if other is None or int(other) in set(int(x) for x in device):
                return transfers
            transfer.host_pool.backup_from_device_all_layer_physical(
                transfer.device_pool, host[:1].clone(), other.reshape(1).to(device.dtype), engine.io_backend)
            details["reused_by_full_slot"] = int(other)
        state["made"] = True
        sglang_faults.record(name, step, **details)
        return transfers

    def on_backup(transfers) -> list:
        for t in transfers:
            if pool_of(t) == "full" and t.device_indices.numel():
                state["backed_up"] = t.device_indices[-1].clone()
        if name != "hicache_skipped_swa_backup":
            return transfers
        step = sglang_step_probe.current_step() + 1
        if step < at_step:
            return transfers
        skipped = [t for t in transfers if pool_of(t) == "swa" and t.host_indices.numel()]
        if skipped and not state["made"]:
            state["made"] = True
            sglang_faults.record(name, step, pool="swa", host_slots=[int(x) for x in skipped[0].host_indices],
                                 swa_slots=[int(x) for x in skipped[0].device_indices])
        return [t for t in transfers if pool_of(t) != "swa"]

    def patch(module) -> None:
        engine = module.L2TransferEngine
        load, backup = engine.submit_host_to_device, engine.submit_device_to_host

        def submit_host_to_device(self, transfers, *args, **kwargs):
            if name != "hicache_skipped_swa_backup":
                transfers = on_load(self, transfers)
            return load(self, transfers, *args, **kwargs)

        def submit_device_to_host(self, transfers, *args, **kwargs):
            return backup(self, on_backup(transfers), *args, **kwargs)

        engine.submit_host_to_device = submit_host_to_device
        engine.submit_device_to_host = submit_device_to_host

    sglang_step_probe.before_forward(remember_runner)
    sglang_cpu_patches.add_patch(_L2, patch)
