"""The alerting rules of ``examples/prometheus/otel-swa-alerts.yml``: Prometheus's own rule tests
(``promtool test rules``) on the series real replays exported, and the rules loaded into a real
Prometheus (Debian's ``prometheus``; in CI its absence fails) scraping real replays.

Two replays run with ``--exporter prometheus``, each scraped once at its end (the
``OTEL_SWA_PROMETHEUS_LINGER`` wait): a clean one, and one whose SWA pool leaks one page in 40 it
frees (``tests/telemetry/leaky_replay.py``). Their series, as scraped, become promtool's input:

* the clean run's series: no alert fires;
* the leaky run's series: ``SwaSlotsLeaked`` fires, with the series' labels, and nothing else;
* for every other rule, the clean run's series with that rule's fault put in (its gauge above 0,
  or its counter's ``disagree`` series growing; the vLLM block gauges, which the reference engine
  does not export, with the clean run's labels): that alert fires, with the labels and
  annotations the rule gives, and no other.

In the real Prometheus, the leaky run fires ``SwaSlotsLeaked`` and the clean one nothing, and the
dashboard's fault annotations (``examples/grafana/otel-swa-dashboard.json``) mark the leaky run
only.

The expected labels come from the table :data:`EXPECTED` below, written independently of the rule
file; the expected annotations are the rule's templates filled in with the series' instance and
value.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from otel_swa.testing.prometheus import PrometheusServer, free_port, grafana_expr

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "examples" / "prometheus" / "otel-swa-alerts.yml"
DASHBOARD = ROOT / "examples" / "grafana" / "otel-swa-dashboard.json"
REPLAY = Path(__file__).with_name("leaky_replay.py")
REQUESTS = "60"
LEAK_EVERY = "40"
INSTANCE, JOB = "engine-node-1:9464", "otel-swa"

#: alert -> (the series that carries its fault, how the fault shows, the labels the rule adds)
EXPECTED = {
    "SwaSlotsLeaked": ("kv_cache_swa_slots_leaked", "gauge", {"check": "audit", "pool": "swa"}),
    "SwaTokensStale": ("kv_cache_swa_tokens_stale", "gauge", {"check": "audit", "pool": "swa"}),
    "SwaSlotsShared": ("kv_cache_swa_slots_shared", "gauge", {"check": "audit", "pool": "swa"}),
    "SwaEvictedInWindow": ("kv_cache_swa_tokens_evicted_in_window", "gauge", {"check": "window", "pool": "swa"}),
    "SwaReadMismatch": ('kv_cache_swa_read_check_queries_total{kv_cache_swa_read_check_outcome="disagree"}', "counter",
                        {"check": "read", "pool": "swa"}),
    "KvWriteMismatch": ('kv_cache_swa_write_check_tokens_total{kv_cache_swa_write_check_outcome="disagree"}', "counter",
                        {"check": "write"}),
    "KvForeignTokens": ('kv_cache_swa_provenance_stamps_total{kv_cache_swa_provenance_outcome="disagree"}', "counter",
                        {"check": "provenance"}),
    "KvCorruptTokens": ('kv_cache_swa_provenance_checksums_total{kv_cache_swa_provenance_outcome="disagree"}',
                        "counter", {"check": "provenance"}),
    "VllmBlocksLeaked": ("kv_cache_swa_blocks_leaked", "gauge", {"check": "vllm_blocks", "engine": "vllm"}),
    "VllmBlocksFreedInUse": ("kv_cache_swa_blocks_freed_in_use", "gauge", {"check": "vllm_blocks", "engine": "vllm"}),
    "VllmBlocksShared": ("kv_cache_swa_blocks_shared", "gauge", {"check": "vllm_blocks", "engine": "vllm"}),
    "VllmStaleCachedBlocks": ("kv_cache_swa_blocks_stale_cached", "gauge", {"check": "vllm_blocks", "engine": "vllm"}),
    "VllmForeignBlocks": ("kv_cache_swa_blocks_foreign", "gauge", {"check": "vllm_blocks", "engine": "vllm"}),
    "SwaReporterSilent": ("kv_cache_swa_reporter_liveness_warnings_total", "counter", {"check": "reporter"}),
    "SwaReporterNotDelivering": ("kv_cache_swa_reporter_samples_taken_total", "counter", {"check": "reporter"}),
    "SwaReporterLosingSamples": ("kv_cache_swa_reporter_samples_invalid_total", "counter",
                                 {"check": "reporter", "severity": "warning"}),
}
#: promtool's time line: one sample a minute for 20 minutes, alerts evaluated at minute 10.
STEPS, EVAL = 20, "10m"
#: a fault: a gauge at this value; a counter growing by 1 a minute, whose increase over the rules'
#: 5-minute window Prometheus 2 computes as exactly 5 (samples at both ends of the window).
FAULT_GAUGE, COUNTER_INCREASE = 3, 5


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is required in CI (apt-get install prometheus)")
        pytest.skip(f"{name} not installed (apt-get install prometheus)")
    return path


def _replay(every: str, port: int, linger: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_SWA_PROMETHEUS_LINGER=linger, OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
               OTEL_EXPORTER_PROMETHEUS_PORT=str(port))
    return subprocess.Popen([sys.executable, str(REPLAY), every, "replay", "--requests", REQUESTS, "--no-model",
                             "--no-progress", "--exporter", "prometheus"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _scrape_at_the_end(proc: subprocess.Popen, into: dict, name: str) -> None:
    """Read the replay's stderr until it waits for its last scrape; scrape it; let it exit."""
    for line in proc.stderr:
        found = re.search(r"for one more scrape of (\S+)", line)
        if found:
            with urllib.request.urlopen(found.group(1), timeout=30) as reply:
                into[name] = reply.read().decode()
    proc.wait(timeout=120)
    into[name + " status"] = proc.returncode


@pytest.fixture(scope="module")
def scraped():
    """The exposition text of each replay at its end, as Prometheus would scrape it."""
    out: dict = {}
    procs = {"clean": _replay("0", free_port(), "120"), "leaky": _replay(LEAK_EVERY, free_port(), "120")}
    threads = [threading.Thread(target=_scrape_at_the_end, args=(proc, out, name)) for name, proc in procs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert out.get("clean status") == 0 and out.get("leaky status") == 1, out  # the leaky run found its leak
    return out


LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> list[tuple[str, dict, float]]:
    """``(name, labels, value)`` of every sample of a Prometheus text exposition (no histogram
    series, no ``target_info``)."""
    out = []
    for line in text.splitlines():
        found = LINE.match(line)
        if line.startswith("#") or not found:
            continue
        name, labels, value = found.group(1), dict(LABEL.findall(found.group(2) or "")), float(found.group(3))
        if name == "target_info" or name.endswith(("_bucket", "_count", "_sum")):
            continue
        out.append((name, labels, value))
    return out


def _selector(name: str, labels: dict) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else repr(value)


def _matches(name: str, labels: dict, series: str) -> bool:
    """Whether ``(name, labels)`` is the series ``series`` (``name`` or ``name{k="v"}``) names."""
    want_name, _, rest = series.partition("{")
    return name == want_name and all(labels.get(k) == v for k, v in LABEL.findall(rest))


def _input_series(samples, fault: "tuple[str, str] | None" = None) -> tuple[list[dict], dict | None]:
    """promtool's ``input_series``: every sample flat over :data:`STEPS` minutes (a counter that
    does not grow), with the scrape's ``instance`` and ``job``; the fault's series (``(series,
    kind)``) above 0 or growing, added with the other series' resource labels when the scrape had
    none. Returns the series and the labels of the fault's series."""
    series, fault_labels = [], None
    resource = {k: v for k, v in samples[0][1].items() if k.startswith(("service_", "host_", "otel_swa_", "otel_scope_"))}
    for name, labels, value in samples:
        labels = {**labels, "instance": INSTANCE, "job": JOB}
        values = f"{_number(value)}+0x{STEPS}"
        if fault is not None and _matches(name, labels, fault[0]):
            fault_labels = labels
            values = f"{FAULT_GAUGE}+0x{STEPS}" if fault[1] == "gauge" else f"{_number(value)}+1x{STEPS}"
        series.append({"series": _selector(name, labels), "values": values})
    if fault is not None and fault_labels is None:  # a series this engine does not export (vLLM's)
        name, _, rest = fault[0].partition("{")
        fault_labels = {**resource, **dict(LABEL.findall(rest)), "instance": INSTANCE, "job": JOB}
        values = f"{FAULT_GAUGE}+0x{STEPS}" if fault[1] == "gauge" else f"0+1x{STEPS}"
        series.append({"series": _selector(name, fault_labels), "values": values})
    return series, fault_labels


def rule_annotations(path: Path) -> dict[str, dict[str, str]]:
    """alert -> its annotation templates, read from the rule file (written one ``key: "text"`` a
    line under ``annotations:``)."""
    out: dict[str, dict[str, str]] = {}
    current = None
    for line in path.read_text().splitlines():
        found = re.match(r"\s*- alert: (\S+)$", line)
        if found:
            current = out.setdefault(found.group(1), {})
            continue
        found = re.match(r'\s+(summary|description): "(.*)"$', line)
        if found and current is not None:
            current[found.group(1)] = found.group(2).replace('\\"', '"')
    return out


def _render(template: str, labels: dict, value: float) -> str:
    return template.replace("{{ $labels.instance }}", labels["instance"]).replace("{{ $value }}", _number(value))


def _expected_alert(alert: str, labels: dict, value: float, annotations: dict) -> dict:
    metric, kind, extra = EXPECTED[alert]
    if alert == "SwaReporterNotDelivering":  # `taken > 0 and delivered == 0`: the labels of `taken`
        value = COUNTER_INCREASE * 2
    want = {k: v for k, v in labels.items()}
    want.update({"severity": "page", "component": "otel-swa", **extra, "alertname": alert})
    return {"exp_labels": {k: v for k, v in want.items() if k != "alertname"},
            "exp_annotations": {k: _render(t, labels, value) for k, t in annotations[alert].items()}}


def _evaluated_at(group: dict) -> float:
    """A rule group's ``lastEvaluation`` (RFC 3339, nanoseconds) in Unix seconds."""
    stamp = re.match(r"(\d+-\d+-\d+T\d+:\d+:\d+)(?:\.(\d+))?Z$", group["lastEvaluation"])
    if stamp is None:  # "0001-01-01T00:00:00Z"-like or a zone offset: not evaluated yet here
        return 0.0
    whole = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return whole.timestamp() + float("0." + (stamp.group(2) or "0"))


def _run_promtool(tmp_path: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    spec = tmp_path / "otel-swa-alerts.test.yml"
    spec.write_text(json.dumps({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}, indent=1))
    return subprocess.run([_tool("promtool"), "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)


def test_the_rules_cover_every_judged_fault_and_pass_promtool_check():
    proc = subprocess.run([_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(rule_annotations(RULES)) == set(EXPECTED)


def test_promtool_on_the_series_of_real_replays(scraped, tmp_path):
    clean, leaky = parse_exposition(scraped["clean"]), parse_exposition(scraped["leaky"])
    annotations = rule_annotations(RULES)
    none_fire = [{"eval_time": EVAL, "alertname": alert, "exp_alerts": []} for alert in EXPECTED]
    tests = []
    # the clean replay: nothing fires
    series, _ = _input_series(clean)
    tests.append({"interval": "1m", "input_series": series, "alert_rule_test": none_fire})
    # the leaky replay, as scraped: its leak fires SwaSlotsLeaked, nothing else
    leaked = [(labels, value) for name, labels, value in leaky if name == "kv_cache_swa_slots_leaked"]
    assert len(leaked) == 1 and leaked[0][1] > 0, leaked
    series, _ = _input_series(leaky)
    labels = {**leaked[0][0], "instance": INSTANCE, "job": JOB}
    checks = [dict(t) for t in none_fire]
    for check in checks:
        if check["alertname"] == "SwaSlotsLeaked":
            check["exp_alerts"] = [_expected_alert("SwaSlotsLeaked", labels, leaked[0][1], annotations)]
    tests.append({"interval": "1m", "input_series": series, "alert_rule_test": checks})
    # every other rule: its fault put into the clean replay's series
    for alert, (metric, kind, _) in EXPECTED.items():
        if alert == "SwaSlotsLeaked":
            continue
        series, labels = _input_series(clean, (metric, kind))
        value = FAULT_GAUGE if kind == "gauge" else COUNTER_INCREASE
        checks = [dict(t) for t in none_fire]
        for check in checks:
            if check["alertname"] == alert:
                check["exp_alerts"] = [_expected_alert(alert, labels, value, annotations)]
        tests.append({"interval": "1m", "input_series": series, "alert_rule_test": checks})
    proc = _run_promtool(tmp_path, tests)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "SUCCESS" in proc.stdout


def test_a_real_prometheus_fires_the_leak_alert_of_a_leaky_replay_and_none_for_a_clean_one(prometheus_binary,
                                                                                           tmp_path):
    # the same rules with every `for:` at 0 s (promtool above checks the durations): in a real
    # Prometheus evaluating every second, an alert that fires does so within seconds
    rules = tmp_path / "otel-swa-alerts.yml"
    rules.write_text(re.sub(r"for: \d+m", "for: 0s", RULES.read_text()))
    clean_port, leaky_port = free_port(), free_port()
    jobs = [{"job_name": "clean", "targets": [f"127.0.0.1:{clean_port}"]},
            {"job_name": "leaky", "targets": [f"127.0.0.1:{leaky_port}"]}]
    with PrometheusServer(tmp_path / "server", jobs, scrape_interval="200ms", binary=prometheus_binary,
                          rule_files=[rules], evaluation_interval="1s") as prom:
        started = time.time()
        procs = {"clean": _replay("0", clean_port, "60"), "leaky": _replay(LEAK_EVERY, leaky_port, "60")}
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == (1 if name == "leaky" else 0), err
            assert "one more scrape" in err and "was not scraped within" not in err, err  # Prometheus took the last values
        deadline = time.monotonic() + 60
        while True:
            firing = [a for a in prom.alerts() if a["state"] == "firing"]
            if any(a["labels"]["alertname"] == "SwaSlotsLeaked" for a in firing) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # every group evaluated twice more: any other alert of either run would be pending or firing
        since = time.time() + 1.0
        while min(_evaluated_at(group) for group in prom.api("rules")["groups"]) <= since:
            assert time.monotonic() < deadline + 60, prom.api("rules")
            time.sleep(0.2)
        active = prom.alerts()
        # the dashboard's fault annotations (range queries, as Grafana makes them) mark the leaky
        # run, and only it; a step shorter than the scrape interval: a replay's final values live
        # one scrape before the replay exits and its series go stale
        marked = {}
        for annotation in json.loads(DASHBOARD.read_text())["annotations"]["list"]:
            expr = grafana_expr(annotation["expr"], {"service": ".*", "host": ".*"}, rate_interval="5m")
            found = prom.query_range(expr, started, time.time(), step=0.05)
            marked[annotation["name"]] = sorted(series["metric"]["instance"] for series in found)
    assert marked == {name: [f"127.0.0.1:{leaky_port}"] for name in marked} and len(marked) == 2, marked
    names = sorted((a["labels"]["alertname"], a["labels"]["job"], a["state"]) for a in active)
    assert names == [("SwaSlotsLeaked", "leaky", "firing")], names
    leak = active[0]
    assert leak["labels"]["severity"] == "page" and leak["labels"]["check"] == "audit"
    assert leak["labels"]["service_name"] == "otel-swa-replay" and leak["labels"]["instance"] == f"127.0.0.1:{leaky_port}"
    assert float(leak["value"]) > 0
