"""`otel-swa replay` honours the environment: the interval variables (0 = off), the ring size, the ranks."""

import re

import pytest

from otel_swa.cli import main

RUN = ["replay", "--requests", "5", "--no-model", "--no-progress"]
VARIABLES = (
    "OTEL_SWA_DIVERGENCE_INTERVAL", "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL", "OTEL_SWA_RING_SIZE",
    "OTEL_SWA_TP_RANK", "OTEL_SWA_DP_RANK", "OTEL_SWA_PP_RANK",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _summary(out):
    return dict((m.group(1), m.group(2)) for m in re.finditer(r"^  ([a-z_ -]+?)\s{2,}(.+)$", out, re.MULTILINE))


@pytest.mark.parametrize("name", ["OTEL_SWA_DIVERGENCE_INTERVAL", "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL"])
def test_interval_zero_in_the_environment_switches_the_reporter_off(monkeypatch, capsys, name):
    monkeypatch.setenv(name, "0")
    assert main(RUN) == 0
    out = capsys.readouterr().out
    assert "kv_canary_swa_divergence=" not in out
    assert _summary(out)["samples delivered"] == "reporter off (interval 0)"


def test_interval_from_the_environment_is_used_and_the_option_wins(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "7")
    assert main(RUN) == 0
    out = capsys.readouterr().out
    cts = [int(m) for m in re.findall(r'kv_canary_swa_divergence=\{"forward_ct":(\d+)', out)]
    steps = int(_summary(out)["forward steps"])
    assert cts == list(range(7, steps + 1, 7))
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "0")
    assert main(RUN + ["--interval", "9"]) == 0
    out = capsys.readouterr().out
    assert [int(m) for m in re.findall(r'kv_canary_swa_divergence=\{"forward_ct":(\d+)', out)] == list(range(9, steps + 1, 9))


@pytest.mark.parametrize("value, message", [
    ("abc", "OTEL_SWA_RING_SIZE='abc': expected an integer from 1 to 1024"),
    ("0", "OTEL_SWA_RING_SIZE='0': expected an integer from 1 to 1024"),
])
def test_bad_ring_size_exits_2_naming_the_variable(monkeypatch, capsys, value, message):
    monkeypatch.setenv("OTEL_SWA_RING_SIZE", value)
    assert main(RUN) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("ranks, expected", [
    ({}, "TP0"),
    ({"OTEL_SWA_TP_RANK": "3"}, "TP3"),
    ({"OTEL_SWA_DP_RANK": "1", "OTEL_SWA_PP_RANK": "0", "OTEL_SWA_TP_RANK": "3"}, "DP1 PP0 TP3"),
    ({"OTEL_SWA_PP_RANK": "2"}, "PP2 TP0"),
])
def test_line_prefix_carries_the_ranks_and_reads_back(monkeypatch, capsys, ranks, expected):
    from otel_swa.logsource import logged_records

    for name, value in ranks.items():
        monkeypatch.setenv(name, value)
    assert main(RUN + ["--interval", "5"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "kv_canary_swa_divergence=" in line]
    assert lines and all(re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d " + expected + r"\] otel_swa\[verify=attention\] kv_canary", line) for line in lines)
    assert {item.rank for item in logged_records(out)} == {expected}


def test_bad_rank_exits_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_SWA_TP_RANK", "-1")
    assert main(RUN) == 2
    assert "OTEL_SWA_TP_RANK='-1': expected an integer >= 0" in capsys.readouterr().err


def _replay_subprocess(extra_env):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra_env)
    args = [sys.executable, "-m", "otel_swa.cli", "replay", "--requests", "30", "--no-model", "--no-progress"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_standard_exporter_variables_apply_without_the_option():
    out = _replay_subprocess({"OTEL_METRICS_EXPORTER": "console"})
    assert '"name": "kv_cache.swa.tokens.out_of_window"' in out  # the console metrics exporter ran
    assert out.count("kv_canary_swa_divergence=") == 10  # the line stays on, once per sample


def test_line_exporter_from_the_environment_is_not_doubled():
    out = _replay_subprocess({"OTEL_LOGS_EXPORTER": "swa_logline"})
    lines = [line for line in out.splitlines() if "kv_canary_swa_divergence=" in line]
    assert len(lines) == 10 and len(set(lines)) == 10
