"""``LogFollower`` reads a file in chunks of ``READ_CHUNK_BYTES``: whatever the chunk size, and
wherever a chunk ends (inside a line, between the CR and LF of a CRLF, inside a UTF-8 character),
it finds the same entries, line numbers, malformed lines and cut last line as a read of the whole
text at once."""

import pytest

from otel_swa import logsource
from otel_swa.logsource import LogFollower, logged_entries, split_cut_line

P = "[2026-12-04 18:19:16 TP0] otel_swa[verify=attention] "
LINES = [
    P + 'otel_swa_run_start={"pid":4242}\n',
    P + 'kv_canary_swa_divergence={"forward_ct":20,"verify_full":213894,"verify_swa":60164,'
        '"swa_full_idx_divergence":2798,"swa_out_of_window_tokens":16045}\r\n',
    "progress 10% ä\rprogress 20% é\r",
    P + 'otel_swa_audit={"forward_ct":20,"swa_leaked_slots":0,"swa_stale_tokens":0,"swa_shared_slots":0,'
        '"swa_pages_in_use":3968,"swa_pages_referenced":3968}\n',
    P + 'kv_canary_swa_divergence={"forward_ct":40,"verify_full":777992,"verify_swa":165616,'
        '"swa_full_idx_divergence":4951,"swa_out_of_window_tokens":28321}\n',
    P + 'kv_canary_swa_divergence={"forward_ct":60,"oops"}\n',
    P + 'otel_swa_audit={"forward_ct":40,"swa_leaked_slots":0,"swa_stale_tokens":0,"swa_shar',
]


def _summary(entries, errors):
    return ([(type(e).__name__, e.line_no, getattr(getattr(e, "record", None), "forward_ct", None),
              getattr(getattr(e, "record", None), "swa_leaked_slots", None)) for e in entries],
            [(e.line_no, e.reason) for e in errors])


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 1000, 1 << 20])
def test_chunked_reads_find_what_one_read_finds(tmp_path, monkeypatch, chunk):
    text = "".join(LINES)
    whole, cut = split_cut_line(text)
    errors = []
    want = _summary(logged_entries(whole, errors=errors), errors)
    path = tmp_path / "run.log"
    path.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(logsource, "READ_CHUNK_BYTES", chunk)
    follower = LogFollower(path)
    follower.poll(final=True)
    assert _summary(follower.entries, follower.errors) == want
    assert [(kind, ct, leaked) for kind, _, ct, leaked in want[0]] == [  # the run start, two records (one audited)
        ("LoggedRunStart", None, None), ("LoggedRecord", 20, 0), ("LoggedRecord", 40, None)]
    assert len(want[1]) == 1  # the record line that is no JSON
    assert follower.cut_line == cut and cut is not None and cut.line_no == 6  # bare CRs start no numbered line


@pytest.mark.parametrize("command", ["check", "records"])
def test_a_pipe_path_is_read_from_its_start(capsys, command):
    # `otel-swa check <(my-engine ...)`: the path is a pipe, which cannot seek and can be read once
    # (was: "log file '/dev/fd/63' cannot be read (File or stream is not seekable.)")
    import os

    from otel_swa.cli import main

    read_end, write_end = os.pipe()
    os.write(write_end, "".join(LINES[:2] + LINES[3:5]).encode("utf-8"))
    os.close(write_end)
    try:
        status = main([command, f"/dev/fd/{read_end}"])
    finally:
        os.close(read_end)
    out = capsys.readouterr().out
    if command == "check":
        assert out.startswith(f"SWA path observed in /dev/fd/{read_end}: 2 record(s) seen") and status == 0
    else:
        assert [line.split('"forward_ct":')[1].split(",")[0] for line in out.splitlines()] == ["20", "40"]
        assert status == 0
