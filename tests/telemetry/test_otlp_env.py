"""OTLP variables are checked against the OTLP exporter specification before anything is built."""

from __future__ import annotations

import logging

import pytest

from otel_swa.config import ConfigError
from otel_swa.telemetry import configure
from otel_swa.telemetry.otlp_env import check_otlp_environment

GRPC = {"traces": "grpc", "metrics": "grpc", "logs": "grpc"}


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, r"OTEL_EXPORTER_OTLP_ENDPOINT is set but empty"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "   "}, r"OTEL_EXPORTER_OTLP_ENDPOINT is set but empty"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://c:4317"}, r"OTEL_EXPORTER_OTLP_ENDPOINT='ftp://c:4317' has the scheme 'ftp'"),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "grpc://c:4317"}, r"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT='grpc://c:4317'"),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "-1"}, r"OTEL_EXPORTER_OTLP_TIMEOUT='-1' is negative"),
        ({"OTEL_EXPORTER_OTLP_LOGS_TIMEOUT": "soon"}, r"OTEL_EXPORTER_OTLP_LOGS_TIMEOUT='soon' is not a number"),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "inf"}, r"OTEL_EXPORTER_OTLP_TIMEOUT='inf' is not a finite number"),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "nan"}, r"OTEL_EXPORTER_OTLP_TIMEOUT='nan' is not a finite number"),
        # the gRPC exporter would dial 127.0.0.1:34463 (99999 - 65536) without a word
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:99999"},
         r"OTEL_EXPORTER_OTLP_ENDPOINT='http://127.0.0.1:99999' has no usable port; expected a port from 1 to 65535"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "127.0.0.1:70000"}, r"'127.0.0.1:70000' has no usable port"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:port"}, r"'http://c:port' has no usable port"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:0"}, r"'http://c:0' has port 0"),
    ],
)
def test_unusable_values_are_errors_naming_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        check_otlp_environment(GRPC, environ)


def test_usable_ports_and_no_port_are_fine():
    for endpoint in ("http://c", "http://c:1", "https://[::1]:65535", "http://10.0.0.1:4317/"):
        assert check_otlp_environment(GRPC, {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}) == []


def test_http_needs_a_scheme_grpc_without_one_warns_about_tls():
    with pytest.raises(ConfigError, match=r"'127.0.0.1:4318' has no scheme; OTLP over http/protobuf needs a URL"):
        check_otlp_environment({"traces": "http/protobuf"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4318"})
    warnings = check_otlp_environment(GRPC, {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317"})
    assert warnings == [
        "OTEL_EXPORTER_OTLP_ENDPOINT='127.0.0.1:4317' has no scheme: the gRPC exporter will connect with TLS "
        "(OTEL_EXPORTER_OTLP_INSECURE is not 'true'); write http://127.0.0.1:4317 for a plaintext collector, "
        "https://127.0.0.1:4317 for TLS"
    ]  # once, not once per signal
    assert check_otlp_environment(GRPC, {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317",
                                         "OTEL_EXPORTER_OTLP_INSECURE": "true"}) == []


def test_the_per_signal_variable_wins_over_the_generic_one():
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}
    assert check_otlp_environment({"traces": "grpc"}, environ) == []
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT is set but empty"):
        check_otlp_environment({"traces": "grpc", "metrics": "grpc"}, environ)
    assert check_otlp_environment(GRPC, {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317", "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5"}) == []


def test_configure_refuses_them_before_building_anything(monkeypatch):
    from opentelemetry import trace

    before = trace.get_tracer_provider()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "-5")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT='-5' is negative"):
        configure(exporters="otlp", use_global=False)
    assert trace.get_tracer_provider() is before


def test_configure_logs_the_tls_warning_once(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    with caplog.at_level(logging.WARNING, logger="otel_swa.telemetry.setup"):
        telemetry = configure(exporters="otlp", use_global=False, set_global=False)
    telemetry.shutdown(timeout_s=0.1)
    tls = [r for r in caplog.records if "will connect with TLS" in r.getMessage()]
    assert len(tls) == 1


@pytest.mark.parametrize("variable, value, message", [
    ("OTEL_METRIC_EXPORT_INTERVAL", "-1", r"from the environment: interval value -1.*OTEL_METRIC_EXPORT_INTERVAL expects"),
    ("OTEL_BSP_SCHEDULE_DELAY", "-1", r"from the environment: schedule_delay_millis.*OTEL_BSP_SCHEDULE_DELAY"),
    ("OTEL_METRICS_EXEMPLAR_FILTER", "bogus", r"from the environment: Unknown exemplar filter 'bogus'.*always_on"),
    ("OTEL_SWA_SIGTERM_FLUSH", "yes", "OTEL_SWA_SIGTERM_FLUSH='yes': expected 0 or 1"),
])
def test_settings_the_sdk_or_otel_swa_refuse_are_config_errors(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=message):
        configure(exporters="console", use_global=False, set_global=False)


def test_a_disabled_sdk_builds_no_exporter(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    telemetry = configure(exporters="otlp,console", use_global=False, set_global=False)
    try:
        assert telemetry.exporters == {"traces": [], "metrics": [], "logs": []} and telemetry.accounted == []
    finally:
        telemetry.shutdown()


def test_an_empty_exporter_list_is_refused():
    with pytest.raises(ConfigError, match="exporters=' , ' names no exporter"):
        configure(exporters=" , ", use_global=False, set_global=False)
