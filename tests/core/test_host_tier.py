"""The host tables of a KV host tier (otel_swa.device.host_tier) against plain-Python bookkeeping of
which token's stamp and folds each device and host slot must hold after backups, loads and host
allocations."""

from __future__ import annotations

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.host_tier import HostTier
from otel_swa.device.provenance import KvProvenance


def provenance(checksum: str = "all") -> KvProvenance:
    made = KvProvenance("cpu", SamplingGate("cpu"), full_slots=16, swa_slots=8, checksum=checksum)
    # device tables with values that name their slot: stamp -(100 + slot), folds (1000 + slot, 2000 + slot)
    for p, slots in ((0, 16), (1, 8)):
        made.stamps[p].copy_(-100 - torch.arange(slots))
        if made.folds[p] is not None:
            made.folds[p].table.copy_(torch.stack([1000 + torch.arange(slots), 2000 + torch.arange(slots)], 1))
    return made


def test_a_backup_then_a_load_carries_stamps_and_folds_to_the_host_and_back():
    device = provenance()
    tier = HostTier(device, {"full": 10, "swa": 6})
    tier.backup("full", torch.tensor([7, 2, 9]), torch.tensor([3, 4, 5]))
    tier.backup("swa", torch.tensor([0, 1]), torch.tensor([6, 2]))
    assert tier.stamps["full"].tolist() == [0, 0, -104, 0, 0, 0, 0, -103, 0, -105]
    assert tier.folds["full"][[7, 2, 9]].tolist() == [[1003, 2003], [1004, 2004], [1005, 2005]]
    assert tier.stamps["swa"][:2].tolist() == [-106, -102]
    # the device slots are reused meanwhile (a forward step stamps them anew)
    device.stamps[0][[3, 4, 5]] = -1
    # loaded back into other device slots: the stamps at once, the folds cleared until every layer arrived
    tier.load_started("full", torch.tensor([9, 7]), torch.tensor([11, 12]))
    assert device.stamps[0][[11, 12]].tolist() == [-105, -103]
    assert device.folds[0].table[[11, 12]].tolist() == [[0, 0], [0, 0]]
    tier.load_arrived("full", torch.tensor([9, 7]), torch.tensor([11, 12]))
    assert device.folds[0].table[[11, 12]].tolist() == [[1005, 2005], [1003, 2003]]
    # the SWA pool's tables are its own
    tier.load_started("swa", torch.tensor([1]), torch.tensor([7]))
    tier.load_arrived("swa", torch.tensor([1]), torch.tensor([7]))
    assert (device.stamps[1][7].item(), device.folds[1].table[7].tolist()) == (-102, [1002, 2002])
    assert device.stamps[0][7].item() == -107  # untouched
    assert tier.counts == {
        "full": {"backups": 1, "backed_up_slots": 3, "loads": 1, "loaded_slots": 2, "unfollowed_slots": 0},
        "swa": {"backups": 1, "backed_up_slots": 2, "loads": 1, "loaded_slots": 1, "unfollowed_slots": 0}}


def test_host_slots_handed_out_anew_hold_nothing_and_a_load_of_them_is_counted_unfollowed():
    device = provenance()
    tier = HostTier(device, {"full": 4})
    tier.backup("full", torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]))
    tier.forget("full", torch.tensor([1]))
    assert tier.stamps["full"].tolist() == [-105, 0, -107, 0]
    assert tier.folds["full"][1].tolist() == [0, 0]
    tier.load_started("full", torch.tensor([0, 1, 3]), torch.tensor([12, 13, 14]))
    tier.load_arrived("full", torch.tensor([0, 1, 3]), torch.tensor([12, 13, 14]))
    assert device.stamps[0][[12, 13, 14]].tolist() == [-105, 0, 0]
    assert device.folds[0].table[[12, 13, 14]].tolist() == [[1005, 2005], [0, 0], [0, 0]]
    assert tier.counts["full"]["unfollowed_slots"] == 2
    assert not tier.follows("swa")  # never added: its moves do nothing
    tier.backup("swa", torch.tensor([0]), torch.tensor([1]))


def test_without_checksums_only_stamps_move_and_the_host_tables_take_8_bytes_a_slot():
    device = provenance(checksum="off")
    tier = HostTier(device, {"full": 4, "swa": 4})
    assert tier.bytes_per_host_slot == {"full": 8, "swa": 8}
    assert HostTier(provenance(), {"full": 4, "swa": 4}).bytes_per_host_slot == {"full": 24, "swa": 24}
    tier.backup("swa", torch.tensor([3]), torch.tensor([5]))
    tier.load_started("swa", torch.tensor([3]), torch.tensor([0]))
    tier.load_arrived("swa", torch.tensor([3]), torch.tensor([0]))
    assert device.stamps[1][0].item() == -105 and tier.folds == {}


@pytest.mark.parametrize("pools, message", [({"kv": 4}, "is not one of"), ({"full": 0}, "int >= 1")])
def test_bad_pools_and_paired_lengths_are_refused(pools, message):
    with pytest.raises(ValueError, match=message):
        HostTier(provenance(), pools)
    tier = HostTier(provenance(), {"full": 4})
    with pytest.raises(ValueError, match="2 host slots paired with 1 device slots"):
        tier.backup("full", torch.tensor([0, 1]), torch.tensor([2]))


def test_kv_loaded_back_into_other_slots_is_verified_as_live_and_never_judged_before_it_arrived():
    from test_provenance import Engine  # the tiny hybrid cache driven through KvProvenance

    engine = Engine([12, 9])
    tier = HostTier(engine.prov, {"full": 64, "swa": 64})
    full = engine.r2t[1, :12].long()
    swa = engine.mapping[full]
    host = torch.arange(12)
    tier.backup("full", host, full)
    tier.backup("swa", host + 20, swa)
    saved = [b[s].clone() for b, s in ((engine.k, full), (engine.v, full), (engine.swa_k, swa), (engine.swa_v, swa))]
    # evicted from the device, the slots overwritten by other bytes, then loaded back elsewhere
    for buffer, slots in ((engine.k, full), (engine.v, full), (engine.swa_k, swa), (engine.swa_v, swa)):
        buffer[slots] = 9.0
    new_full = torch.arange(200, 212)
    new_swa = engine.mapping[new_full]
    engine.r2t[1, :12] = new_full.int()
    # the slots loaded into held other KV before (their folds written, their bytes those folds' no more)
    engine.prov.folds[0].table[new_full] = torch.tensor([(1 << 62) + 5, 7])
    engine.prov.folds[1].table[new_swa] = torch.tensor([(1 << 62) + 5, 7])
    tier.load_started("full", host, new_full)
    tier.load_started("swa", host + 20, new_swa)
    # no layer arrived yet: the stamps name the right tokens, the loaded slots' bytes are not judged
    got = engine.verify()
    assert (got.foreign_tokens, got.corrupt_tokens) == (0, 0)
    assert got.checksum_checks == 2 * 9 and got.stamp_checks == 2 * 21
    # every layer arrived
    engine.k[new_full], engine.v[new_full], engine.swa_k[new_swa], engine.swa_v[new_swa] = saved
    tier.load_arrived("full", host, new_full)
    tier.load_arrived("swa", host + 20, new_swa)
    got = engine.verify()
    assert (got.foreign_tokens, got.corrupt_tokens, got.checksum_checks) == (0, 0, 2 * 21)
    # a loaded slot's bytes changed after the load: corrupt, named by its new slot
    engine.k[int(new_full[4]), 0, 0] += 0.5
    got = engine.verify()
    assert got.corrupt_tokens == 1
    assert (got.corrupt_offender["pool"], got.corrupt_offender["full_slot"], got.corrupt_offender["position"]) == (
        "full", 204, 4)
    # and by the host slot it was loaded from (the load moved stamp and folds there from host slot 4)
    assert got.corrupt_offender["host_slot"] == 4
    # the request's slot 204 written by a forward step since (another stamp): no host slot is named
    engine.prov.stamps[0][204] = -1
    assert tier.host_slot_of("full", 204) is None and tier.host_slot_of("full", 205) == 5


def test_a_device_slot_names_the_host_slot_of_its_last_load_while_it_holds_that_loads_stamp():
    device = provenance()
    tier = HostTier(device, {"full": 10, "swa": 6})
    assert tier.host_slot_of("full", 3) is None  # never loaded
    tier.backup("full", torch.tensor([7, 2]), torch.tensor([3, 4]))
    tier.load_started("full", torch.tensor([7, 2]), torch.tensor([11, 12]))
    tier.load_started("full", torch.tensor([2]), torch.tensor([13]))  # the same host slot loaded twice
    assert [tier.host_slot_of("full", s) for s in (11, 12, 13, 3)] == [7, 2, 2, None]
    tier.load_started("full", torch.tensor([7]), torch.tensor([12]))  # a later load into slot 12
    assert tier.host_slot_of("full", 12) == 7
    assert tier.host_slot_of("swa", 12) is None and tier.host_slot_of("full", 99) is None  # not loaded, no such slot
