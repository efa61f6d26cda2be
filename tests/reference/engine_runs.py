"""What the reference engine's check tests share: run an engine over the packaged trace."""

from __future__ import annotations

from otel_swa.reference.trace import load_trace


def run_trace(engine, requests: int, fault=None, max_steps: "int | None" = None) -> None:
    """Install ``fault(engine)`` (when given), submit the first ``requests`` of the conversation
    trace, all at once, and run ``engine`` until every one finished (or ``max_steps`` steps ran)."""
    if fault is not None:
        fault(engine)
    for request in load_trace("conv", limit=requests):
        engine.submit(request, arrival_s=0.0)
    engine.run_until_done(max_steps)
