"""`otel-swa replay --max-context-len`: a long-context slice runs, and a request that cannot fit is
reported and skipped with a count instead of ending the replay."""

from otel_swa.cli import main
from otel_swa.reference.trace import TraceRequest, load_trace, scale_contexts, write_trace


def test_a_long_context_slice_runs_and_the_request_too_long_is_skipped(tmp_path, capsys, caplog):
    requests = scale_contexts(load_trace("conv", limit=3), 131072)  # prompts stretched up to 128K tokens
    too_long = TraceRequest(requests[-1].arrival_s, 132072, 10)
    path = tmp_path / "long.csv"
    write_trace(requests + [too_long], path)
    code = main(["replay", "--trace", str(path), "--max-context-len", "131072", "--full-pool", "262144",
                 "--no-model", "--no-progress", "--interval", "50"])
    run = capsys.readouterr()
    assert code == 0, run.err
    summary = run.out[run.out.index("otel-swa replay summary"):].splitlines()
    rows = {line[2:20].strip(): line[20:].strip() for line in summary[1:]}
    assert rows["requests finished"] == "3 / 4"
    reason = "request 3 (context 132072 + generated 10 tokens) needs 132081 KV positions; max_context_len is 131072"
    assert rows["requests skipped"] == f"1 (too long for this engine; first: {reason})"
    # reported as it is skipped (a warning; on stderr when the application configures no logging)
    assert [r.getMessage() for r in caplog.records if r.name == "otel_swa.reference.replay"] == [
        f"skipped, cannot fit: {reason}"]
    # the longest of the three held its whole context in the FULL pool
    assert int(rows["peak slots in use"].split()[1]) >= max(r.context_tokens for r in requests)


def test_the_default_limit_is_16384_and_a_longer_request_no_longer_ends_the_replay(tmp_path, capsys):
    path = tmp_path / "one-long.csv"
    write_trace([TraceRequest(0.0, 20000, 4), TraceRequest(0.1, 300, 4)], path)
    code = main(["replay", "--trace", str(path), "--no-model", "--no-progress", "--interval", "2"])
    run = capsys.readouterr()
    assert code == 0, run.err
    assert "  requests finished   1 / 2\n" in run.out
    assert ("  requests skipped    1 (too long for this engine; first: request 0 (context 20000 + generated 4 tokens) "
            "needs 20003 KV positions; max_context_len is 16384)\n") in run.out
