"""SGLang's own KV canary perturbation self-tests, run one at a time inside a real sglang 0.5.23
Engine, as faults made by someone else (engine suite only, never for users).

sglang 0.5.23's canary can corrupt its own engine on purpose (``srt/kv_canary/perturb/``, switched
on by ``SGLANG_KV_CANARY_PERTURB_<MODE>_PROB``, ``_TARGET_GROUP`` full|swa and ``_WARMUP_STEPS``,
read once when the canary is built): ``req_to_token`` points a live ``req_to_token`` entry at
another active request's slot; ``real_kv_used`` flips the first byte of a slot in use (first layer of
the target pool's K buffer) before a forward; ``real_kv_unused_cache`` flips one of a slot only the
radix cache holds, on the canary's sweep steps; ``real_kv_post_forward`` flips one of a slot the
forward just wrote. With the variables, every mode fires at every step after the warm-up, and what
one corrupts stays: two modes in one run could not be told apart.

``OTEL_SWA_TEST_SGLANG_PERTURB="mode:group@step,mode:group@step,..."`` runs them in turn instead, each
through SGLang's own code (its slot choice, its flip, its log line ``kv_canary perturb ...``): at the
first forward step ``>= step`` that is a multiple of ``OTEL_SWA_TEST_SGLANG_FAULT_ALIGN`` (the tests'
sampling interval) and comes after the previous mode was undone and a clean sample was taken,
the canary's ``PerturbManager`` is given a configuration with that one mode at probability 1 (the
target group, no warm-up) for that forward step only. What SGLang changed is read back (the flipped
byte through ``perturb.utils.flip_first_byte_in_source``, the ``req_to_token`` entries by
comparison) and undone so that the next mode starts from a clean engine: a ``req_to_token`` entry
before SGLang processes that step's results (before a finished request could free the slot it names),
a flipped byte after the next sampled step (so that the canary's next verify, a step later for
``real_kv_post_forward``, sees it too), unless a new write has replaced it. A mode SGLang skipped
(no candidate slot) is tried again at the next aligned step. After a ``req_to_token`` mode the next
one also waits until the request whose entry was changed has left the batches (the tokens it wrote
while the entry pointed elsewhere carry a chain stamp seeded from the other slot, in SGLang's canary
as in otel-swa).

Each mode made appends ``{"pid", "perturbation", "group", "step", "changes", "undone_at"}`` to
``perturb-<pid>.jsonl`` in the probe's directory.
"""

from __future__ import annotations

import json
import os

import sglang_cpu_patches
import sglang_step_probe

MODES = ("req_to_token", "real_kv_used", "real_kv_unused_cache", "real_kv_post_forward")
GROUPS = ("full", "swa")
_PERTURB = "sglang.srt.kv_canary.perturb"


def parse_spec(spec: str) -> list[tuple[str, str, int]]:
    """``"mode:group@step,..."`` as ``[(mode, group, step)]``."""
    phases = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        head, _, step = part.partition("@")
        mode, _, group = head.partition(":")
        if mode not in MODES or group not in GROUPS or not step.isdigit():
            raise ValueError(f"OTEL_SWA_TEST_SGLANG_PERTURB part {part!r}; expected mode:group@step with a mode of "
                             f"{', '.join(MODES)} and a group of {', '.join(GROUPS)}")
        phases.append((mode, group, int(step)))
    return phases


class _Phases:
    def __init__(self, phases: list, align: int) -> None:
        self.pending = list(phases)
        self.align = max(1, align)
        self.active = None  # the phase configured for the current forward step
        self.made = None  # the phase made, waiting to be undone
        self.next_allowed = 0
        self.flips: list = []
        self.entries: list = []
        # a req_to_token entry read while pointed elsewhere seeds the chain stamps of the tokens
        # written after it (SGLang's and otel-swa's): the next mode waits for that request to go
        self.victims: set = set()
        self.last_seen = 0

    # ---------------------------------------------------------------- SGLang's configuration
    def configure(self, runner, forward_batch, step) -> None:
        self._track_writes(runner, forward_batch)
        if self.victims.intersection(forward_batch.rids or ()):
            self.last_seen = step
        if self.active is not None or self.made is not None or not self.pending:
            return
        mode, group, at = self.pending[0]
        if step < max(at, self.next_allowed, self.last_seen + self.align + 1) or step % self.align:
            return
        manager = getattr(getattr(runner, "canary_manager", None), "_perturb_manager", None)
        if manager is None:
            return
        from sglang.srt.kv_canary.perturb.config import PerturbConfig, TargetGroupKind

        probs = {name: 1.0 if name == mode else 0.0 for name in MODES}
        config = PerturbConfig(
            req_to_token_prob=probs["req_to_token"], real_kv_used_prob=probs["real_kv_used"],
            real_kv_unused_cache_prob=probs["real_kv_unused_cache"],
            real_kv_post_forward_prob=probs["real_kv_post_forward"],
            target_group_kind=TargetGroupKind[group.upper()], warmup_steps=0,
        )
        self.saved = (manager._config, manager._warmup_gate._config, manager._sweep_interval)
        manager._config = manager._warmup_gate._config = config
        manager._sweep_interval = 1  # real_kv_unused_cache runs on sweep steps only: this one is one
        self.active = (mode, group, step, manager)
        self.flips, self.entries = [], []

    def restore(self, runner, forward_batch, step, line) -> None:
        if self.active is None:
            return
        mode, group, made_at, manager = self.active
        manager._config, manager._warmup_gate._config, manager._sweep_interval = self.saved
        self.active = None
        if not self.flips and not self.entries:
            return  # SGLang found nothing to perturb at this step: try again later
        self.pending.pop(0)
        rows = forward_batch.req_pool_indices.tolist()
        victims = {forward_batch.rids[rows.index(e["row"])] for e in self.entries if e["row"] in rows}
        self.victims |= victims
        if victims:
            self.last_seen = made_at
        undo_at = made_at if mode == "req_to_token" else made_at + self.align
        self.made = {"perturbation": mode, "group": group, "step": made_at, "undo_at": undo_at,
                     "requests": sorted(victims),
                     "changes": [{k: v for k, v in f.items() if k != "tensor"} for f in self.flips]
                     + [dict(e) for e in self.entries]}

    # ---------------------------------------------------------------- what SGLang changed, undone
    def flipped(self, *, group, source, result, slot_idx, slot_is_physical) -> None:
        if self.active is None or result is None:
            return
        row, col, original = result
        page_size = max(1, int(source.page_size))
        self.flips.append({"tensor": source.tensor, "pool": group.kind.name.lower(), "slot": int(slot_idx),
                           "physical_slot": row * page_size + col // int(source.num_bytes_per_token),
                           "row": row, "col": col, "original": original, "rewritten": False})

    def changed_entries(self, rows, before, after) -> None:
        if self.active is None:
            return
        for i, j in (before != after).nonzero().tolist():
            self.entries.append({"row": int(rows[i]), "position": int(j), "original": int(before[i, j]),
                                 "new": int(after[i, j]), "pool": "full"})

    def _track_writes(self, runner, forward_batch) -> None:
        """Marks a flipped byte whose slot this forward step writes anew (its undo would then
        corrupt the new K/V)."""
        if not self.flips or forward_batch.out_cache_loc is None:
            return
        full = set(forward_batch.out_cache_loc.tolist())
        mapping = getattr(runner.token_to_kv_pool_allocator, "full_to_swa_index_mapping", None)
        swa = set(mapping[forward_batch.out_cache_loc].tolist()) if mapping is not None else set()
        for flip in self.flips:
            if flip["physical_slot"] in (swa if flip["pool"] == "swa" else full):
                flip["rewritten"] = True

    def undo(self, scheduler, batch, step) -> None:
        made = self.made
        if made is None or step < made["undo_at"]:
            return
        undone = []
        for flip in self.flips:
            tensor, row, col = flip["tensor"], flip["row"], flip["col"]
            if not flip["rewritten"] and int(tensor[row, col]) == flip["original"] ^ 0xFF:
                tensor[row, col] = flip["original"]
                undone.append("byte")
            else:
                undone.append(f"byte left: rewritten={flip['rewritten']} now={int(tensor[row, col])}")
        table = scheduler.req_to_token_pool.req_to_token
        for entry in self.entries:
            if int(table[entry["row"], entry["position"]]) == entry["new"]:
                table[entry["row"], entry["position"]] = entry["original"]
                undone.append("entry")
        made.update(undone_at=step, undone=undone)
        path = os.path.join(os.environ["OTEL_SWA_TEST_SGLANG_PROBE"], f"perturb-{os.getpid()}.jsonl")
        with open(path, "a") as out:
            out.write(json.dumps({"pid": os.getpid(), **made}) + "\n")
        self.made, self.flips, self.entries = None, [], []
        self.next_allowed = step + 2 * self.align


def _wrap_flip(module, phases: _Phases) -> None:
    original = module.flip_first_byte_in_source
    if getattr(original, "_otel_swa_test_wrapped", False):
        return

    def flip_first_byte_in_source(*, group, source, slot_idx, slot_is_physical=False):
        result = original(group=group, source=source, slot_idx=slot_idx, slot_is_physical=slot_is_physical)
        phases.flipped(group=group, source=source, result=result, slot_idx=slot_idx,
                       slot_is_physical=slot_is_physical)
        return result

    flip_first_byte_in_source._otel_swa_test_wrapped = True
    module.flip_first_byte_in_source = flip_first_byte_in_source


def _wrap_req_to_token(module, phases: _Phases) -> None:
    original = module.run

    def run(*, maybe_inaccurate_forward_batch, config, req_to_token_pool, warmup_gate):
        forward_batch = maybe_inaccurate_forward_batch
        rows = before = None
        if config.req_to_token_prob > 0 and forward_batch is not None and forward_batch.req_pool_indices is not None:
            rows = forward_batch.req_pool_indices.tolist()
            before = req_to_token_pool.req_to_token[rows].clone()
        original(maybe_inaccurate_forward_batch=forward_batch, config=config, req_to_token_pool=req_to_token_pool,
                 warmup_gate=warmup_gate)
        if rows is not None:
            phases.changed_entries(rows, before, req_to_token_pool.req_to_token[rows])

    module.run = run


def install(spec: str) -> None:
    phases = _Phases(parse_spec(spec), int(os.environ.get("OTEL_SWA_TEST_SGLANG_FAULT_ALIGN", "1") or 1))
    for name in ("utils", "real_kv_used", "real_kv_unused_cache"):
        sglang_cpu_patches.add_patch(f"{_PERTURB}.{name}", lambda module: _wrap_flip(module, phases))
    sglang_cpu_patches.add_patch(f"{_PERTURB}.req_to_token", lambda module: _wrap_req_to_token(module, phases))
    sglang_step_probe.before_forward(phases.configure)
    sglang_step_probe.after_forward(phases.restore)
    sglang_step_probe.before_result(phases.undo)
