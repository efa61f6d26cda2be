"""An engine wiring the SWA divergence reporter and OpenTelemetry by hand.

The reference engine stands for any engine: what matters is where the calls go.

    python examples/engine_by_hand.py                      # console exporters + the SGLang line
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
        python examples/engine_by_hand.py --exporters otlp,logline
    OTEL_METRICS_EXPORTER=otlp OTEL_LOGS_EXPORTER=swa_logline python examples/engine_by_hand.py

Exporters, endpoint, protocol, headers, temporality, service name and resource come from the
standard ``OTEL_*`` variables (see docs/telemetry.md); the sampling interval from
``OTEL_SWA_DIVERGENCE_INTERVAL`` (this script defaults it to 4 when unset). An unknown exporter or
an unusable variable is refused in one line (exit status 2) before torch is imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from types import SimpleNamespace

from otel_swa import config

# Small prompts against a 16-token window and a 128-slot SWA pool: tokens leave the window and
# their SWA slots are reused within a few steps, so divergence and out-of-window tokens show.
REQUESTS = [(40, 12), (25, 20), (70, 6), (33, 15), (90, 10), (18, 24)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--exporters", default=None,
        help="otlp, console, logline, none (comma list); default: the OTEL_*_EXPORTER variables when any "
        "is set, else console,logline",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OTEL_SWA_DIVERGENCE_INTERVAL", "4")
    exporters = args.exporters
    if exporters is None and not any(os.environ.get(f"OTEL_{signal}_EXPORTER") for signal in ("TRACES", "METRICS", "LOGS")):
        exporters = "console,logline"
    try:  # what cannot work is said in one line, before torch is imported
        config.check_environment()
        from otel_swa.telemetry import configure  # OpenTelemetry, not torch

        # 1. telemetry: providers from the OTEL_* variables (or the application's own, if installed)
        telemetry = configure(exporters=exporters, default_service_name="otel-swa-example")
    except config.ConfigError as exc:
        print(f"engine_by_hand.py: {exc}", file=sys.stderr)
        return 2
    from otel_swa.reference.engine import EngineConfig, ReferenceEngine
    from otel_swa.reporter import SwaDivergenceReporter

    # 2. the engine and its reporter (None when the interval is 0: no reporter work at all)
    engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=2048, swa_pool_size=128, max_running=4,
                                          token_budget=64, max_context_len=256, step_time_s=0.0))
    engine.reporter = SwaDivergenceReporter.from_env(device=engine.device)
    if engine.reporter is not None:
        telemetry.attach(engine.reporter)  # records -> metrics, events, SGLang line

    # 3. the forward-step span, linked to the request spans of each batch
    engine.forward_span = telemetry.forward_span

    # 4. a request span per request (a serving front end would receive a traceparent instead)
    for context_tokens, generated_tokens in REQUESTS:
        state = engine.submit(SimpleNamespace(context_tokens=context_tokens, generated_tokens=generated_tokens), arrival_s=0.0)
        telemetry.start_request_span(state.rid, attributes={"gen_ai.usage.input_tokens": context_tokens})

    while (result := engine.step()) is not None:
        for rid in result.finished:
            telemetry.end_request_span(rid)

    # 5. shutdown: deliver the last samples, then flush and stop the providers built here
    if engine.reporter is not None:
        engine.reporter.close()
    telemetry.shutdown()
    print(f"forward steps: {engine.forward_ct}, samples delivered: "
          f"{engine.reporter.stats.samples_delivered if engine.reporter else 0}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
