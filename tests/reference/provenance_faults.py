"""Reference engines that put the wrong KV in a slot the tables name, on purpose, from a given step.

Each stands in for one public report of this class (named on its function) and leaves every count
the sample, the audit and the read check look at healthy, or healthy enough that only provenance
(stamps, checksums, the write check: :mod:`otel_swa.device.provenance`) can name the slot:

* :func:`install_swa_write_at_full_index`: sliding-window layers store each new token's K/V at the
  raw FULL slot instead of the translated SWA slot (sgl-project/sglang#20181's class, write indices
  taken from the wrong pool; the write-side twin of sglang 0.5.23's torch-native read bug). The
  attention still reads through the mapping, so the read check agrees with it.
* :func:`install_swapped_ownership`: two requests' new tokens' SWA mapping entries swapped after
  their K/V was written: each token now reads the other's KV, both slots live, every count right.
* :func:`install_stale_prefix`: a request's first positions in ``req_to_token`` name FULL slots that
  hold another request's KV, as a stale radix-cache / prefix entry re-used after its slots were
  taken by others (sgl-project/sglang#31486, #30339, #25889).
* :func:`install_wrong_position`: a token's KV written with a wrong position (one past its own):
  sgl-project/sglang#33656 (DeepSeek-V4 + HiCache wrote SWA positions wrong; SGLang's KV canary
  caught it by the position in its stamps).
* :func:`install_byte_flip`: one byte of a K row flipped after the write, in the first layer of the
  FULL or of the SWA pool: SGLang's KV canary perturbations ``real_kv_post_forward`` (a slot just
  written) and ``real_kv_used`` (a slot of an earlier token still in use), which flip byte 0 of a
  slot's K row in layer 0 of a sub-pool (``sglang/srt/kv_canary/perturb/utils.py``).
* :func:`install_bit_flip_past_the_prefix` and :func:`install_stray_write_in_the_last_layer`: what
  a checksum of one layer's first bytes misses (issue 32, made in the real sglang Engine): one bit
  past a row's first 64 bytes, and a stray write in the model's last layer only.

Each takes ``at``: the forward step (the engine's ``forward_ct``) whose forward the fault corrupts,
and records what it did in ``engine.fault_log`` (a list of dicts) so a test can name the offender
it expects.
"""

from __future__ import annotations

import dataclasses

import torch


def _wrap_forward(engine, before=None, after=None) -> None:
    """Wrap ``engine.model.forward``: ``before(batch) -> batch`` and ``after(batch)`` run at the
    forward of each step (the step's ``forward_ct`` is ``engine.forward_ct + 1`` then)."""
    original = engine.model.forward
    engine.fault_log = []

    def forward(batch, pools, kv, *args, **kwargs):
        step = engine.forward_ct + 1
        if before is not None:
            batch = before(step, batch)
        out = original(batch, pools, kv, *args, **kwargs)
        if after is not None:
            after(step, batch)
        return out

    engine.model.forward = forward


def _decode_tokens(engine, batch) -> list:
    """``(entry, token index, request)`` of the decode items of the step being run."""
    items = engine.scheduler_plan
    out, at = [], 0
    for entry, item in enumerate(items):
        if item.decode:
            out.append((entry, at, item.req))
        at += item.extend_len
    return out


def _remember_plan(engine) -> None:
    """Keep the scheduler's plan of the step being run on ``engine.scheduler_plan``."""
    schedule = engine.scheduler.schedule

    def plan(*args, **kwargs):
        engine.scheduler_plan = schedule(*args, **kwargs)
        return engine.scheduler_plan

    engine.scheduler.schedule = plan


def _after_step(engine, at: int, fault) -> None:
    """Make ``fault(step, batch, decodes)`` after the forward of step ``at`` (``decodes``: the batch's
    decode tokens, ``(entry, token, request)`` each)."""
    _remember_plan(engine)

    def after(step, batch):
        if step == at:
            fault(step, batch, _decode_tokens(engine, batch))

    _wrap_forward(engine, after=after)


def install_swa_write_at_full_index(engine, at: int = 1) -> None:
    """From step ``at``, the sliding-window layer stores K/V at the raw FULL slots (sgl-project/sglang#20181
    class). Needs an SWA pool at least as large as the FULL pool (the raw slots stay inside it)."""

    def before(step, batch):
        if step < at:
            return batch
        return dataclasses.replace(batch, swa_slots=batch.full_slots)

    _wrap_forward(engine, before=before)


def install_swapped_ownership(engine, at: int) -> None:
    """At step ``at``, after the forward, the SWA mapping entries of the first two decode tokens of
    the batch are swapped (each request now reads the other's KV)."""
    def swap(step, batch, decodes):
        (entry_a, token_a, req_a), (entry_b, token_b, req_b) = decodes[:2]
        mapping = engine.pools.full_to_swa_index_mapping
        full_a, full_b = int(batch.full_slots[token_a]), int(batch.full_slots[token_b])
        swa_a, swa_b = int(mapping[full_a]), int(mapping[full_b])
        mapping[full_a], mapping[full_b] = swa_b, swa_a
        engine.fault_log.append(dict(step=step, entry=entry_a, position=int(batch.positions[token_a]), full_slot=full_a,
                                     swa_slot=swa_b, found_position=int(batch.positions[token_b]),
                                     found_token=int(batch.token_ids[token_b]) % (1 << 20),
                                     expected_token=int(batch.token_ids[token_a]) % (1 << 20), request=req_a.rid))

    _after_step(engine, at, swap)


def install_stale_prefix(engine, at: int, positions: int = 4) -> None:
    """At step ``at``, after the forward, the first ``positions`` entries of the first decode
    request's ``req_to_token`` row name the FULL slots the second decode request holds at the same
    positions (a stale prefix hit on slots that hold other KV)."""
    def stale(step, batch, decodes):
        (entry_a, _, req_a), (entry_b, _, req_b) = decodes[:2]
        r2t = engine.pools.req_to_token
        row_a, row_b = req_a.slots.row, req_b.slots.row
        r2t[row_a, :positions] = r2t[row_b, :positions]
        ids_b = [int(t) for t in req_b.prompt_ids[:positions]]
        ids_a = [int(t) for t in req_a.prompt_ids[:positions]]
        engine.fault_log.append(dict(step=step, entry=entry_a, request=req_a.rid, row=row_a,
                                     full_slots=[int(s) for s in r2t[row_b, :positions]], ids_a=ids_a, ids_b=ids_b))

    _after_step(engine, at, stale)


def install_wrong_position(engine, at: int) -> None:
    """At step ``at`` the engine gives the first decode token of the batch its position plus one: the
    step's forward computes and writes its KV there (sgl-project/sglang#33656)."""
    _remember_plan(engine)
    make = engine._forward_batch
    engine.fault_log = []

    def forward_batch(items, full_slots, swa_slots):
        batch = make(items, full_slots, swa_slots)
        step = engine.forward_ct + 1
        if step != at:
            return batch
        entry, token, req = _decode_tokens(engine, batch)[0]
        positions = batch.positions.clone()
        positions[token] += 1
        engine.fault_log.append(dict(step=step, entry=entry, request=req.rid, position=int(batch.positions[token]),
                                     full_slot=int(batch.full_slots[token]), token=int(batch.token_ids[token])))
        return dataclasses.replace(batch, positions=positions)

    engine._forward_batch = forward_batch


def install_byte_flip(engine, at: int, pool: str, used: bool = False) -> None:
    """At step ``at``, byte 0 of a K row of the first layer of ``pool`` (``"full"``: the full
    attention layer's K at the FULL slot; ``"swa"``: the sliding-window layer's at the SWA slot) is
    flipped (xor 0xFF): after the forward, in the row just written for the first decode token
    (``real_kv_post_forward``), or with ``used`` before the forward, in the row of that request's
    previous position (``real_kv_used``: a slot in use)."""
    _remember_plan(engine)

    def flip(step, batch, offset):
        entry, token, req = _decode_tokens(engine, batch)[0]
        position = int(batch.positions[token]) - offset
        full = int(engine.pools.req_to_token[req.slots.row, position])
        slot = full if pool == "full" else int(engine.pools.full_to_swa_index_mapping[full])
        buffer = engine.kv.full_k if pool == "full" else engine.kv.swa_k
        row = buffer[slot].view(-1).view(torch.uint8)
        row[0] ^= 0xFF
        engine.fault_log.append(dict(step=step, entry=entry, request=req.rid, position=position, full_slot=full,
                                     swa_slot=int(engine.pools.full_to_swa_index_mapping[full]), pool=pool))

    def before(step, batch):
        if used and step == at:
            flip(step, batch, 1)
        return batch

    def after(step, batch):
        if not used and step == at:
            flip(step, batch, 0)

    _wrap_forward(engine, before=before, after=after)


def install_bit_flip_past_the_prefix(engine, at: int, pool: str = "swa") -> None:
    """At step ``at``, before the forward, one bit flipped past the first 64 bytes of a live V row: the
    sign bit of the last element of the V row of the first decode request's previous position, in
    ``pool``'s layer (issue 32's report: in the real sglang Engine this changed 2 of 20 outputs while
    every check passed, the checksum covering the first 64 bytes; SGLang's KV canary hashes only the
    first bytes of ``k_buffer[0]`` / ``v_buffer[0]`` of a sub-pool, ``pool_patcher/adapters/swa.py``).
    Needs V rows over 64 bytes (``num_heads * head_dim * 4 > 64``)."""
    _remember_plan(engine)

    def before(step, batch):
        if step != at:
            return batch
        entry, token, req = _decode_tokens(engine, batch)[0]
        position = int(batch.positions[token]) - 1
        full = int(engine.pools.req_to_token[req.slots.row, position])
        swa = int(engine.pools.full_to_swa_index_mapping[full])
        buffer = engine.kv.full_v if pool == "full" else engine.kv.swa_v
        row = buffer[full if pool == "full" else swa].view(-1).view(torch.uint8)
        assert row.shape[0] > 64
        row[-1] ^= 0x80  # little-endian float32: the last byte holds the sign bit
        engine.fault_log.append(dict(step=step, entry=entry, request=req.rid, position=position, full_slot=full,
                                     swa_slot=swa, pool=pool, layer=0 if pool == "full" else 1))
        return batch

    _wrap_forward(engine, before=before)


def install_stray_write_in_the_last_layer(engine, at: int) -> None:
    """At step ``at``, after the forward, the K and V just written for the second decode token are
    copied over the live in-window SWA slot of the first decode request's previous position, in the
    model's LAST layer only (the sliding-window layer, layer 1): a stray write of one deep layer, as
    issue 32 made inside the real sglang Engine (another request's fresh K/V over a live slot of the
    last sliding-window layer: 5 of 20 outputs changed, every check passed; a checksum of one
    designated layer, or SGLang's KV canary's ``k_buffer[0]``, never sees a deeper layer)."""
    def stray(step, batch, decodes):
        (entry_a, token_a, req_a), (_, token_b, _) = decodes[:2]
        mapping = engine.pools.full_to_swa_index_mapping
        position = int(batch.positions[token_a]) - 1
        full = int(engine.pools.req_to_token[req_a.slots.row, position])
        swa, source = int(mapping[full]), int(mapping[int(batch.full_slots[token_b])])
        engine.kv.swa_k[swa] = engine.kv.swa_k[source]
        engine.kv.swa_v[swa] = engine.kv.swa_v[source]
        engine.fault_log.append(dict(step=step, entry=entry_a, request=req_a.rid, position=position, full_slot=full,
                                     swa_slot=swa, pool="swa", layer=1))

    _after_step(engine, at, stray)
