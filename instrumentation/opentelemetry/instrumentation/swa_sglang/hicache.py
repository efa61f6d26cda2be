"""The KV's provenance across SGLang's hierarchical cache (HiCache, ``--enable-hierarchical-cache``):
the stamps and checksum folds of each slot follow its KV to a host pool and back
(:class:`otel_swa.device.host_tier.HostTier`).

Where. sglang 0.5.23 moves HiCache's bytes in three layers: the controller
(``hybrid_cache/hybrid_cache_controller.HybridCacheController.write`` / ``load``: queues of operations
whose device indices are FULL slots, translated per pool later), the L2 transfer engine
(``mem_cache/l2_transfer.L2TransferEngine.submit_device_to_host`` / ``submit_host_to_device``: it
resolves each pool's device indices, ``host_transfer_translate`` and ``prepare_transfer_indices``,
on its transfer stream) and the host pools (``pool_host/base.HostKVCache``). The moves are made at
the host pools' own copy calls, ``backup_from_device_all_layer_physical`` (device -> host, all layers)
and ``load_to_device_per_layer_physical`` (host -> device, one layer per call), because only there:

* the indices are the rows the bytes move between, after every translation (the SWA pool's device
  indices are SWA slots, translated through ``full_to_swa_index_mapping`` as HiCache translates
  them; a compacting pool's logical ids resolved): the tables move exactly as the bytes do;
* the call names its device pool (``device_pool``: the ``SWAKVPool``'s ``full_kv_pool`` or
  ``swa_kv_pool``), so the FULL and SWA tables are told apart without SGLang's pool labels;
* a per-layer load says which layer arrived: HiCache overlaps the load with the forward (layer ``i``
  of the forward waits for layer ``i`` of the load), so the stamps move with the pool's first
  layer and the folds only after its last (:meth:`~otel_swa.device.host_tier.HostTier.load_started`
  clears the folds of the slots being filled: their bytes are never judged before every layer
  arrived).

``HostKVCache.alloc`` clears the tables of the host slots it hands out (nothing followed there until
a backup writes them). Host pools of another class that override these calls (none on CPU) are not
followed. With an L3 storage backend (``--hicache-storage-backend``) host slots are also filled
from storage, which no table follows: one log line, and the device slots loaded from them are
counted unchecked (provenance made with ``never_stamped="unchecked"``).

The wrappers are set on ``HostKVCache`` once per process, when the first model runner with HiCache is
wired; a call for a device pool no wired runner owns passes through untouched.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

_log = logging.getLogger(__package__)

#: ``id(device sub-pool) -> (device sub-pool, HostTier, "full"/"swa")`` of this process's wired runners.
_TIERS: "dict[int, tuple[Any, Any, str]]" = {}
#: the modules whose classes were wrapped in this process (once each)
_wrapped: "list[str]" = []
#: sglang 0.5.23's module of ``HostKVCache``, the host pools' base class
_HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.base"


def hicache_storage(runner: Any) -> "str | None":
    """The L3 storage backend HiCache uses beside its host pools (``server_args.hicache_storage_backend``,
    sglang 0.5.23), or ``None``."""
    backend = getattr(getattr(runner, "server_args", None), "hicache_storage_backend", None)
    return str(backend) if backend else None


def follow_host_tier(provenance: Any, kv_pool: Any) -> Any:
    """Follow ``provenance`` (a :class:`~otel_swa.device.provenance.KvProvenance`) of ``kv_pool`` (an
    ``SWAKVPool``) to HiCache's host pools: the :class:`~otel_swa.device.host_tier.HostTier` whose
    tables the host pools' copy calls move from now on (their pools added at the first call that
    names them)."""
    from otel_swa import import_hooks
    from otel_swa.device.host_tier import HostTier

    tier = HostTier(provenance)
    for pool, name in ((kv_pool.full_kv_pool, "full"), (kv_pool.swa_kv_pool, "swa")):
        _TIERS[id(pool)] = (pool, tier, name)
    if not _wrapped:
        _wrapped.append(_HOST_POOL_MODULE)
        import_hooks.when_imported(_HOST_POOL_MODULE, _wrap_host_pool)
    return tier


def _tier_of(host_pool: Any, device_pool: Any) -> "tuple[Any, str] | None":
    """``(tier, pool name)`` for a copy between ``host_pool`` and ``device_pool``, the tier's host
    tables of that pool made at the first sight (``host_pool.slot_used``: one entry per host slot)."""
    found = _TIERS.get(id(device_pool)) if device_pool is not None else None
    if found is None or found[0] is not device_pool:
        return None
    _, tier, name = found
    if not tier.follows(name):
        slots = getattr(host_pool, "slot_used", None)
        size = int(slots.shape[0]) if slots is not None else int(host_pool.size)
        tier.add_pool(name, size)
    return tier, name


def _guarded(what: str, move: Callable, *args: Any) -> None:
    try:
        move(*args)
    except Exception:  # never break the engine's copy: the slots then hold old tables (a fault shown)
        _log.exception("moving the KV's provenance with HiCache's %s failed", what)


def _wrap_host_pool(module: Any) -> None:
    cls = module.HostKVCache
    backup, load, alloc = (cls.backup_from_device_all_layer_physical, cls.load_to_device_per_layer_physical,
                           cls.alloc)

    @functools.wraps(backup)
    def backup_from_device_all_layer_physical(self, device_pool, host_indices, device_indices, io_backend):
        result = backup(self, device_pool, host_indices, device_indices, io_backend)
        found = _tier_of(self, device_pool)
        if found is not None:
            _guarded("backup", found[0].backup, found[1], host_indices, device_indices)
        return result

    @functools.wraps(load)
    def load_to_device_per_layer_physical(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                          *args, is_draft: bool = False, **kwargs):
        found = None if is_draft else _tier_of(self, device_pool)
        last = int(getattr(self, "target_layer_num", getattr(self, "layer_num", 1))) - 1
        if found is not None and layer_id == 0:
            _guarded("load", found[0].load_started, found[1], host_indices, device_indices)
        result = load(self, device_pool, host_indices, device_indices, layer_id, io_backend, *args,
                      is_draft=is_draft, **kwargs)
        if found is not None and layer_id == last:
            _guarded("load", found[0].load_arrived, found[1], host_indices, device_indices)
        return result

    @functools.wraps(alloc)
    def alloc_host(self, need_size):
        indices = alloc(self, need_size)
        if indices is not None:
            found = _tier_of(self, getattr(self, "device_pool", None))
            if found is not None:
                _guarded("host allocation", found[0].forget, found[1], indices)
        return indices

    cls.backup_from_device_all_layer_physical = backup_from_device_all_layer_physical
    cls.load_to_device_per_layer_physical = load_to_device_per_layer_physical
    cls.alloc = alloc_host
