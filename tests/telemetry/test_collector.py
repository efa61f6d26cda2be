"""End to end against a real OpenTelemetry collector (rotel): OTLP over gRPC and over HTTP.

A small ``otel-swa replay --exporter otlp,logline`` exports to ``rotel-agent`` started
on free loopback ports with its debug output (``--debug-log traces|metrics|logs
--debug-log-verbosity detailed``, the layout of the Collector's debug exporter). The test reads what
the collector printed and compares it with the SGLang lines the same run wrote.

Skipped only when ``rotel-agent`` is missing and ``CI`` is unset; in CI a missing collector fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from collector_support import RotelCollector, int_value

from otel_swa.record import find_all

pytestmark = pytest.mark.collector
ROOT = Path(__file__).resolve().parents[2]
#: A small replay: 8 requests of the packaged trace; a small SWA pool and window so that slots are
#: remapped (divergence > 0) and tokens leave the window; about 150 forward steps, 14 samples.
REPLAY_ARGS = ["--requests", "8", "--no-model", "--interval", "10", "--window", "64", "--swa-pool", "1024",
               "--no-progress"]
REQUESTS = 8


# ---------------------------------------------------------------- the run
def run_against_rotel(agent: str, tmp_path: Path, protocol: str, temporality: str):
    with RotelCollector(agent, tmp_path, name=protocol.replace("/", "-")) as collector:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update({
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint(protocol),
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": temporality,
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",  # one export, at shutdown
            "OTEL_SERVICE_NAME": "otel-swa-e2e",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test",
            "OTEL_SWA_TP_RANK": "1",
        })
        run = subprocess.run([sys.executable, "-m", "otel_swa.cli", "replay", *REPLAY_ARGS, "--exporter", "otlp,logline"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
    return run, collector.seen()


@pytest.mark.parametrize("protocol, temporality", [("grpc", "cumulative"), ("http/protobuf", "delta")])
def test_collector_receives_every_record_as_metrics_and_events(agent_binary, tmp_path, protocol, temporality):
    run, seen = run_against_rotel(agent_binary, tmp_path, protocol, temporality)
    records = list(find_all(run.stdout))
    assert len(records) >= 10 and max(r.swa_full_idx_divergence for r in records) > 0
    last = records[-1]

    # resource: service name, OTEL_RESOURCE_ATTRIBUTES and the rank
    assert seen["resource"]["service.name"] == "Str(otel-swa-e2e)"
    assert seen["resource"]["deployment.environment.name"] == "Str(test)"
    assert seen["resource"]["otel_swa.tp_rank"] == "Int(1)"

    # metrics: names, units, values equal to the lines (one export at shutdown: delta == total)
    by_name = {}
    for metric in seen["metrics"]:
        by_name.setdefault(metric["name"], []).append(metric)

    def points(name, **attributes):
        found = [p for m in by_name[name] for p in m["points"]
                 if all(p["attributes"].get(k) == f"Str({v})" for k, v in attributes.items())]
        assert found, (name, attributes)
        return found

    def total(name, **attributes):
        """A counter's total: the last cumulative point, or the sum of the delta points."""
        found = points(name, **attributes)
        return found[-1]["value"] if temporality == "cumulative" else sum(p["value"] for p in found)

    assert {m["unit"] for m in by_name["kv_cache.swa.entries.verified"]} == {"{entry}"}
    assert {m["unit"] for m in by_name["kv_cache.swa.tokens.out_of_window"]} == {"{token}"}
    assert {m["unit"] for m in by_name["kv_cache.swa.forward_steps"]} == {"{forward}"}
    # the replay counts the entries attention reads, and says so on the counter
    assert {p["attributes"]["kv_cache.swa.verify_source"] for m in by_name["kv_cache.swa.entries.verified"]
            for p in m["points"]} == {"Str(attention)"}
    assert total("kv_cache.swa.entries.verified", pool="full") == last.verify_full
    assert total("kv_cache.swa.entries.verified", pool="swa") == last.verify_swa
    assert total("kv_cache.swa.forward_steps") == last.forward_ct
    assert total("kv_cache.swa.reporter.samples.delivered") == len(records)
    assert points("kv_cache.swa.tokens.out_of_window")[-1]["value"] == last.swa_out_of_window_tokens
    assert points("kv_cache.swa.tokens.divergent")[-1]["value"] == last.swa_full_idx_divergence
    temporalities = {m.get("temporality") for m in by_name["kv_cache.swa.forward_steps"]}
    assert temporalities == {"AGGREGATION_TEMPORALITY_" + temporality.upper()}
    types = {m["name"]: m["type"] for m in seen["metrics"]}
    assert types["kv_cache.swa.tokens.divergent"] == "Gauge" and types["kv_cache.swa.forward_steps"] == "Sum"

    # spans: forward steps, request spans, links
    forward = {int_value(s["attributes"]["forward_step.forward_ct"]): s for s in seen["spans"] if s.get("name") == "forward step"}
    requests = {(s["trace_id"], s["span_id"]) for s in seen["spans"] if s.get("name") == "request"}
    assert len(requests) == REQUESTS
    assert sorted(forward)[-1] >= last.forward_ct
    linked = set()
    for span in forward.values():
        links = {(l["Trace ID"], l["ID"]) for l in span["links"]}
        assert len(links) == int_value(span["attributes"]["forward_step.batch_size"])
        linked |= links
    assert linked == requests

    # the KV pools' usage (read at the collection, from the engine's pools): every token of each
    # pool is used, available or evictable; the replay's pools are 65536 (FULL) and 1024 (SWA) slots
    for pool, size in (("full", 65536), ("swa", 1024)):
        parts = [points(f"kv_cache.pool.tokens.{part}", pool=pool)[-1]["value"] for part in ("used", "available", "evictable")]
        assert points("kv_cache.pool.tokens.limit", pool=pool)[-1]["value"] == sum(parts) == size

    # the replay's summary says what was sent, and the collector got exactly that
    exported = next(line for line in run.stdout.splitlines() if line.strip().startswith("exported"))
    assert f"logs {len(seen['logs'])} log records" in exported and "failed" not in exported.lower()
    assert f"traces {len(seen['spans'])} spans" in exported

    # events: one per record, with the trace/span ids of the forward step where it was sampled
    events = [l for l in seen["logs"] if l.get("event_name") == "kv_cache.swa.divergence_sample"]
    assert [int_value(e["attributes"]["kv_cache.swa.forward_ct"]) for e in events] == [r.forward_ct for r in records]
    for event, record in zip(events, records):
        step = forward[record.forward_ct]
        assert (event["trace_id"], event["span_id"]) == (step["trace_id"], step["span_id"])
        assert int_value(event["attributes"]["kv_cache.swa.swa_out_of_window_tokens"]) == record.swa_out_of_window_tokens
        assert event["body"] == f"Str({record.line()})"
        assert event["attributes"]["kv_cache.swa.verify_source"] == "Str(attention)"
    # span events: under the sampled forward step (child span or the step itself)
    sample_spans = [s for s in seen["spans"] if s.get("name") == "swa divergence sample"]
    for s in sample_spans:
        step = forward[int_value(s["attributes"]["kv_cache.swa.forward_ct"])]
        assert (s["trace_id"], s["parent_id"]) == (step["trace_id"], step["span_id"])
        assert [e["name"] for e in s["events"]] == ["kv_cache.swa.divergence_sample"]
    on_steps = sum(1 for s in forward.values() for e in s["events"] if e.get("name") == "kv_cache.swa.divergence_sample")
    assert len(sample_spans) + on_steps == len(records)

    # exemplars (the SDK keeps a random one per collection) point at a sampled forward step, and
    # carry the value of the record sampled there
    by_step = {(forward[r.forward_ct]["trace_id"], forward[r.forward_ct]["span_id"]): r for r in records}
    for name, field in (("kv_cache.swa.tokens.out_of_window", "swa_out_of_window_tokens"),
                        ("kv_cache.swa.tokens.divergent", "swa_full_idx_divergence")):
        exemplars = [e for p in points(name) for e in p.get("exemplars", [])]
        assert exemplars, name
        for exemplar in exemplars:
            record = by_step[(exemplar["Trace ID"], exemplar["Span ID"])]
            assert float(exemplar["Value"]) == getattr(record, field)
