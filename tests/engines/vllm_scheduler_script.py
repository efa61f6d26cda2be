"""A script that runs vLLM 0.33.0's real scheduler on the trace, for the vLLM suite to start under
``opentelemetry-instrument`` as docs/engines.md writes it (a test helper, never for users).

``python vllm_scheduler_script.py MODEL_DIR [async]``: vLLM's ``AsyncScheduler`` (``async``) or
``Scheduler`` over the suite's hybrid KV cache, driven as vLLM's engine core drives it
(``vllm_support.SchedulerDriver``) on the trace's first 8 requests, with the fault of
``OTEL_SWA_TEST_VLLM_FAULT`` made when the variable is set (``shims/vllm_faults.py``). Prints one
line, ``scheduler_steps=N fault_at=S blocks=B,...`` (``S``: the forward step the fault was made in,
or -1; ``B``: the blocks it touched).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shims import vllm_faults  # noqa: E402
from vllm_support import SchedulerDriver, load_vllm, make_scheduler, trace_requests  # noqa: E402


def main(argv: list[str]) -> int:
    v = load_vllm()
    scheduler = make_scheduler(v, Path(argv[1]), async_scheduling=argv[2:] == ["async"])
    injection = vllm_faults.install(scheduler)  # from the environment variable
    driver = SchedulerDriver(scheduler).run(trace_requests(v, limit=8))
    made = injection.injected_at if injection is not None and injection.injected_at is not None else -1
    blocks = ",".join(map(str, injection.blocks)) if injection is not None else ""
    print(f"scheduler_steps={driver.forward_ct} fault_at={made} blocks={blocks}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
