"""The window check: does every token inside the sliding window still have its SWA slot, and has
every token far out of it given its slot back?

From the SWA slots the sample's core pass gathered for the live tokens (fused into it): premature
evictions (a token inside the window the step reads whose SWA mapping is 0: attention reads freed
KV, sgl-project/sglang#29860) and late-held slots (tokens older than the window plus the engine's
eviction allowance still holding an SWA slot). The view gives ``sliding_window`` (without it the
check does not run), ``extend_lens_cpu`` and ``swa_eviction_allowance``
(:mod:`otel_swa.device.window`).
"""

from __future__ import annotations

from typing import Any, Sequence

from otel_swa.checks.protocol import Check, CheckField, SampleBatch, Staging

__all__ = ["WINDOW_WIDTH", "PREMATURE_CELLS", "WindowCheck", "CHECK"]

#: int64 cells a windowed sample stages: in-window tokens with an SWA slot, late-held tokens,
#: in-window tokens (dense path without host lengths only), then the first premature eviction
#: (:data:`PREMATURE_CELLS`, meaningful only when there is one).
WINDOW_WIDTH = 7
#: The first in-window token without an SWA slot: the first request of the batch that has one, and
#: the first such position in it: its batch entry, ``req_to_token`` row, position and FULL slot.
PREMATURE_CELLS = ("entry", "row", "position", "full_slot")


class WindowCheck(Check):
    name = "window"
    title = "window check"
    line = "audit"
    fused = True
    ran_when = "when the engine gives its sliding window"
    fields = (
        CheckField("swa_premature_evictions", "{token}",
                   "live tokens inside the sliding window whose SWA mapping is 0",
                   role="fault", label="premature evictions",
                   explain="{peak} live token(s) inside the sliding window had no SWA slot (premature eviction: "
                           "attention read freed KV)",
                   gauge=("tokens.evicted_in_window",
                          "Live tokens of the sampled batch inside the sliding window (the positions the forward "
                          "step's queries read) whose SWA slot was freed (mapping 0): attention reads KV that is gone "
                          "(premature eviction); must be 0")),
        CheckField("swa_late_held_slots", "{slot}",
                   "SWA slots still held by tokens older than the step's sliding windows plus the engine's eviction "
                   "allowance",
                   role="info", label="late-held SWA slots",
                   gauge=("slots.held_out_of_window",
                          "SWA slots still held by live tokens older than the positions the forward step reads plus "
                          "the engine's eviction allowance (late eviction; growing: runaway SWA usage)")),
    )
    reason = ("the window check found live tokens inside the sliding window without an SWA slot (peak {found}); "
              "exit status 1")

    def keep(self, staging: Staging, staged: Any) -> Any:
        """After the core pass: ``(in-window tokens when the host knew them, else None; whether the
        view has a FULL-to-SWA mapping)``, or ``None`` when the view gave no window."""
        meta = staging.core
        if meta.window is None:
            return None
        return meta.window_tokens, getattr(staging.view, "divergence_applicable", True) is not False

    def read(self, cells: Sequence[int], kept: Any, batch: SampleBatch) -> "tuple[dict, list[dict]]":
        window_tokens, applicable = kept
        premature = (window_tokens if window_tokens is not None else cells[2]) - cells[0]
        fields = {"swa_premature_evictions": premature, "swa_late_held_slots": cells[1]}
        if premature <= 0:
            return fields, []
        where = dict(zip(PREMATURE_CELLS, cells[3:3 + len(PREMATURE_CELLS)]))
        # a view without SGLang's slot mapping (vLLM: divergence not applicable) fills req_to_token
        # with block ids, not FULL slots: no slot is named then
        return fields, [dict(fault="swa_premature_evictions", request=batch.request(where["entry"]), row=where["row"],
                             position=where["position"], full_slot=where["full_slot"] if applicable else None)]

    def summary(self, records: Sequence[Any]) -> str:
        checked = [r for r in records if self.present(r)]
        premature = max(r.swa_premature_evictions for r in checked)
        late = max(r.swa_late_held_slots for r in checked)
        verdict = "clean" if not premature else "PREMATURE EVICTION"
        return f"{verdict}: peak premature evictions {premature} tokens, late-held {late} slots ({len(checked)} samples)"


#: The window check.
CHECK = WindowCheck()
