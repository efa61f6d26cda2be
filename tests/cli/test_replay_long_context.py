"""`otel-swa replay --max-context-len`: a long-context slice runs, and a request that cannot fit is
reported and skipped with a count instead of ending the replay."""

import subprocess
import sys

from otel_swa.reference.trace import TraceRequest, load_trace, scale_contexts, write_trace


def test_a_long_context_slice_runs_and_the_request_too_long_is_skipped(tmp_path):
    requests = scale_contexts(load_trace("conv", limit=3), 131072)  # prompts stretched up to 128K tokens
    too_long = TraceRequest(requests[-1].arrival_s, 132072, 10)
    path = tmp_path / "long.csv"
    write_trace(requests + [too_long], path)
    run = subprocess.run(
        [sys.executable, "-m", "otel_swa.cli", "replay", "--trace", str(path), "--max-context-len", "131072",
         "--full-pool", "262144", "--no-model", "--no-progress", "--interval", "50"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    summary = run.stdout[run.stdout.index("otel-swa replay summary"):].splitlines()
    rows = {line[2:20].strip(): line[20:].strip() for line in summary[1:]}
    assert rows["requests finished"] == "3 / 4"
    reason = "request 3 (context 132072 + generated 10 tokens) needs 132081 KV positions; max_context_len is 131072"
    assert rows["requests skipped"] == f"1 (too long for this engine; first: {reason})"
    assert run.stderr.splitlines() == [f"skipped, cannot fit: {reason}"]
    # the longest of the three held its whole context in the FULL pool
    assert int(rows["peak slots in use"].split()[1]) >= max(r.context_tokens for r in requests)


def test_the_default_limit_is_16384_and_a_longer_request_no_longer_ends_the_replay(tmp_path):
    path = tmp_path / "one-long.csv"
    write_trace([TraceRequest(0.0, 20000, 4), TraceRequest(0.1, 300, 4)], path)
    run = subprocess.run(
        [sys.executable, "-m", "otel_swa.cli", "replay", "--trace", str(path), "--no-model", "--no-progress",
         "--interval", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "  requests finished   1 / 2\n" in run.stdout
    assert ("  requests skipped    1 (too long for this engine; first: request 0 (context 20000 + generated 4 tokens) "
            "needs 20003 KV positions; max_context_len is 16384)\n") in run.stdout
