"""The SGLang log-line exporter byte for byte; configure(): exporters, resource, global providers."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_swa.config import ConfigError
from otel_swa.record import SwaDivergenceRecord, find_all
from otel_swa.telemetry import SwaLogLineExporter, SwaTelemetrySink, configure, resolve_exporters

R = SwaDivergenceRecord
LINES = [
    'kv_canary_swa_divergence={"forward_ct":20,"verify_full":5120,"verify_swa":2048,"swa_full_idx_divergence":17,"swa_out_of_window_tokens":311}',
    'kv_canary_swa_divergence={"forward_ct":40,"verify_full":9000,"verify_swa":3000,"swa_full_idx_divergence":0,"swa_out_of_window_tokens":640}',
]
RECORDS = [R(20, 5120, 2048, 17, 311), R(40, 9000, 3000, 0, 640)]


def logline_provider(exporter):
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    return provider


def test_logline_exporter_writes_sglang_lines_byte_for_byte_to_a_stream():
    stream = io.StringIO()
    provider = logline_provider(SwaLogLineExporter(stream))
    sink = SwaTelemetrySink(logger_provider=provider, span_events=False)
    for record in RECORDS:
        sink(record, None)
    # another log record through the same provider is not a sample: no line
    provider.get_logger("app").emit(body="hello", event_name="something.else")
    assert stream.getvalue() == LINES[0] + "\n" + LINES[1] + "\n"
    assert list(find_all(stream.getvalue())) == RECORDS
    provider.shutdown()


def test_logline_exporter_goes_through_python_logging_logger_otel_swa(caplog):
    provider = logline_provider(SwaLogLineExporter())
    sink = SwaTelemetrySink(logger_provider=provider, span_events=False)
    with caplog.at_level(logging.INFO, logger="otel_swa"):
        sink(RECORDS[0], None)
    lines = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name == "otel_swa"]
    assert lines == [("otel_swa", logging.INFO, LINES[0])]
    provider.shutdown()


def test_logline_exporter_skips_an_event_with_broken_attributes():
    stream = io.StringIO()
    exporter = SwaLogLineExporter(stream)
    provider = logline_provider(exporter)
    provider.get_logger("x").emit(event_name="kv_cache.swa.divergence_sample", attributes={"kv_cache.swa.forward_ct": 1})
    assert stream.getvalue() == "" and exporter.malformed == 1
    provider.shutdown()


def test_resolve_exporters_short_names_and_standard_variables():
    assert resolve_exporters("otlp,logline", {}) == {
        "traces": ["otlp_proto_grpc"], "metrics": ["otlp_proto_grpc"], "logs": ["otlp_proto_grpc", "swa_logline"]}
    assert resolve_exporters(["console", "none"], {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == {
        "traces": ["console"], "metrics": ["console"], "logs": ["console"]}
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
           "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "swa_logline,otlp"}
    assert resolve_exporters(None, env) == {
        "traces": ["otlp_proto_http"], "metrics": ["otlp_proto_grpc"], "logs": ["swa_logline", "otlp_proto_http"]}
    assert resolve_exporters(None, {"OTEL_TRACES_EXPORTER": "none"}) == {"traces": [], "metrics": [], "logs": []}
    with pytest.raises(ConfigError, match="exporter 'zipkin' is unknown"):
        resolve_exporters("otlp,zipkin", {})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        resolve_exporters("otlp", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_configure_builds_providers_with_resource_ranks_and_shuts_down_only_those():
    reader = InMemoryMetricReader()
    env = {"OTEL_SWA_TP_RANK": "2", "OTEL_SWA_PP_RANK": "1"}
    telemetry = configure(exporters="none", metric_readers=[reader], dp_rank=3, default_service_name="replay",
                          resource_attributes={"deployment.environment.name": "ci"},
                          use_global=False, set_global=False, environ=env)
    attrs = telemetry.resource.attributes
    assert (attrs["otel_swa.tp_rank"], attrs["otel_swa.dp_rank"], attrs["otel_swa.pp_rank"]) == (2, 3, 1)
    assert attrs["deployment.environment.name"] == "ci"
    assert telemetry.owned == ("traces", "metrics", "logs")
    telemetry.sink(RECORDS[0], None)
    points = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert points["kv_cache.swa.tokens.out_of_window"].data.data_points[0].value == 311
    telemetry.shutdown()
    telemetry.shutdown()  # idempotent


def test_configure_reuses_given_providers_and_never_shuts_them_down(pipeline):
    telemetry = configure(**pipeline.providers(), use_global=False, set_global=False, environ={})
    assert telemetry.owned == ()
    assert telemetry.tracer_provider is pipeline.tracer_provider
    telemetry.shutdown()
    # still usable: not shut down by configure's shutdown
    with pipeline.tracer_provider.get_tracer("t").start_as_current_span("after"):
        pass
    assert [s.name for s in pipeline.spans.get_finished_spans()] == ["after"]


def test_configure_refuses_a_bad_rank():
    with pytest.raises(ConfigError, match="OTEL_SWA_TP_RANK='-1': expected an integer >= 0"):
        configure(exporters="none", use_global=False, set_global=False, environ={"OTEL_SWA_TP_RANK": "-1"})
    with pytest.raises(ConfigError, match="pp_rank='1'; expected an integer >= 0"):
        configure(exporters="none", pp_rank="1", use_global=False, set_global=False, environ={})


GLOBAL_SCRIPT = r"""
import sys
from opentelemetry import trace, metrics
from opentelemetry.sdk.trace import TracerProvider
from otel_swa.telemetry import configure
mine = TracerProvider()
trace.set_tracer_provider(mine)
t = configure(exporters="none", environ={"OTEL_SERVICE_NAME": "svc"})
assert t.tracer_provider is mine, "an installed global provider must be reused"
assert trace.get_tracer_provider() is mine, "and never replaced"
assert t.owned == ("metrics", "logs"), t.owned
assert metrics.get_meter_provider() is t.meter_provider, "a missing one is built and installed"
t.shutdown()
print("ok")
"""


def test_configure_reuses_an_installed_global_provider_and_installs_missing_ones():
    # global providers can be set once per process: run in a fresh interpreter
    out = subprocess.run([sys.executable, "-c", GLOBAL_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


BAD_EXPORTER_SCRIPT = r"""
import threading
from opentelemetry import trace, metrics
from opentelemetry._logs import get_logger_provider
from otel_swa.config import ConfigError
from otel_swa.telemetry import configure
try:
    configure(exporters="otlp", environ={})
except ConfigError as exc:
    message = str(exc)
else:
    raise SystemExit("a bad compression value must raise")
assert "logs exporter 'otlp_proto_grpc'" in message and "bogus" in message, message
# nothing built for traces and metrics stays installed or running
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider", trace.get_tracer_provider()
assert type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider", metrics.get_meter_provider()
assert type(get_logger_provider()).__name__ == "ProxyLoggerProvider", get_logger_provider()
assert [t.name for t in threading.enumerate()] == ["MainThread"], threading.enumerate()
print("ok")
"""


def test_configure_with_a_bad_exporter_setting_builds_and_installs_nothing():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    # gRPC exporters refuse an unknown compression in their constructor; only the logs one gets it
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_LOGS_COMPRESSION"] = "bogus"
    out = subprocess.run([sys.executable, "-c", BAD_EXPORTER_SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_logs_exporter_entry_point_works_with_the_sdk_configurator():
    # OTEL_LOGS_EXPORTER=swa_logline is what opentelemetry-instrument hands to the SDK configurator
    script = r"""
import os
os.environ["OTEL_LOGS_EXPORTER"] = "swa_logline"
from opentelemetry.sdk._configuration import _initialize_components
_initialize_components()
from otel_swa.telemetry import SwaTelemetrySink
from otel_swa.record import SwaDivergenceRecord
sink = SwaTelemetrySink(span_events=False)
sink(SwaDivergenceRecord(20, 5120, 2048, 17, 311), None)
from opentelemetry._logs import get_logger_provider
get_logger_provider().shutdown()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # no handler on logger otel_swa: the exporter falls back to stderr
    assert LINES[0] + "\n" in out.stderr


@pytest.fixture
def basic_config_root():
    """A root logger as ``logging.basicConfig()`` leaves it (one stream handler, level WARNING),
    with logger ``otel_swa`` at NOTSET; both restored afterwards."""
    import io as _io

    root, ours = logging.getLogger(), logging.getLogger("otel_swa")
    saved = (root.level, ours.level)
    stream = _io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    ours.setLevel(logging.NOTSET)
    yield stream
    root.removeHandler(handler)
    root.setLevel(saved[0])
    ours.setLevel(saved[1])


def test_logline_exporter_is_heard_under_basic_config(basic_config_root):
    provider = logline_provider(SwaLogLineExporter())
    sink = SwaTelemetrySink(logger_provider=provider, span_events=False)
    sink(RECORDS[0], None)
    provider.shutdown()
    assert basic_config_root.getvalue() == "INFO:otel_swa:" + LINES[0] + "\n"
    assert logging.getLogger("otel_swa").level == logging.INFO


def test_logline_exporter_keeps_a_level_the_application_set(basic_config_root):
    logging.getLogger("otel_swa").setLevel(logging.ERROR)  # the application silenced otel_swa
    provider = logline_provider(SwaLogLineExporter())
    SwaTelemetrySink(logger_provider=provider, span_events=False)(RECORDS[0], None)
    provider.shutdown()
    assert basic_config_root.getvalue() == ""
    assert logging.getLogger("otel_swa").level == logging.ERROR


def test_logline_exporter_writes_the_run_start_marker_and_audit_lines_from_event_attributes():
    stream = io.StringIO()
    provider = logline_provider(SwaLogLineExporter(stream))
    sink = SwaTelemetrySink(logger_provider=provider, span_events=False)
    audited = R(20, 5120, 2048, 17, 311, verify_source="kv_canary", swa_leaked_slots=4, swa_stale_tokens=0,
                swa_shared_slots=0, swa_pages_in_use=12, swa_pages_referenced=11)
    sink(audited, None)
    sink(R(40, 9000, 3000, 0, 640, verify_source="kv_canary"), None)
    provider.shutdown()
    assert stream.getvalue().splitlines() == [
        f'otel_swa[verify=kv_canary] otel_swa_run_start={{"pid":{os.getpid()}}}',
        "otel_swa[verify=kv_canary] " + LINES[0],
        'otel_swa[verify=kv_canary] otel_swa_audit={"forward_ct":20,"swa_leaked_slots":4,"swa_stale_tokens":0,'
        '"swa_shared_slots":0,"swa_pages_in_use":12,"swa_pages_referenced":11}',
        "otel_swa[verify=kv_canary] " + LINES[1],
    ]
    assert list(find_all(stream.getvalue())) == [audited, R(40, 9000, 3000, 0, 640, verify_source="kv_canary")]


def test_logline_exporter_refuses_a_value_above_int64_and_writes_nothing_for_it():
    stream = io.StringIO()
    exporter = SwaLogLineExporter(stream)
    provider = logline_provider(exporter)
    attributes = {f"kv_cache.swa.{name}": 1 for name in
                  ("forward_ct", "verify_full", "verify_swa", "swa_full_idx_divergence", "swa_out_of_window_tokens")}
    attributes["kv_cache.swa.verify_full"] = 2**63
    provider.get_logger("x").emit(event_name="kv_cache.swa.divergence_sample", attributes=attributes)
    provider.shutdown()
    assert (stream.getvalue(), exporter.malformed, exporter.lines_written) == ("", 1, 0)


AUDITED = R(20, 5120, 2048, 17, 311, verify_source="attention", swa_leaked_slots=4, swa_stale_tokens=0,
            swa_shared_slots=0, swa_pages_in_use=12, swa_pages_referenced=11)
AUDITED_LINES = [
    "otel_swa[verify=attention] " + LINES[0],
    'otel_swa[verify=attention] otel_swa_audit={"forward_ct":20,"swa_leaked_slots":4,"swa_stale_tokens":0,'
    '"swa_shared_slots":0,"swa_pages_in_use":12,"swa_pages_referenced":11}',
]


def test_logline_exporter_rebuilds_the_record_of_a_sample_event_another_emitter_made():
    """An event of the sample's name that carries no record (emitted by other code, or read back
    from a log store and emitted again) is written from its attributes."""
    from otel_swa.telemetry.events import record_attributes

    stream = io.StringIO()
    provider = logline_provider(SwaLogLineExporter(stream))
    provider.get_logger("elsewhere").emit(event_name="kv_cache.swa.divergence_sample", attributes=record_attributes(AUDITED))
    provider.shutdown()
    assert stream.getvalue().splitlines()[1:] == AUDITED_LINES


def test_logline_exporter_writes_the_whole_record_when_the_sdk_cut_the_event_attributes(recwarn):
    """The sink's events carry their record: a log record attribute limit that drops most of the
    event's attributes (OTEL_LOGRECORD_ATTRIBUTE_COUNT_LIMIT) no longer costs the line."""
    from opentelemetry.sdk._logs import LogRecordLimits

    stream = io.StringIO()
    provider = LoggerProvider(log_record_limits=LogRecordLimits(max_attributes=3))
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter := SwaLogLineExporter(stream)))
    SwaTelemetrySink(logger_provider=provider, span_events=False)(AUDITED, None)
    provider.shutdown()
    assert stream.getvalue().splitlines()[1:] == AUDITED_LINES
    assert (exporter.malformed, exporter.lines_written) == (0, 1)
