"""Helpers for the instrumentor tests: an in-memory OpenTelemetry pipeline and stand-in engine
packages registered as installed distributions (so ``BaseInstrumentor``'s version check runs)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EVENT_NAME = "kv_cache.swa.divergence_sample"


@dataclass
class Pipeline:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    logger_provider: LoggerProvider
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    logs: InMemoryLogRecordExporter

    @classmethod
    def make(cls) -> "Pipeline":
        spans, reader, logs = InMemorySpanExporter(), InMemoryMetricReader(), InMemoryLogRecordExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        logger_provider = LoggerProvider()
        logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
        return cls(tracer_provider, MeterProvider(metric_readers=[reader]), logger_provider, spans, reader, logs)

    def providers(self) -> dict:
        return dict(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider,
                    logger_provider=self.logger_provider)

    def points(self, name: str) -> list:
        data = self.reader.get_metrics_data()
        if data is None:
            return []
        return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                if m.name == name for p in m.data.data_points]

    def events(self) -> list:
        return [l.log_record for l in self.logs.get_finished_logs() if l.log_record.event_name == EVENT_NAME]

    def forward_spans(self) -> list:
        return [s for s in self.spans.get_finished_spans() if s.name == "forward step"]

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        self.logger_provider.shutdown()


def install_standin(monkeypatch, tmp_path: Path, distribution: str, version: str, modules: dict[str, dict]) -> None:
    """Register stand-in modules in ``sys.modules`` and a ``<distribution>-<version>.dist-info`` on
    ``sys.path`` (both undone by ``monkeypatch``). ``modules``: dotted name -> attributes; parent
    packages are created empty."""
    info = tmp_path / f"{distribution}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = set()
    for dotted in modules:
        parts = dotted.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name in sorted(names):
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so that children import
        for key, value in modules.get(name, {}).items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
