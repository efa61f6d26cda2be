"""`otel-swa replay` end to end on the packaged trace: SGLang-parsable lines and a summary that agrees."""

import json
import re

import pytest

from otel_swa.cli import main

PREFIX = "kv_canary_swa_divergence="


def sglang_rule(text):
    """SGLang's parsing rule, written independently: find the prefix, take the following run of
    non-space characters, JSON-decode it."""
    out = []
    for line in text.splitlines():
        at = line.find(PREFIX)
        if at < 0:
            continue
        payload = re.match(r"\S+", line[at + len(PREFIX):]).group(0)
        out.append(json.loads(payload))
    return out


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory):
    log_file = tmp_path_factory.mktemp("replay") / "run.log"
    capture = pytest.MonkeyPatch()
    import io
    import sys

    buffer = io.StringIO()
    capture.setattr(sys, "stdout", buffer)
    try:
        code = main(["replay", "--requests", "300", "--no-model", "--no-progress", "--interval", "20", "--log-file", str(log_file)])
    finally:
        capture.undo()
    return code, buffer.getvalue(), log_file.read_text()


def test_replay_wall_time_is_the_commands_and_counts_the_replay_and_the_stop(capsys):
    import time

    started = time.monotonic()
    assert main(["replay", "--requests", "5", "--no-model", "--no-progress", "--exporter", "none"]) == 0
    elapsed = time.monotonic() - started
    row = re.search(r"^  wall time\s+(\d+\.\d) s \(replay (\d+\.\d) s, stop (\d+\.\d) s\)$",
                    capsys.readouterr().out, re.MULTILINE)
    assert row, "no wall time row"
    total, replayed, stop = (float(value) for value in row.groups())
    assert replayed + stop <= total + 0.1  # each rounded to 0.1 s
    assert total <= elapsed + 0.05  # never more than the command took


def test_the_wall_time_leaves_out_what_a_shell_ran_before_it_execs_the_command():
    """A shell running its last command with ``exec`` forks the process before its other commands
    (``pip install ... && otel-swa replay``): 1 s of ``sleep`` before the exec is not the command's."""
    import shlex
    import subprocess
    import sys
    import time

    command = " ".join(shlex.quote(part) for part in (
        sys.executable, "-c", "import sys; from otel_swa.cli import main; sys.exit(main())",
        "replay", "--requests", "5", "--no-model", "--no-progress", "--exporter", "none"))
    started = time.monotonic()
    run = subprocess.run(["bash", "-c", f"sleep 1; exec {command}"], capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-2000:]
    row = re.search(r"^  wall time\s+(\d+\.\d) s \(replay", run.stdout, re.MULTILINE)
    assert row, run.stdout[-2000:]
    assert float(row.group(1)) <= elapsed - 1.0 + 0.05  # the sleep, which elapsed holds, is not in it


def test_replay_lines_follow_sglang_rule_and_show_the_swa_path(replay_run):
    code, out, log_text = replay_run
    assert code == 0
    records = sglang_rule(out)
    assert len(records) >= 10
    for rec in records:
        assert list(rec) == ["forward_ct", "verify_full", "verify_swa", "swa_full_idx_divergence", "swa_out_of_window_tokens"]
        assert rec["forward_ct"] % 20 == 0
    assert [r["forward_ct"] for r in records] == list(range(20, 20 * len(records) + 1, 20))
    # SGLang's CI assertion: peaks for divergence/out-of-window, verify lag on the last record
    assert max(r["swa_full_idx_divergence"] for r in records) >= 1
    assert max(r["swa_out_of_window_tokens"] for r in records) >= 1
    assert records[-1]["verify_swa"] < records[-1]["verify_full"]
    # verify totals are cumulative
    assert all(a["verify_full"] <= b["verify_full"] and a["verify_swa"] <= b["verify_swa"] for a, b in zip(records, records[1:]))
    # the log file holds the same lines, each with an SGLang-style prefix
    assert sglang_rule(log_text) == records
    # first the run start marker, then per sample its line and its audit line (the reference engine audits)
    lines = log_text.splitlines()
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] otel_swa\[verify=attention\] "
    assert re.fullmatch(stamp + r'otel_swa_run_start=\{"pid":\d+\}', lines[0])
    assert len(lines) == 1 + 2 * len(records)
    for number, (line, audit) in enumerate(zip(lines[1::2], lines[2::2])):
        assert re.match(stamp + r"kv_canary_swa_divergence=\{", line)
        forward_ct = records[number]["forward_ct"]
        match = re.fullmatch(stamp + r'otel_swa_audit=\{"forward_ct":' + str(forward_ct)
                             + r',"swa_leaked_slots":0,"swa_stale_tokens":0,"swa_shared_slots":0'
                             + r'(?:,"swa_pages_in_use":(\d+),"swa_pages_referenced":(\d+))?'
                             + r',"swa_premature_evictions":0,"swa_late_held_slots":0\}', audit)
        assert match, audit
        if match.group(1) is not None:  # nothing leaked: every SWA page in use is referenced
            assert int(match.group(1)) == int(match.group(2)) > 0


def test_replay_summary_agrees_with_lines(replay_run):
    code, out, _ = replay_run
    records = sglang_rule(out)
    summary = dict(
        (m.group(1), m.group(2)) for m in re.finditer(r"^  ([A-Za-z_ -]+?)\s{2,}(.+)$", out, re.MULTILINE)
    )
    assert summary["requests finished"] == "300 / 300"
    steps = int(summary["forward steps"])
    assert len(records) == steps // 20  # the last sample is delivered, none lost
    assert summary["samples delivered"].startswith(f"{len(records)} / {len(records)} taken")
    assert summary["peak divergence"] == f"{max(r['swa_full_idx_divergence'] for r in records)} tokens"
    assert summary["peak out-of-window"] == f"{max(r['swa_out_of_window_tokens'] for r in records)} tokens"
    assert summary["last verify_full"] == f"{records[-1]['verify_full']} entries"
    assert summary["last verify_swa"] == f"{records[-1]['verify_swa']} entries"
    # the reference engine gives the audit inputs; a healthy allocator shows no fault
    assert summary["SWA slot audit"] == f"clean: peak leaked 0 slots, stale 0 tokens, shared 0 slots ({len(records)} samples)"


def test_replay_exporter_none_prints_no_line(capsys):
    assert main(["replay", "--requests", "5", "--no-model", "--no-progress", "--exporter", "none"]) == 0
    out = capsys.readouterr().out
    assert PREFIX not in out and "otel-swa replay summary" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "/no/such/file.csv"], "/no/such/file.csv"),
        (["--interval", "0"], "'0' is below 1"),
        (["--requests", "-1"], "'-1' is negative"),
        (["--exporter", "zipkin"], "unknown exporter 'zipkin'"),
        (["--page-size", "3"], "--full-pool 65536 is not a multiple of --page-size 3; expected whole pages "
                               "(e.g. --full-pool 65535)"),
        (["--page-size", "16", "--swa-pool", "1000"], "--swa-pool 1000 is not a multiple of --page-size 16; "
                                                      "expected whole pages (e.g. --swa-pool 992)"),
        (["--max-running", "64", "--token-budget", "32"], "--token-budget 32 is below --max-running 64"),
    ],
)
def test_replay_bad_arguments(argv, message, capsys):
    try:
        code = main(["replay", "--no-progress", *argv])
    except SystemExit as exc:  # argparse errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
