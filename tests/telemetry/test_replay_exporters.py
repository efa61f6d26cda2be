"""``otel-swa replay --exporter``: the OpenTelemetry path without a collector (console exporters),
and the hand-wired example. Each runs in its own interpreter (global providers are set once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from otel_swa.record import find_all

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update(extra)
    return env


def json_objects(text: str) -> list[dict]:
    """The JSON objects the console exporters print (pretty-printed, one after another)."""
    decoder, objects, i = json.JSONDecoder(), [], 0
    while True:
        start = text.find("{", i)
        if start < 0:
            return objects
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            i = start + 1
            continue
        objects.append(obj)
        i = end


def test_replay_console_exporter_links_forward_steps_to_request_spans():
    run = subprocess.run(
        [sys.executable, "-m", "otel_swa.cli", "replay", "--requests", "3", "--no-model", "--interval", "10",
         "--window", "64", "--no-progress", "--exporter", "console", "--exporter", "logline"],
        env=clean_env(OTEL_METRICS_EXPORTER="none"), capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    records = list(find_all(run.stdout))
    assert records and [r.forward_ct for r in records] == list(range(10, 10 * len(records) + 1, 10))
    objects = json_objects(run.stdout)
    spans = [o for o in objects if "context" in o and "kind" in o]
    requests = {o["context"]["span_id"] for o in spans if o["name"] == "request"}
    assert len(requests) == 3
    forward = {o["attributes"]["forward_step.forward_ct"]: o for o in spans if o["name"] == "forward step"}
    # OTEL_SWA_FORWARD_SPANS=sampled (the default): a span at each of the replay's sampling steps
    assert sorted(forward) == [r.forward_ct for r in records]
    for span in forward.values():
        assert len(span["links"]) == span["attributes"]["forward_step.batch_size"]
        assert {link["context"]["span_id"] for link in span["links"]} <= requests
    events = [o for o in objects if o.get("event_name") == "kv_cache.swa.divergence_sample"]
    assert [e["attributes"]["kv_cache.swa.forward_ct"] for e in events] == [r.forward_ct for r in records]
    for event, record in zip(events, records):
        assert event["span_id"] == forward[record.forward_ct]["context"]["span_id"]


def test_hand_wired_example_writes_one_line_per_sample():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "engine_by_hand.py"), "--exporter", "logline"],
                         env=clean_env(OTEL_SWA_DIVERGENCE_INTERVAL="4"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    records = list(find_all(run.stderr))
    forward_steps = int(run.stdout.split("forward steps: ")[1].split(",")[0])
    assert [r.forward_ct for r in records] == list(range(4, forward_steps + 1, 4))
    assert run.stdout.strip().endswith(f"samples delivered: {len(records)}")
