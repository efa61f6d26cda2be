"""A real OpenTelemetry collector for the tests: ``rotel-agent`` (PyPI ``rotel``) on free loopback
ports, printing what it receives (``--debug-log traces|metrics|logs --debug-log-verbosity
detailed``, the layout of the Collector's debug exporter), and a reader of that output.

Shared by the telemetry tests (``otel-swa replay`` over OTLP) and the real-engine suites (SGLang's
scheduler process exporting from inside a running ``sglang.Engine``).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["rotel_agent", "free_port", "wait_for_port", "parse_debug_output", "int_value", "RotelCollector"]


def rotel_agent() -> str | None:
    found = shutil.which("rotel-agent")
    if found:
        return found
    try:  # the PyPI wheel ships the binary inside the package
        import rotel

        candidate = Path(rotel.__file__).with_name("rotel-agent")
        return str(candidate) if candidate.is_file() else None
    except ImportError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rotel-agent exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"rotel-agent did not listen on {port}")


# ---------------------------------------------------------------- reading the debug output
def parse_debug_output(text: str) -> dict:
    """Spans, metric data points and log records from the collector's detailed debug output.

    A point's ``time_unix_nano`` is its collection time, a log record's its timestamp, a span's
    ``end_unix_nano`` its end (nanoseconds since the epoch, the exporting process's clock).

    Each span, log record and metric carries the ``resource`` attributes of the block it came in
    (one block per exporting process); ``"resource"`` at the top is the last block's."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    spans, metrics, logs, resource = [], [], [], {}
    block_resource: dict = {}  # the resource of the Resource* block being read
    item = None  # the span / log record being read
    section = None  # attributes | events | links | point
    metric = None
    for raw in text.splitlines():
        line = raw.strip()
        if re.match(r"^Span #\d+$", line):
            item = {"attributes": {}, "events": [], "links": [], "resource": block_resource}
            spans.append(item)
            section = None
        elif re.match(r"^LogRecord #\d+$", line):
            item = {"attributes": {}, "resource": block_resource}
            logs.append(item)
            section = None
        elif re.match(r"^Metric #\d+$", line):
            metric = {"points": [], "resource": block_resource}
            metrics.append(metric)
            item, section = None, None
        elif re.match(r"^(ResourceSpans|ResourceLog|ResourceMetrics) #\d+$", line):
            item, metric, section = None, None, "resource"
            block_resource = {}
        elif section == "resource" and line.startswith("-> "):
            key, _, value = line[3:].partition(":")
            resource[key.strip()] = value.strip()
            block_resource[key.strip()] = value.strip()
        elif line.startswith("-> Name:") and metric is not None and not metric.get("name"):
            metric["name"] = line.split(":", 1)[1].strip()
        elif line.startswith("-> Unit:") and metric is not None:
            metric["unit"] = line.split(":", 1)[1].strip()
        elif line.startswith("-> DataType:") and metric is not None:
            metric["type"] = line.split(":", 1)[1].strip()
        elif line.startswith("-> AggregationTemporality:") and metric is not None:
            metric["temporality"] = line.split(":", 1)[1].strip()
        elif re.match(r"^(NumberDataPoints|HistogramDataPoints) #\d+$", line) and metric is not None:
            metric["points"].append({"attributes": {}})
            section = "point"
        elif line == "Exemplars:":
            section = "exemplars"
        elif re.match(r"^Exemplar #\d+$", line) and metric is not None:
            metric["points"][-1].setdefault("exemplars", []).append({})
        elif section == "exemplars" and line.startswith("-> ") and metric is not None:
            key, _, value = line[3:].partition(":")
            metric["points"][-1]["exemplars"][-1][key.strip()] = value.strip()
        elif line.startswith(("Value:", "Count:", "Sum:")) and metric is not None and metric["points"]:
            key, _, value = line.partition(":")
            metric["points"][-1][key.lower()] = float(value)
        elif line.startswith("Timestamp:") and section == "point" and metric is not None and metric["points"]:
            metric["points"][-1]["time_unix_nano"] = int(line.split(":", 1)[1])
        elif item is not None:
            if line.startswith("Trace ID") and section not in ("links",):
                item["trace_id"] = line.split(":", 1)[1].strip()
            elif line.startswith("Parent ID"):
                item["parent_id"] = line.split(":", 1)[1].strip()
            elif line.startswith(("ID ", "Span ID")):
                item["span_id"] = line.split(":", 1)[1].strip()
            elif line.startswith("Name ") and section is None:
                item["name"] = line.split(":", 1)[1].strip()
            elif line.startswith("Timestamp:"):  # a log record's (its observed time is ObservedTimestamp)
                item["time_unix_nano"] = int(line.split(":", 1)[1])
            elif line.startswith("End time:"):
                item["end_unix_nano"] = int(line.split(":", 1)[1])
            elif line.startswith("EventName:"):
                item["event_name"] = line.split(":", 1)[1].strip()
            elif line.startswith("Body:"):
                item["body"] = line.split(":", 1)[1].strip()
            elif line in ("Attributes:",):
                section = "attributes"
            elif line == "Events:":
                section = "events"
            elif line == "Links:":
                section = "links"
            elif re.match(r"^SpanEvent #\d+$", line):
                item["events"].append({"attributes": {}})
            elif re.match(r"^SpanLink #\d+$", line):
                item["links"].append({})
            elif line.startswith("-> ") and section == "attributes":
                key, _, value = line[3:].partition(":")
                item["attributes"][key.strip()] = value.strip()
            elif line.startswith("-> ") and section == "events" and item["events"]:
                key, _, value = line[3:].partition(":")
                if key.strip() == "Name":
                    item["events"][-1]["name"] = value.strip()
                elif key.strip() not in ("Timestamp", "DroppedAttributesCount", "Attributes:"):
                    item["events"][-1]["attributes"][key.strip()] = value.strip()
            elif line.startswith("-> ") and section == "links" and item["links"]:
                key, _, value = line[3:].partition(":")
                item["links"][-1][key.strip()] = value.strip()
        if section == "point" and line.startswith("-> ") and metric is not None and metric["points"]:
            key, _, value = line[3:].partition(":")
            metric["points"][-1]["attributes"][key.strip()] = value.strip()
    return {"spans": spans, "metrics": metrics, "logs": logs, "resource": resource}


def int_value(text: str) -> int:
    """``Int(20)`` -> 20."""
    match = re.fullmatch(r"Int\((-?\d+)\)", text)
    assert match, text
    return int(match.group(1))


class RotelCollector:
    """``with RotelCollector(agent, tmp_path) as collector:`` a running ``rotel-agent``.

    ``collector.endpoint("grpc")`` / ``endpoint("http/protobuf")`` is the OTLP endpoint URL; after the
    ``with`` block (the agent stopped, its output complete), ``collector.seen()`` is
    :func:`parse_debug_output` of everything it printed.
    """

    def __init__(self, agent: str, directory: Path, name: str = "rotel", settle_s: float = 0.5) -> None:
        self.agent = agent
        self.directory = Path(directory)
        self.name = name
        self.settle_s = settle_s
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.out_path = self.directory / f"{name}.out"
        self._proc: subprocess.Popen | None = None

    def endpoint(self, protocol: str = "grpc") -> str:
        port = self.grpc_port if protocol == "grpc" else self.http_port
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> "RotelCollector":
        self._out = open(self.out_path, "w")
        self._proc = subprocess.Popen(
            [self.agent, "start", "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
             "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}", "--exporter", "blackhole",
             "--debug-log", "traces", "--debug-log", "metrics", "--debug-log", "logs",
             "--debug-log-verbosity", "detailed", "--pid-file", str(self.directory / f"{self.name}.pid"),
             "--log-file", str(self.directory / f"{self.name}.log")],
            stdout=self._out, stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.grpc_port, self._proc)
            wait_for_port(self.http_port, self._proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self._proc is not None:
            time.sleep(self.settle_s)  # let the collector print what it received
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None
        self._out.close()

    def seen(self) -> dict:
        return parse_debug_output(self.out_path.read_text())
