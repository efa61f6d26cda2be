"""Fault injections into a real sglang 0.5.23 Engine, for the engine suite's bug zoo (never for users).

Each re-creates one class of published SWA KV cache bug inside the real engine, in the scheduler
process. ``OTEL_SWA_TEST_SGLANG_FAULT`` (set by the engine tests, read at interpreter start-up
through the shims' ``.pth`` file, only with the scheduler probe on) names one fault, made from
forward step ``OTEL_SWA_TEST_SGLANG_FAULT_AT_STEP`` (default 20) on, or a comma list
``name@step,name@step,...`` of faults made one after the other in one engine run (see
:class:`Gate`).

Table, bookkeeping and window faults (each a module of its own):

``torch_native_raw_read``
    sglang 0.5.23's own ``TorchNativeAttnBackend`` SWA read (writes sliding-window layers at the
    translated SWA slot, reads them at the raw FULL slot of ``req_to_token``): the CPU shims' fix
    (``sglang_cpu_patches``) is simply not applied, from the first step.
``early_eviction``
    :mod:`fault_sglang_8649_early_eviction`: the SWA eviction bound one page early.
``leak_on_free``
    :mod:`fault_sglang_29860_leak_on_free`: one freed SWA page never returned to the free list.
``freed_while_mapped``
    :mod:`fault_sglang_27586_freed_while_mapped`: a live request's in-window SWA page freed while
    still mapped, then handed out again.

Provenance faults (what a slot holds against what the tables say it holds), each made once, at
one forward step, on the requests of the batch closest to finishing:

``wrong_position``
    :mod:`fault_sglang_33656_wrong_position`: one new token's position one too far.
``swapped_ownership``
    :mod:`fault_swapped_ownership`: two requests' new tokens' SWA mapping entries exchanged after
    their KV was written.
``stale_write_loc``
    :mod:`fault_sglang_25889_stale_write_loc`: one new token's KV written into another request's
    live slot.
``write_raw``
    :mod:`fault_sglang_23984_write_raw`: one new token's sliding-window KV stored at its raw FULL
    index instead of its SWA slot.
``stale_prefix``
    :mod:`fault_sglang_31486_stale_prefix`: at a prefix-cache hit, a window-evicted SWA slot put
    back into the mapping of a matched token (re-cached stale KV).
``deep_layer_write``
    :mod:`fault_deep_layer_stray_write`: another request's K/V written over a live slot of the last
    sliding-window layer only.
``v_sign_bit_flip``
    :mod:`fault_v_sign_bit_flip`: the sign bit of the last element of a live V row (past its first
    64 bytes) of the last layer flipped.

Faults of HiCache's host tier (:mod:`fault_hicache_tier`, one module for the four; the engine
suite's HiCache runs): ``hicache_load_bytes_changed``, ``hicache_load_wrong_slots``,
``hicache_stale_host_copy``, ``hicache_skipped_swa_backup``.

Every injection that took effect appends ``{"pid", "fault", "step", ...}`` to
``faults-<pid>.jsonl`` in the probe's directory: ``step`` is the first forward step whose sample can
see the fault (the test compares the first detection with it); provenance faults add ``requests``
(the ids of the requests whose KV they touched) and what they changed.
"""

from __future__ import annotations

import json
import os

FAULTS = ("torch_native_raw_read", "early_eviction", "leak_on_free", "freed_while_mapped",
          "wrong_position", "swapped_ownership", "stale_write_loc", "write_raw", "stale_prefix",
          "deep_layer_write", "v_sign_bit_flip", "hicache_load_bytes_changed", "hicache_load_wrong_slots",
          "hicache_stale_host_copy", "hicache_skipped_swa_backup")

#: fault -> the module that makes it
_MODULES = {
    "early_eviction": "fault_sglang_8649_early_eviction",
    "leak_on_free": "fault_sglang_29860_leak_on_free",
    "freed_while_mapped": "fault_sglang_27586_freed_while_mapped",
    "wrong_position": "fault_sglang_33656_wrong_position",
    "swapped_ownership": "fault_swapped_ownership",
    "stale_write_loc": "fault_sglang_25889_stale_write_loc",
    "write_raw": "fault_sglang_23984_write_raw",
    "stale_prefix": "fault_sglang_31486_stale_prefix",
    "deep_layer_write": "fault_deep_layer_stray_write",
    "v_sign_bit_flip": "fault_v_sign_bit_flip",
}
#: The faults that take a :class:`Gate` (made once each, one after the other).
GATED = ("wrong_position", "swapped_ownership", "stale_write_loc", "write_raw", "stale_prefix", "deep_layer_write",
         "v_sign_bit_flip")


def at_step() -> int:
    """The forward step from which a single fault is on."""
    return int(os.environ.get("OTEL_SWA_TEST_SGLANG_FAULT_AT_STEP", "20") or 20)


def parse_spec(spec: str) -> list[tuple[str, int]]:
    """``"name"`` or ``"name@step,name@step"`` as ``[(name, step)]`` (a name without a step: :func:`at_step`)."""
    faults = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, step = part.partition("@")
        if name not in FAULTS:
            raise ValueError(f"OTEL_SWA_TEST_SGLANG_FAULT names {name!r}; expected one of {', '.join(FAULTS)}")
        faults.append((name, int(step) if step else at_step()))
    return faults


def record(fault: str, step: int, **details) -> None:
    """Note in the probe's directory that ``fault`` took effect at ``step``."""
    path = os.path.join(os.environ["OTEL_SWA_TEST_SGLANG_PROBE"], f"faults-{os.getpid()}.jsonl")
    with open(path, "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "fault": fault, "step": step, **details}) + "\n")


class Gate:
    """One provenance fault at a time, each seen apart from the others.

    A fault is made at a step ``>= at_step`` that is a multiple of ``align``
    (``OTEL_SWA_TEST_SGLANG_FAULT_ALIGN``, the tests' sampling interval: the fault is made at a
    sampled step; ``stale_prefix`` waits for a prefix-cache hit at any step), once every request an earlier fault touched has been out of the batches for
    more than ``align`` steps (so a clean sample lies between two faults), and after the fault
    before it in the list was made. :meth:`observe` is called with every batch's request ids.
    """

    def __init__(self, align: int) -> None:
        self.align = max(1, align)
        self.victims: set = set()
        self.last_seen = 0
        self.made_count = 0

    def observe(self, step: int, request_ids) -> None:
        if self.victims and self.victims.intersection(request_ids or ()):
            self.last_seen = step

    def ready(self, step: int, at: int, order: int, aligned: bool = True) -> bool:
        """Whether the fault ``order`` (its place in the list) may be made at ``step``; ``aligned``
        False: at any step (a fault that needs a rare kind of step, a prefix-cache hit)."""
        return (order == self.made_count and step >= at and (not aligned or step % self.align == 0)
                and (not self.victims or step - self.last_seen > self.align))

    def made(self, step: int, request_ids) -> None:
        self.victims.update(request_ids)
        self.last_seen = step
        self.made_count += 1


def closest_to_finishing(batch, count: int = 1) -> list[int]:
    """Indices into ``batch.reqs`` (a ``ScheduleBatch``) of the ``count`` requests with the fewest
    output tokens left (``sampling_params.max_new_tokens - len(output_ids)``, at least 1 left),
    fewest first; fewer when the batch has fewer."""
    reqs = list(getattr(batch, "reqs", None) or ())
    left = [(int(r.sampling_params.max_new_tokens) - len(r.output_ids), i) for i, r in enumerate(reqs)]
    return [i for n, i in sorted(left) if n >= 1][:count]


def decode_pair(forward_batch, step: int, gate, at_step: int, order: int) -> "tuple | None":
    """``(schedule batch, [entry, entry])``: the scheduler's batch and the two requests of a decode
    step closest to finishing, when ``gate`` lets a fault be made at this step; ``None`` otherwise
    (not ready, not a decode step, fewer than two requests, or the forward batch is not the
    scheduler's whole batch)."""
    if not gate.ready(step, at_step, order) or not forward_batch.forward_mode.is_decode():
        return None
    import sglang_step_probe

    batch = sglang_step_probe.current_batch()
    picked = closest_to_finishing(batch, 2)
    if len(picked) < 2 or forward_batch.batch_size != len(batch.reqs):
        return None
    return batch, picked


def last_layer(pool, swa: bool) -> "tuple[int, int]":
    """``(layer id, index into its sub-pool's buffers)`` of the last attention layer of the SWA
    (``swa``) or FULL kind of a ``SWAKVPool`` (its ``layers_mapping``)."""
    return max((layer_id, index) for layer_id, (index, is_swa) in pool.layers_mapping.items() if is_swa == swa)


def install(spec: str) -> None:
    faults = parse_spec(spec)
    align = int(os.environ.get("OTEL_SWA_TEST_SGLANG_FAULT_ALIGN", "1") or 1)
    gate = None
    if any(name in GATED for name, _ in faults):
        import sglang_step_probe

        gate = Gate(align)
        sglang_step_probe.on_forward_batch(lambda forward_batch, step: gate.observe(step, forward_batch.rids))
    order = 0
    for name, step in faults:
        if name == "torch_native_raw_read":
            _install_raw_read()
        elif name.startswith("hicache_"):
            import fault_hicache_tier

            fault_hicache_tier.install(name, step)
        elif name in GATED:
            __import__(_MODULES[name]).install(step, gate, order)
            order += 1
        else:
            __import__(_MODULES[name]).install(step)


def _install_raw_read() -> None:
    import sglang_step_probe

    def first(runner, forward_batch, step, line, done=[]):  # noqa: B006 - once per process
        if not done:
            done.append(step)
            record("torch_native_raw_read", step)

    sglang_step_probe.after_forward(first)
