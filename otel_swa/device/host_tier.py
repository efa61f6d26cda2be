"""Provenance of KV copies kept outside the device: host-side tables that follow each slot's stamp and
checksum folds to a host tier (SGLang's HiCache host pools) and back.

torch only. For each pool of :class:`~otel_swa.device.provenance.KvProvenance` (FULL, SWA) a host
tier keeps, per host slot, what the device tables hold per device slot:

* ``stamps``: ``int64 [host_slots]``, the stamp of the token whose KV the host slot holds (0: none
  followed there);
* ``folds``: ``int64 [host_slots, 2]``, its checksum folds (:mod:`otel_swa.device.kv_folds`; 0:
  none), absent with checksums off.

24 bytes per host slot and pool (8 without checksums), on the host tier's device (the host pool's
memory: ``"cpu"``), whatever the number of layers; and 16 bytes per device slot of each followed
pool on the provenance's device (``loaded``: the host slot each device slot was last loaded from and
the stamp that load moved in), which names the host slot of a fault's first offender
(:meth:`HostTier.host_slot_of`).

The moves (the engine calls them where its bytes move; each is a gather and a scatter per table, no
host read):

* :meth:`HostTier.backup`: device slots -> host slots, with the backup's copy (the bytes left the
  device as they were when their folds were written);
* :meth:`HostTier.load_started`: host slots -> device slots at the start of a load: the stamps move
  (the tables name the token from now on) and the device slots' folds are cleared (0: never
  written, so the bytes are not judged while layers are still arriving);
* :meth:`HostTier.load_arrived`: the folds move once the last layer of the load arrived: from then
  on a loaded slot is verified like any live slot, its stamp against the request's own tokens, its
  bytes against the folds written before it left the device;
* :meth:`HostTier.forget`: host slots handed out anew (an allocation): nothing followed there until
  a backup writes them;
* host slots whose bytes a tier wrote without the tables (an L3 storage backend's prefetch into
  host slots handed out anew) keep stamp 0 and no folds: a load counts them
  (``unfollowed_slots``), and the device slots they fill hold stamp 0 and no folds, which
  :class:`~otel_swa.device.provenance.KvProvenance` counts unchecked when it was made with
  ``never_stamped="unchecked"`` (the engine's wiring does so when such a tier is configured; without
  one, a loaded slot that no backup wrote is a foreign token: a skipped backup).

Index arguments are ``int [n]`` tensors on any device (moved to the table's device); the device and
host indices of one call pair up position by position. A move between index lists of different
lengths raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

from otel_swa.device.provenance_reading import PROVENANCE_POOLS

__all__ = ["HostTier", "MOVE_COUNTERS"]

#: What :attr:`HostTier.counts` holds per pool: moves (calls) and slots moved per kind.
MOVE_COUNTERS = ("backups", "backed_up_slots", "loads", "loaded_slots", "unfollowed_slots")


class HostTier:
    """The host tables of one host tier, beside a :class:`~otel_swa.device.provenance.KvProvenance`.

    Args:
        provenance: the device tables (its ``stamps`` and ``folds``, read and written in place).
        host_slots: ``{"full": n, "swa": n}``, the host slots of each pool followed from the start
            (:meth:`add_pool` for each; more may be added later).
        device: where the host tables live (default ``"cpu"``: host memory).

    Raises:
        ValueError: an unknown pool name or a bad slot count.
    """

    def __init__(self, provenance: Any, host_slots: "dict[str, int] | None" = None,
                 device: "torch.device | str" = "cpu") -> None:
        self.provenance = provenance
        self.device = torch.device(device)
        self.stamps: "dict[str, torch.Tensor]" = {}
        self.folds: "dict[str, torch.Tensor]" = {}
        #: per pool, :data:`MOVE_COUNTERS` -> int
        self.counts: "dict[str, dict[str, int]]" = {}
        #: per pool, ``int64 [device_slots, 2]`` on the provenance's device: the host slot + 1 each
        #: device slot was last loaded from (0: none) and the stamp that load moved in
        self.loaded: "dict[str, torch.Tensor]" = {}
        for name, slots in (host_slots or {}).items():
            self.add_pool(name, slots)
        provenance.host_tier = self  # names the host slot of a loaded slot's offender (host_slot_of)

    def add_pool(self, pool: str, host_slots: int) -> None:
        """Follow ``pool`` (``"full"``/``"swa"``) to ``host_slots`` host slots (an int >= 1; a pool
        without device tables is not followed; a pool followed already keeps its tables).

        Raises:
            ValueError: an unknown pool name or a bad slot count.
        """
        if pool not in PROVENANCE_POOLS:
            raise ValueError(f"pool {pool!r} is not one of {', '.join(PROVENANCE_POOLS)}")
        if type(host_slots) is not int or host_slots < 1:  # noqa: E721
            raise ValueError(f"host_slots of {pool!r} must be an int >= 1, got {host_slots!r}")
        p = PROVENANCE_POOLS.index(pool)
        if pool in self.stamps or self.provenance.stamps[p] is None:
            return
        self.stamps[pool] = torch.zeros(host_slots, dtype=torch.int64, device=self.device)
        if self.provenance.folds[p] is not None:
            self.folds[pool] = torch.zeros((host_slots, 2), dtype=torch.int64, device=self.device)
        self.counts[pool] = dict.fromkeys(MOVE_COUNTERS, 0)
        device_stamps = self.provenance.stamps[p]
        self.loaded[pool] = torch.zeros((device_stamps.shape[0], 2), dtype=torch.int64, device=device_stamps.device)

    @property
    def bytes_per_host_slot(self) -> "dict[str, int]":
        """Host bytes the tables take per host slot of each followed pool (8, or 24 with checksums)."""
        return {name: 8 + 16 * (name in self.folds) for name in self.stamps}

    def host_slot_of(self, pool: str, slot: int) -> "int | None":
        """The host slot device slot ``slot`` of ``pool`` was last loaded from, while it still holds
        the stamp that load moved in (a forward step that wrote the slot since gives it another),
        or ``None``. Reads three values of the device's tables: called for a fault's first
        offender only (on a GPU it waits for the work queued before it)."""
        loaded = self.loaded.get(pool)
        if loaded is None or not 0 <= slot < loaded.shape[0]:
            return None
        host, stamp = (int(v) for v in loaded[slot].tolist())
        now = int(self.provenance.stamps[PROVENANCE_POOLS.index(pool)][slot])
        return host - 1 if host > 0 and now == stamp else None

    def follows(self, pool: str) -> bool:
        """Whether ``pool``'s slots are followed to this tier."""
        return pool in self.stamps

    # ------------------------------------------------------------------ device -> host
    def backup(self, pool: str, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """The device slots ``device_indices`` were copied to the host slots ``host_indices``."""
        if pool not in self.stamps:
            return
        host, dev = self._pair(host_indices, device_indices)
        p = PROVENANCE_POOLS.index(pool)
        self.stamps[pool].index_copy_(0, host, self.provenance.stamps[p].index_select(0, dev).to(self.device))
        if pool in self.folds:
            self.folds[pool].index_copy_(0, host, self.provenance.folds[p].table.index_select(0, dev).to(self.device))
        self._count(pool, "backups", "backed_up_slots", host)

    # ------------------------------------------------------------------ host -> device
    def load_started(self, pool: str, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """A load of the host slots into the device slots began: their stamps move, their folds are
        cleared until :meth:`load_arrived`."""
        if pool not in self.stamps:
            return
        host, dev = self._pair(host_indices, device_indices)
        p = PROVENANCE_POOLS.index(pool)
        target = self.provenance.stamps[p]
        moved = self.stamps[pool].index_select(0, host)
        # host tables live in host memory: this count reads no device
        self.counts[pool]["unfollowed_slots"] += int(moved.eq(0).sum()) if self.device.type == "cpu" else 0
        target.index_copy_(0, dev.to(target.device), moved.to(target.device))
        self.loaded[pool].index_copy_(0, dev.to(target.device),
                                      torch.stack([host + 1, moved], dim=1).to(target.device))
        if pool in self.folds:
            table = self.provenance.folds[p].table
            table.index_fill_(0, dev.to(table.device), 0)
        self._count(pool, "loads", "loaded_slots", host)

    def load_arrived(self, pool: str, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Every layer of a load begun with :meth:`load_started` is on the device: the folds move."""
        if pool not in self.folds:
            return
        host, dev = self._pair(host_indices, device_indices)
        table = self.provenance.folds[PROVENANCE_POOLS.index(pool)].table
        table.index_copy_(0, dev.to(table.device), self.folds[pool].index_select(0, host).to(table.device))

    # ------------------------------------------------------------------ host slots
    def forget(self, pool: str, host_indices: torch.Tensor) -> None:
        """The host slots were handed out anew: nothing is followed there until a backup."""
        if pool not in self.stamps:
            return
        host = host_indices.reshape(-1).to(self.device, torch.int64)
        self.stamps[pool].index_fill_(0, host, 0)
        if pool in self.folds:
            self.folds[pool].index_fill_(0, host, 0)


    def _pair(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
        host = host_indices.reshape(-1)
        dev = device_indices.reshape(-1)
        if host.numel() != dev.numel():
            raise ValueError(f"{host.numel()} host slots paired with {dev.numel()} device slots")
        device = self.provenance.stamps[0].device
        return host.to(self.device, torch.int64), dev.to(device, torch.int64)

    def _count(self, pool: str, calls: str, slots: str, host: torch.Tensor) -> None:
        counts = self.counts[pool]
        counts[calls] += 1
        counts[slots] += int(host.numel())
