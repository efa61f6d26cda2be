"""A script that runs vLLM 0.33.0's real scheduler on the trace, for the vLLM suite to start under
``opentelemetry-instrument`` as docs/engines.md writes it, or with plain ``python`` and vLLM's own
plugin loader (a test helper, never for users).

``python vllm_scheduler_script.py MODEL_DIR [async] [--plugin] [--runners]``: vLLM's
``AsyncScheduler`` (``async``) or ``Scheduler`` over the suite's hybrid KV cache, driven as vLLM's
engine core drives it (``vllm_support.SchedulerDriver``) on the trace's first 8 requests, with the
fault of ``OTEL_SWA_TEST_VLLM_FAULT`` made when the variable is set (``shims/vllm_faults.py``).
``--plugin``: first ``vllm.plugins.load_general_plugins()``, as every vLLM process calls it (the
``vllm.general_plugins`` entry points, otel-swa's among them); ``--runners``: then import vLLM's
two GPU model runner modules (V2 and V1), as a worker does.

Prints ``scheduler_steps=N fault_at=S blocks=B,...`` (``S``: the forward step the fault was made
in, or -1; ``B``: the blocks it touched) on its last line and, on the line before,
``otel_swa_wrapped=NAME,... instrumentor_imported=0|1``: the methods of otel-swa's vLLM
instrumentor that carry its wrapper, and whether its module was imported at all.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shims import vllm_faults  # noqa: E402
from vllm_support import SchedulerDriver, load_vllm, make_scheduler, trace_requests  # noqa: E402

#: ``(module, class, method)`` of every method otel-swa's vLLM instrumentor wraps (its ``WRAPPED``;
#: a suite test keeps the two equal), spelled out so that this script never imports the instrumentor.
INSTRUMENTED = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
)
_OUR_CODE = os.sep + os.path.join("opentelemetry", "instrumentation", "swa_vllm") + os.sep


def otel_swa_wrapped() -> list[str]:
    """``module:Class.method`` of each method of :data:`INSTRUMENTED` whose module is imported here
    and whose function is otel-swa's wrapper."""
    wrapped = []
    for module_name, class_name, method in INSTRUMENTED:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        code = getattr(getattr(cls, "__dict__", {}).get(method), "__code__", None)
        if code is not None and _OUR_CODE in code.co_filename:
            wrapped.append(f"{module_name}:{class_name}.{method}")
    return wrapped


def main(argv: list[str]) -> int:
    options = [a for a in argv[2:] if a.startswith("--")]
    if "--plugin" in options:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    v = load_vllm()
    if "--runners" in options:
        for module_name, _, _ in INSTRUMENTED[1:]:
            importlib.import_module(module_name)
    scheduler = make_scheduler(v, Path(argv[1]), async_scheduling="async" in argv[2:])
    injection = vllm_faults.install(scheduler)  # from the environment variable
    driver = SchedulerDriver(scheduler).run(trace_requests(v, limit=8))
    made = injection.injected_at if injection is not None and injection.injected_at is not None else -1
    blocks = ",".join(map(str, injection.blocks)) if injection is not None else ""
    imported = int("opentelemetry.instrumentation.swa_vllm" in sys.modules)
    print(f"otel_swa_wrapped={','.join(otel_swa_wrapped())} instrumentor_imported={imported}")
    print(f"scheduler_steps={driver.forward_ct} fault_at={made} blocks={blocks}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
