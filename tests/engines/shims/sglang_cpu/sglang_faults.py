"""Fault injections into a real sglang 0.5.23 Engine, for the engine suite's bug zoo (never for users).

Each re-creates one class of published SWA KV cache bug inside the real engine, in the scheduler
process, from forward step ``OTEL_SWA_TEST_SGLANG_FAULT_AT_STEP`` (default 20) on; the selected one is
named by ``OTEL_SWA_TEST_SGLANG_FAULT`` (set by the engine tests, read at interpreter start-up
through the shims' ``.pth`` file, only with the scheduler probe on):

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

Every injection that took effect appends ``{"pid", "fault", "step", ...}`` to
``faults-<pid>.jsonl`` in the probe's directory: ``step`` is the first forward step whose sample can see
the fault (the test compares the first detection with it).
"""

from __future__ import annotations

import json
import os

FAULTS = ("torch_native_raw_read", "early_eviction", "leak_on_free", "freed_while_mapped")


def at_step() -> int:
    """The forward step from which the fault is on."""
    return int(os.environ.get("OTEL_SWA_TEST_SGLANG_FAULT_AT_STEP", "20") or 20)


def record(fault: str, step: int, **details) -> None:
    """Note in the probe's directory that ``fault`` took effect at ``step``."""
    path = os.path.join(os.environ["OTEL_SWA_TEST_SGLANG_PROBE"], f"faults-{os.getpid()}.jsonl")
    with open(path, "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "fault": fault, "step": step, **details}) + "\n")


def install(fault: str) -> None:
    if fault not in FAULTS:
        raise ValueError(f"OTEL_SWA_TEST_SGLANG_FAULT={fault!r}; expected one of {', '.join(FAULTS)}")
    if fault == "torch_native_raw_read":
        import sglang_step_probe

        def first(runner, forward_batch, step, line, done=[]):  # noqa: B006 - once per process
            if not done:
                done.append(step)
                record(fault, step)

        sglang_step_probe.after_forward(first)
        return
    module = {
        "early_eviction": "fault_sglang_8649_early_eviction",
        "leak_on_free": "fault_sglang_29860_leak_on_free",
        "freed_while_mapped": "fault_sglang_27586_freed_while_mapped",
    }[fault]
    __import__(module).install(at_step())
