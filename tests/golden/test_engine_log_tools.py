"""The engine-log capture's normalisation and the comparison of two captures
(``capture_engine_logs.py``, ``compare_engine_logs.py``), on small captures made by hand."""

from __future__ import annotations

import io

import capture_engine_logs
import compare_engine_logs

LINE = ('[2026-12-07 04:32:37 TP0] otel_swa[verify=kv_canary] kv_canary_swa_divergence={"forward_ct":20,'
        '"verify_full":9,"verify_swa":4,"swa_full_idx_divergence":1,"swa_out_of_window_tokens":2}')


def test_normalise_replaces_times_pids_ports_paths_and_durations_only():
    line = ('[2026-12-07 04:32:37 TP0] otel_swa_run_start={"pid":5747} at 127.0.0.1:43121 in /tmp/b/x0/engine.log '
            'after 1.25 s, object 0x7f3a2b1c9d40, forward_ct 20')
    assert capture_engine_logs.normalise(line, "/tmp/b") == (
        '[<time> TP0] otel_swa_run_start={"pid":<pid>} at 127.0.0.1:<port> in <basetemp>/x0/engine.log '
        'after <dur> s, object <addr>, forward_ct 20')
    assert capture_engine_logs.normalise(LINE, "/tmp/b") == LINE.replace("2026-12-07 04:32:37", "<time>")


def test_keep_logs_keeps_the_otel_swa_lines_of_each_log_in_order(tmp_path):
    basetemp = tmp_path / "basetemp"
    (basetemp / "traced0").mkdir(parents=True)
    (basetemp / "traced0" / "engine.log").write_text(f"INFO sglang: Prefill batch\n{LINE}\nWARNING otel-swa: x\n")
    (basetemp / "traced0" / "results.json").write_text("{}")
    assert capture_engine_logs.keep_logs(basetemp, tmp_path / "out") == 1
    kept = (tmp_path / "out" / "lines" / "traced0" / "engine.log").read_text()
    assert kept == capture_engine_logs.normalise(LINE, str(basetemp)) + "\nWARNING otel-swa: x\n"
    assert (tmp_path / "out" / "raw" / "traced0" / "engine.log").read_text().startswith("INFO sglang")


def _capture(root, files: dict):
    for name, text in files.items():
        path = root / "sglang" / "lines" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "sglang" / "pytest.txt").write_text("command: x\nexit status: 0\n")
    return root


def test_compare_says_identical_differs_missing_and_not_comparable(tmp_path):
    base = _capture(tmp_path / "base", {"a/engine.log": "1\n2\n", "b/engine.log": "x\n", "c/run.log": "s\n",
                                        "d/run.log": "gone\n", "f/engine.log": "k\nv\nk\n"})
    noise = _capture(tmp_path / "noise", {"a/engine.log": "1\n2\n", "b/engine.log": "y\ny\n", "c/run.log": "s\n",
                                          "f/engine.log": "k\nw\nk\n"})
    new = _capture(tmp_path / "new", {"a/engine.log": "1\n2\n", "b/engine.log": "z\n", "c/run.log": "t\n",
                                      "e/run.log": "new\n", "f/engine.log": "k\nu\nk\n"})
    out = io.StringIO()
    assert compare_engine_logs.compare(base, new, noise, 1, 30, out) == 1
    text = out.getvalue().splitlines()
    assert text[0] == "suite sglang: base pytest exit 0, new pytest exit 0, noise pytest exit 0"
    assert "identical       sglang/lines/a/engine.log (2 lines)" in text
    assert ("not comparable  sglang/lines/b/engine.log (1 lines; its length varies between two base runs; "
            "new: 2 lines differ)") in text
    assert "DIFFERS         sglang/lines/c/run.log (2 lines changed)" in text
    assert "    -s" in text and "    +t" in text
    assert "only in BASE    sglang/lines/d/run.log" in text and "only in NEW     sglang/lines/e/run.log" in text
    assert "identical       sglang/lines/f/engine.log (3 lines; 1 of the 1 that vary between two base runs differ)" in text
    assert text[-1] == "2 identical, 1 differs, 2 missing, 1 not comparable"
    # without the second base run, the line that varies is a difference
    out = io.StringIO()
    assert compare_engine_logs.compare(base, new, None, 1, 30, out) == 1
    assert "DIFFERS         sglang/lines/f/engine.log (2 lines changed)" in out.getvalue()
    assert compare_engine_logs.compare(base, base, None, 1, 30, io.StringIO()) == 0
