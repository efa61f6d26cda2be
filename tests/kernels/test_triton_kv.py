"""The write path's Triton kernels (otel_swa.device.triton_kv) against the torch path they replace,
bit for bit: the folds of each layer's hash (``PoolFolds.add``) and the stamps with the folds' reset
(``write_stamps`` and ``PoolFolds.reset`` as ``KvProvenance.stamp`` runs them) and a sample's
recomputed folds (``PoolFolds.verify``), for fp32, bf16 and
fp16 caches, K and V rows of different sizes, several layers, the FULL and the SWA pool, page sizes 1
and 4, slots out of order, padding slots (0, and -1 clamped to 0 as the torch path clamps it),
decode and extend batches. The cases run on CPU under Triton's interpreter and, marked ``gpu``, on
a CUDA device (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from otel_swa.device.checksum import RowHasher
from otel_swa.device.gate import SamplingGate
from otel_swa.device.kv_folds import FOLD_MARK, PoolFolds, layer_of
from otel_swa.device.provenance import KvProvenance

from kernel_support import compile_for_sm90

FULL_SLOTS, SWA_SLOTS = 64, 40
IDS = (0, 3, 6)


def buffers(dtype, device, slots, seed):
    """``{layer_id: (k_buffer, v_buffer)}``: K rows of 2 x 8 elements, V rows of 2 x 4."""
    gen = torch.Generator().manual_seed(seed)
    return {i: (torch.randn((slots, 2, 8), generator=gen).to(dtype).to(device),
                torch.randn((slots, 2, 4), generator=gen).to(dtype).to(device)) for i in IDS}


def write_locs(page_size: int, loc_dtype) -> torch.Tensor:
    """A step's FULL slots: out of order, with padding (0, -1, repeated)."""
    if page_size == 1:
        loc = [17, 3, 0, 25, 9, 0, -1, 60, 33]
    else:  # two pages of 4 and a part of a third, pages and offsets out of order, then padding
        loc = [p * page_size + o for p in (9, 2) for o in (2, 0, 3, 1)] + [5 * page_size + 1, 5 * page_size, 0, 0]
    return torch.tensor(loc, dtype=loc_dtype)


def swa_mapping(seed: int) -> torch.Tensor:
    """``full_to_swa_index_mapping``: a random SWA slot per FULL slot, 0 (not in the window) for some."""
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.randint(1, SWA_SLOTS, (FULL_SLOTS,), generator=gen)
    mapping[torch.randperm(FULL_SLOTS, generator=gen)[:10]] = 0
    return mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
@pytest.mark.parametrize("page_size,loc_dtype", [(1, torch.int64), (4, torch.int32)], ids=["page1", "page4"])
@pytest.mark.parametrize("given", ["cache_dtype", "float32", "prefix"])
def test_fold_layer_adds_what_pool_folds_add_adds(kernels, device, dtype, swa, page_size, loc_dtype, given):
    slots = SWA_SLOTS if swa else FULL_SLOTS
    prefix = 12 if given == "prefix" else None
    layers = buffers(dtype, "cpu", slots, seed=1)
    loc = write_locs(page_size, loc_dtype)
    mapping = swa_mapping(2)
    # the slots KvProvenance gives PoolFolds.add: clamped, through the mapping for the SWA pool
    written = loc.long().clamp(0, FULL_SLOTS - 1)
    written = mapping.index_select(0, written).clamp(0, slots - 1) if swa else written.clamp(0, slots - 1)
    reference = PoolFolds(slots, torch.device("cpu"), prefix, IDS)
    gen = torch.Generator().manual_seed(3)
    reference.table.copy_(torch.randint(0, 1 << 50, (slots, 2), generator=gen))  # earlier steps' folds
    reference.reset(written)
    table = reference.table.clone().to(device)  # a copy on CPU too
    for layer_id, (kb, vb) in layers.items():
        k = torch.randn((loc.shape[0], *kb.shape[1:]), generator=gen)
        v = torch.randn((loc.shape[0], *vb.shape[1:]), generator=gen)
        if given != "float32":  # else cast by the store (and by the hash) to the cache dtype
            k, v = k.to(dtype), v.to(dtype)
        reference.add(reference.layer(layer_id, kb, vb), k, v, written, capturing=False)
        hasher = RowHasher(kb.to(device), vb.to(device), prefix)
        kernels.fold_layer(table, hasher, k.to(device), v.to(device), layer_id, loc.to(device),
                           mapping.to(device) if swa else None)
    assert torch.equal(table.cpu(), reference.table)
    touched = torch.zeros(slots, dtype=torch.bool)
    touched[written] = True
    assert reference.table[touched, 0].gt(FOLD_MARK).all()  # every written slot folded a hash
    assert torch.equal(table.cpu()[~touched], reference.table[~touched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("prefix", [None, 6], ids=["all", "prefix6"])
def test_verify_folds_gives_what_pool_folds_verify_gives(kernels, device, dtype, prefix):
    """The sample's recomputed folds through the table of buffer addresses: the same ``(written,
    delta)`` as ``PoolFolds.verify`` for clean slots, slots never written, a slot changed in one
    layer's V (its layer named), one changed in two layers' K, slots out of order and repeated."""
    layers = buffers(dtype, device, FULL_SLOTS, seed=20)
    folds = PoolFolds(FULL_SLOTS, device, prefix, IDS)
    written = torch.tensor([40, 7, 22, 5, 13, 31], device=device)
    folds.reset(written)
    for layer_id, (kb, vb) in layers.items():
        folds.add(folds.layer(layer_id, kb, vb), kb[written], vb[written], written, capturing=False)
    vb = layers[3][1]
    vb.view(FULL_SLOTS, -1)[22, :1].view(torch.int8 if dtype != torch.float32 else torch.int32).bitwise_xor_(4)
    for layer_id in (0, 6):
        layers[layer_id][0].view(FULL_SLOTS, -1)[5, :1].view(torch.int8 if dtype != torch.float32 else torch.int32).bitwise_xor_(1)
    slots = torch.tensor([22, 40, 9, 5, 7, 7, 0, 31, 13], device=device)
    got = kernels.verify_folds(folds, slots)
    ref = folds.verify(slots)
    assert got is not None
    assert torch.equal(got[0].cpu(), ref[0].cpu()) and torch.equal(got[1].cpu(), ref[1].cpu())
    assert got[0].tolist() == [True, True, False, True, True, True, False, True, True]
    d1, d2 = got[1][0].tolist()
    assert layer_of(d1, d2, set(IDS)) == 3
    assert got[1][3, 0] != 0 and got[1][[1, 4, 5, 7, 8]].eq(0).all()
    # new buffers for a layer: the table of addresses is made again
    kb, vb = layers[6]
    folds.layer(6, kb.clone(), vb.clone())
    again = kernels.verify_folds(folds, slots)
    assert torch.equal(again[1].cpu(), folds.verify(slots)[1].cpu())
    # a layer of another layout: the kernel does not apply (the caller runs the torch path)
    folds.layer(9, torch.zeros((FULL_SLOTS, 4), dtype=dtype, device=device), torch.zeros((FULL_SLOTS, 4), dtype=dtype, device=device))
    assert kernels.verify_folds(folds, slots) is None


def assert_same_tables(mine: KvProvenance, reference: KvProvenance) -> None:
    """Every stamp and fold equal, but the stamps of slot 0: the padding slot, never live, which
    several tokens of a step may write (which one's stamp stays is the device's choice, as with
    torch's ``index_copy_`` on CUDA; their folds are sums, equal whatever the order)."""
    for ours, theirs in zip(mine.stamps, reference.stamps):
        assert torch.equal(ours.cpu()[1:], theirs[1:])
    for ours, theirs in zip(mine.folds, reference.folds):
        assert torch.equal(ours.table.cpu(), theirs.table)


def make_provenance(device, kernels=None) -> KvProvenance:
    prov = KvProvenance(device, SamplingGate(device), full_slots=FULL_SLOTS, swa_slots=SWA_SLOTS,
                        write_check=False, checksum_order={"full": IDS, "swa": IDS})
    prov.kernels = kernels
    return prov


class Requests:
    """Three requests' ``req_to_token`` rows over FULL slots drawn out of order (row 0: padding)."""

    def __init__(self, width: int, r2t_dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.req_to_token = torch.zeros((4, width), dtype=r2t_dtype)
        free = torch.randperm(FULL_SLOTS - 1, generator=gen) + 1
        for row, take in ((1, slice(0, 20)), (2, slice(20, 24)), (3, slice(24, 63))):
            part = free[take]
            self.req_to_token[row, :part.shape[0]] = part.to(r2t_dtype)
        self.gen = gen


def step(prov: KvProvenance, layers, batch: dict, device, seed: int) -> None:
    """One forward step: the stamp call, then every layer's store and its ``after_layer`` call."""
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    prov.stamp(**on)
    gen = torch.Generator().manual_seed(seed)
    loc = on["out_cache_loc"].long()
    mapping = on["full_to_swa_index_mapping"]
    for swa in (False, True):
        for layer_id, (kb, vb) in layers[swa].items():
            k = torch.randn((loc.shape[0], *kb.shape[1:]), generator=gen).to(device)
            v = torch.randn((loc.shape[0], *vb.shape[1:]), generator=gen).to(device)
            at = mapping.index_select(0, loc) if swa else loc
            kb[at], vb[at] = k.to(kb.dtype), v.to(vb.dtype)
            prov.after_layer(layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=kb, v_buffer=vb, out_cache_loc=on["out_cache_loc"],
                             full_to_swa_index_mapping=mapping)


@pytest.mark.parametrize("dtype,r2t_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64),
                                             (torch.float16, torch.int32)], ids=["fp32", "bf16", "fp16"])
def test_provenance_steps_with_the_kernels_write_the_torch_paths_bits(kernels, device, dtype, r2t_dtype):
    reqs = Requests(320, r2t_dtype, seed=4)
    mapping = swa_mapping(5)
    r2t = reqs.req_to_token
    torch_prov, kernel_prov = make_provenance("cpu"), make_provenance(device, kernels)
    torch_layers = {swa: buffers(dtype, "cpu", SWA_SLOTS if swa else FULL_SLOTS, seed=6 + swa) for swa in (False, True)}
    kernel_layers = {swa: {i: (k.to(device).clone(), v.to(device).clone()) for i, (k, v) in pool.items()}
                     for swa, pool in torch_layers.items()}

    def both(batch, seed):
        step(torch_prov, torch_layers, batch, "cpu", seed)
        step(kernel_prov, kernel_layers, batch, device, seed)
        assert_same_tables(kernel_prov, torch_prov)

    gen = torch.Generator().manual_seed(7)

    def ids(n):
        return torch.randint(0, 1 << 21, (n,), generator=gen)  # ids past 2**20 too (reduced)

    # an extend batch: request 1 positions 0-14, request 2 none (an empty segment), request 3
    # positions 0-259 (two of the kernel's blocks of 256)
    positions = torch.cat([torch.arange(15), torch.arange(260)])
    rows = torch.tensor([1, 2, 3])
    loc = torch.cat([r2t[1, :15], r2t[3, :260].clamp(max=FULL_SLOTS - 1)]).long()
    loc[15 + 39:] = 0  # request 3 is longer than its slots: the rest padding into slot 0
    positions[15 + 39:] = 0
    both(dict(input_ids=ids(275), positions=positions, out_cache_loc=loc, req_pool_indices=rows,
              req_to_token=r2t, full_to_swa_index_mapping=mapping,
              extend_start_loc=torch.tensor([0, 15, 15])), seed=8)
    # a chunked extend: request 1 positions 15-19 (its chain goes on from position 14's stamp),
    # request 2 positions 2-3 (position 1 never stamped: chain unknown)
    positions = torch.tensor([15, 16, 17, 18, 19, 2, 3])
    loc = torch.cat([r2t[1, 15:20], r2t[2, 2:4]]).long()
    both(dict(input_ids=ids(7), positions=positions, out_cache_loc=loc, req_pool_indices=torch.tensor([1, 2]),
              req_to_token=r2t, full_to_swa_index_mapping=mapping,
              extend_start_loc=torch.tensor([0, 5])), seed=9)
    # decode steps: slots out of order, a padding token (row 0, position 0, slot 0)
    for n, seed in ((0, 10), (1, 11)):
        positions = torch.tensor([2 + n, 0, 20 + n, 4 + n])
        rows = torch.tensor([2, 0, 1, 2])
        loc = r2t[rows, positions].long()
        both(dict(input_ids=ids(4), positions=positions, out_cache_loc=loc, req_pool_indices=rows,
                  req_to_token=r2t, full_to_swa_index_mapping=mapping), seed=seed)

    # what the kernels folded verifies against the bytes the buffers hold, by the verify kernel (the
    # provenance's choice) and by the torch path; one flipped bit names its layer
    written = torch.unique(r2t[1, :20]).long().to(device)
    ok, delta = kernel_prov._verify_folds(kernel_prov.folds[0], written)
    assert ok.all() and delta.eq(0).all()
    assert torch.equal(delta, kernel_prov.folds[0].verify(written)[1])
    kb, vb = kernel_layers[False][6]
    vb.view(FULL_SLOTS, -1)[int(written[3]), -1:].view(torch.int8 if dtype != torch.float32 else torch.int32).bitwise_xor_(1)
    ok, delta = kernel_prov._verify_folds(kernel_prov.folds[0], written)
    assert torch.equal(delta, kernel_prov.folds[0].verify(written)[1])
    d1, d2 = delta[3].tolist()
    assert delta[[0, 1, 2, 4]].eq(0).all() and layer_of(d1, d2, set(IDS)) == 6


@pytest.mark.gpu
def test_the_selected_kernels_replayed_in_a_cuda_graph_write_the_torch_paths_bits():
    """On a CUDA cache ``KvProvenance`` picks the kernels (``write_kernels``); a decode step's stamp
    call and layer calls captured once and replayed with three new inputs leave the tables the
    torch path leaves on CPU after the same steps."""
    from otel_swa.device import triton_kv

    device = torch.device("cuda")
    graph_prov, torch_prov = make_provenance(device), make_provenance("cpu")
    assert graph_prov.kernels is triton_kv
    reqs = Requests(64, torch.int32, seed=12)
    mapping = swa_mapping(13)
    torch_layers = {swa: buffers(torch.bfloat16, "cpu", SWA_SLOTS if swa else FULL_SLOTS, seed=14 + swa)
                    for swa in (False, True)}
    graph_layers = {swa: {i: (k.to(device), v.to(device)) for i, (k, v) in pool.items()}
                    for swa, pool in torch_layers.items()}
    rows = torch.tensor([1, 3, 2, 0])  # row 0: a padding entry (position 0, slot 0)
    static = dict(input_ids=torch.zeros(4, dtype=torch.int64, device=device),
                  positions=torch.zeros(4, dtype=torch.int64, device=device),
                  out_cache_loc=torch.zeros(4, dtype=torch.int64, device=device),
                  req_pool_indices=rows.to(device), req_to_token=reqs.req_to_token.to(device),
                  full_to_swa_index_mapping=mapping.to(device))
    kv = {(swa, i): (torch.zeros((4, *k.shape[1:]), device=device), torch.zeros((4, *v.shape[1:]), device=device))
          for swa, pool in graph_layers.items() for i, (k, v) in pool.items()}

    def forward():
        graph_prov.stamp(**static)
        loc = static["out_cache_loc"]
        for (swa, layer_id), (k, v) in kv.items():
            kb, vb = graph_layers[swa][layer_id]
            at = static["full_to_swa_index_mapping"].index_select(0, loc) if swa else loc
            kb.index_copy_(0, at, k.to(kb.dtype))
            vb.index_copy_(0, at, v.to(vb.dtype))
            graph_prov.after_layer(layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=kb, v_buffer=vb,
                                   out_cache_loc=loc, full_to_swa_index_mapping=static["full_to_swa_index_mapping"])

    def inputs(n):
        gen = torch.Generator().manual_seed(100 + n)
        positions = torch.tensor([n, n, n, 0])
        batch = dict(input_ids=torch.randint(0, 1 << 20, (4,), generator=gen), positions=positions,
                     out_cache_loc=reqs.req_to_token[rows, positions].long(), req_pool_indices=rows,
                     req_to_token=reqs.req_to_token, full_to_swa_index_mapping=mapping)
        batch["out_cache_loc"][3] = 0
        given = {key: (torch.randn(k.shape, generator=gen), torch.randn(v.shape, generator=gen))
                 for key, (k, v) in kv.items()}
        return batch, given

    def load(n):
        batch, given = inputs(n)
        for key in ("input_ids", "positions", "out_cache_loc"):
            static[key].copy_(batch[key])
        for key, (k, v) in given.items():
            kv[key][0].copy_(k)
            kv[key][1].copy_(v)
        return batch, given

    def torch_step(batch, given):
        torch_prov.stamp(**batch)
        loc = batch["out_cache_loc"]
        for (swa, layer_id), (k, v) in given.items():
            kb, vb = torch_layers[swa][layer_id]
            at = mapping.index_select(0, loc) if swa else loc
            kb[at], vb[at] = k.to(kb.dtype), v.to(vb.dtype)
            torch_prov.after_layer(layer_id=layer_id, swa=swa, k=k, v=v, k_buffer=kb, v_buffer=vb,
                                   out_cache_loc=loc, full_to_swa_index_mapping=mapping)

    torch_step(*load(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm-up (compiles the kernels): step 0, as the torch path's
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.replay()  # step 0 again: stamps and folds unchanged by a repeat
    for n in range(1, 4):  # request 2 (row 2) has the slots of positions 0-3
        torch_step(*load(n))
        graph.replay()
    torch.cuda.synchronize()
    assert_same_tables(graph_prov, torch_prov)
    assert torch_prov.folds[0].table[:, 0].gt(0).sum() >= 7  # the steps wrote something


@pytest.mark.parametrize("fault_at", [None, 4], ids=["clean", "fault_at_4"])
def test_the_decode_loop_reads_the_same_on_the_kernels(kernels, device, monkeypatch, fault_at):
    """tests/core/decode_loop.py (an extend step, then decode steps with every in-forward check and
    a sample every second step; from step 4 a store at the raw FULL slots) with the kernels chosen
    as KvProvenance chooses them on CUDA: every sample reads as on the torch path, and the fault is a
    corrupt SWA slot from step 4 on."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core"))
    import decode_loop

    monkeypatch.setattr("otel_swa.device.provenance.write_kernels", lambda _device: kernels)
    with_kernels = decode_loop.run(device.type, mode="eager", fault_at=fault_at)
    monkeypatch.setattr("otel_swa.device.provenance.write_kernels", lambda _device: None)
    torch_path = decode_loop.run(device.type, mode="eager", fault_at=fault_at)
    assert [step for step, _ in with_kernels] == [step for step, _ in torch_path] == [2, 4, 6, 8]
    assert [decode_loop.summary(r) for _, r in with_kernels] == [decode_loop.summary(r) for _, r in torch_path]
    for step, reading in with_kernels:
        assert (reading.provenance.corrupt_tokens > 0) == (fault_at is not None and step >= fault_at)
        assert reading.provenance.foreign_tokens == 0 and reading.provenance.stamp_checks > 0


@pytest.mark.parametrize("never_stamped", ["foreign", "unchecked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stage_on_the_kernels_stages_the_torch_paths_cells(kernels, device, never_stamped, dtype):
    """A sample's staged cells (``KvProvenance.stage``: both pools' stamp comparison, recomputed folds,
    counts and first offenders) with the kernels chosen equal the torch path's, bit for bit: a clean
    batch; a foreign stamp and bytes changed in two slots of one pool; a request never stamped
    (foreign or unchecked as ``never_stamped`` says)."""
    from otel_swa.device.provenance import PROVENANCE_WIDTH
    from otel_swa.views import SwaBatch

    reqs = Requests(64, torch.int32, seed=30)
    r2t, mapping = reqs.req_to_token, swa_mapping(31)
    gen = torch.Generator().manual_seed(32)
    provs = {}
    for name, dev, chosen in (("torch", torch.device("cpu"), None), ("kernels", device, kernels)):
        prov = KvProvenance(dev, SamplingGate(dev), full_slots=FULL_SLOTS, swa_slots=SWA_SLOTS, write_check=False,
                            checksum_order={"full": IDS, "swa": IDS}, never_stamped=never_stamped, budget=48)
        prov.kernels = chosen
        provs[name] = prov
    layers = {swa: buffers(dtype, "cpu", SWA_SLOTS if swa else FULL_SLOTS, seed=33 + swa) for swa in (False, True)}
    on = {name: {swa: {i: (k.to(dev).clone(), v.to(dev).clone()) for i, (k, v) in pool.items()}  # copies on CPU too
                 for swa, pool in layers.items()}
          for name, dev in (("torch", "cpu"), ("kernels", device))}
    ids = {1: torch.randint(0, 1000, (20,), generator=gen), 3: torch.randint(0, 1000, (39,), generator=gen)}
    batch = dict(input_ids=torch.cat([ids[1], ids[3]]), positions=torch.cat([torch.arange(20), torch.arange(39)]),
                 out_cache_loc=torch.cat([r2t[1, :20], r2t[3, :39]]).long(), req_pool_indices=torch.tensor([1, 3]),
                 req_to_token=r2t, full_to_swa_index_mapping=mapping, extend_start_loc=torch.tensor([0, 20]))
    for name, dev in (("torch", "cpu"), ("kernels", device)):
        step(provs[name], on[name], batch, dev, seed=34)
    # request 2 (row 2, 4 tokens) is in the batch but was never stamped
    token_ids = [ids[1].tolist(), list(range(4)), ids[3].tolist()]
    rows, lens = torch.tensor([1, 2, 3]), [20, 4, 39]

    def staged(faults: bool) -> dict:
        got = {}
        for name, dev in (("torch", torch.device("cpu")), ("kernels", device)):
            prov = provs[name]
            if faults:
                stamps = prov.stamps[0]
                stamps[int(r2t[1, 7])] = stamps[int(r2t[3, 7])]  # another request's token at the slot
                for slot in (int(r2t[3, 30]), int(r2t[3, 12])):  # bytes changed in layer 3's K
                    on[name][False][3][0][slot].view(-1)[:1].view(torch.int16)[0] += 1
            view = SwaBatch(r2t.to(dev), mapping.to(dev), rows.to(dev), torch.tensor(lens, device=dev),
                            seq_lens_cpu=lens, sliding_window=8, request_ids=[1, 2, 3], token_ids=token_ids)
            out = torch.zeros(PROVENANCE_WIDTH, dtype=torch.int64, device=dev)
            prov.stage(out, view)
            got[name] = out.cpu()
        return got

    for faults in (False, True):
        got = staged(faults)
        diff = [(i, a, b) for i, (a, b) in enumerate(zip(got["kernels"].tolist(), got["torch"].tolist())) if a != b]
        assert not diff, (faults, diff)
    cells = got["torch"]
    # FULL pool: the swapped stamp (and request 2's 4 unstamped slots when they are foreign); one
    # corrupt slot, the other (request 3's position 30) past the budget of 48 of the 63 candidates
    assert cells[2] == 1 + (never_stamped == "foreign") * 4 and cells[9] == 1


# each kernel's pointer arguments and their element types (the rest: int32 scalars)
_POINTERS = {
    "_fold_kernel": {"k_ptr": "*i16", "v_ptr": "*i16", "loc_ptr": "*i64", "map_ptr": "*i64", "table_ptr": "*i64"},
    "_stamp_kernel": {"ids_ptr": "*i64", "pos_ptr": "*i64", "loc_ptr": "*i64", "rpi_ptr": "*i64", "r2t_ptr": "*i32",
                      "starts_ptr": "*i64", "full_ptr": "*i64", "swa_ptr": "*i64", "map_ptr": "*i64",
                      "ffold_ptr": "*i64", "sfold_ptr": "*i64"},
    "_verify_kernel": {"slots_ptr": "*i64", "table_ptr": "*i64", "addr_ptr": "*i64", "stride_ptr": "*i64",
                       "weight_ptr": "*i64", "written_ptr": "*i1", "delta_ptr": "*i64"},
    "_slots_kernel": {"up_ptr": "*i64", "rpi_ptr": "*i64", "r2t_ptr": "*i32", "map_ptr": "*i64", "stamps_ptr": "*i64",
                      "table_ptr": "*i64", "addr_ptr": "*i64", "stride_ptr": "*i64", "weight_ptr": "*i64",
                      "scratch_ptr": "*i64"},
    "_reduce_kernel": {"scratch_ptr": "*i64", "out_ptr": "*i64"},
}


_COMPILED = {
    "fold": ("_fold_kernel", {"SWA": True, "BLOCK": 256}),
    "stamp-decode": ("_stamp_kernel", {"EXTEND": False, "HAS_SWA": True, "FOLDS": True, "SWA_FOLDS": True, "BLOCK": 128}),
    "stamp-extend": ("_stamp_kernel", {"EXTEND": True, "HAS_SWA": True, "FOLDS": True, "SWA_FOLDS": True, "BLOCK": 256}),
    "verify": ("_verify_kernel", {"WORD": 1, "BLOCK": 256}),
    "slots": ("_slots_kernel", {"SWA_POOL": True, "SWA_NAMED": True, "JUDGE_UNSTAMPED": False, "FOLDS": True,
                                "WORD": 4, "BLOCK": 128}),
    "reduce": ("_reduce_kernel", {"SWA_POOL": True, "FOLDS": True, "C_D1": 18, "BLOCK": 1024}),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("triton")
    jobs = {label: (name, _POINTERS[name], constexprs) for label, (name, constexprs) in _COMPILED.items()}
    return compile_for_sm90(jobs, tmp_path_factory.mktemp("triton-cache"))


@pytest.mark.parametrize("label", list(_COMPILED))
def test_every_kernel_compiles_for_a_hopper_gpu_without_one(compiled, label):
    """What the interpreter does not check (the compiler's typing, int64 atomics, addresses read as
    pointers): each kernel compiled by Triton's own pipeline for sm_90 down to a cubin, on CPU."""
    got = compiled[label]
    assert "error" not in got, got.get("error")
    assert "cubin" in got["stages"]
    if label == "fold":
        assert "atom.global.gpu.relaxed.add.u64" in got["ptx"]  # the folds' exact 64-bit sums
