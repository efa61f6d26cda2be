"""Fault injection: an instrumented engine whose forward steps never reach the reporter.

It stands for an engine build whose forward path does not go through the method the instrumentor
wraps (the reporter is installed and never stepped), the silent gap SGLang's KV canary closes with
its "canary path is not executing" check. The reference engine is instrumented as under
``opentelemetry-instrument`` (its instrumentor gives it a reporter from
``OTEL_SWA_DIVERGENCE_INTERVAL``, the ``swa_logline`` exporter writes otel-swa's lines); this
engine's ``step`` runs each forward step with the reporter detached, so its reporter's
``forward_ct`` stays 0 whatever the number of steps (the attention math is skipped: the KV cache
bookkeeping runs as usual). The lines go to standard error with an SGLang-style prefix.

Usage: ``OTEL_SWA_DIVERGENCE_INTERVAL=20 python never_stepped.py STEPS``.
"""

import logging
import sys
from types import SimpleNamespace

from opentelemetry.instrumentation.swa_reference import SwaReferenceInstrumentor

from otel_swa.reference.engine import EngineConfig, ReferenceEngine
from otel_swa.telemetry import configure


class BypassingEngine(ReferenceEngine):
    """The reference engine with a forward path that skips the reporter hook."""

    def step(self):
        reporter, self.reporter = self.reporter, None
        try:
            return super().step()
        finally:
            self.reporter = reporter


def main(steps: int) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[%(asctime)s TP0] %(message)s")
    configure(exporters="logline")  # the global providers the instrumentor uses
    SwaReferenceInstrumentor().instrument()
    engine = BypassingEngine(EngineConfig(window=16, full_pool_size=4096, swa_pool_size=256, max_running=4,
                                          token_budget=64, max_context_len=512, step_time_s=0.0, run_model=False))
    assert engine.reporter is not None, "the instrumentor gave the engine no reporter (interval unset?)"
    for _ in range(8):
        engine.submit(SimpleNamespace(context_tokens=60, generated_tokens=400), arrival_s=0.0)
    ran = sum(engine.step() is not None for _ in range(steps))
    print(f"engine steps {ran}, reporter forward_ct {engine.reporter.forward_ct}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
