"""Wall time of the reference engine on the default replay, with and without the reporter.

Prints, for the default replay (``DEFAULT_REPLAY``: the first 200 requests of the conversation
trace) or the ``--trace``/``--requests`` given:

* forward steps, requests, wall seconds and milliseconds per forward step with the reporter off
  (``reporter=None``: no reporter work at all), on (sampling every ``--interval`` steps), and on
  with the attention math switched off (``run_model=False``: KV cache bookkeeping only), so the
  reporter's share can be read against both;
* the reporter's added cost per forward step (on minus off), in microseconds.

Run: ``python benchmarks/bench_engine.py [--trace conv] [--requests 200] [--interval 20] [--device cpu]``
"""

from __future__ import annotations

import argparse
import dataclasses

from otel_swa.reference.replay import DEFAULT_REPLAY, replay
from otel_swa.reference.trace import load_trace
from otel_swa.reporter import SwaDivergenceReporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=DEFAULT_REPLAY.trace)
    parser.add_argument("--requests", type=int, default=DEFAULT_REPLAY.limit)
    parser.add_argument("--interval", type=int, default=DEFAULT_REPLAY.interval)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    requests = load_trace(args.trace, limit=args.requests)
    config = DEFAULT_REPLAY.config
    print(f"trace {args.trace}, {len(requests)} requests, device {args.device}, {config}")
    rows = []
    for label, cfg, with_reporter in (
        ("model, reporter off", config, False),
        ("model, reporter on", config, True),
        ("no model, reporter off", dataclasses.replace(config, run_model=False), False),
        ("no model, reporter on", dataclasses.replace(config, run_model=False), True),
    ):
        reporter = SwaDivergenceReporter(args.interval, device=args.device) if with_reporter else None
        summary = replay(requests, cfg, reporter, device=args.device)
        if reporter is not None:
            reporter.close()
        per_step_ms = summary.wall_s / summary.forward_steps * 1e3
        rows.append((label, summary, per_step_ms))
        print(
            f"{label:24s} steps {summary.forward_steps:6d}  requests {summary.requests_finished:5d}  "
            f"wall {summary.wall_s:7.2f} s  {per_step_ms:7.3f} ms/step"
        )
    for off, on in ((rows[0], rows[1]), (rows[2], rows[3])):
        added_us = (on[2] - off[2]) * 1e3
        print(f"reporter cost per forward step ({on[0].split(',')[0]}): {added_us:+.1f} us (interval {args.interval})")


if __name__ == "__main__":
    main()
