"""The detection table's rows, written and read back (no engine needed); the engine suites compare
docs/engines.md's table with the rows they measure (``test_vllm_block_audit_real.py``)."""

from __future__ import annotations

import json

import pytest

import detection_table as dt

ROW = {"engine": "vllm 0.33.0", "fault": "leak (a | b)", "upstream": "vllm#1", "signal": "kv_leaked_blocks",
       "injected_at": 30, "first_forward_ct": 31, "offender": "block 5", "check_exit": 1}
MISSED = {**ROW, "fault": "early free", "signal": "none", "first_forward_ct": None, "offender": None, "check_exit": 0}


def test_rows_read_back_from_the_markdown_table_as_written():
    text = f"intro\n{dt.BEGIN}\n" + "\n".join(dt.markdown([ROW, MISSED])) + f"\n{dt.END}\nafter"
    assert dt.docs_rows(text) == [ROW, MISSED]
    assert dt.docs_rows(text, "sglang 0.5.23 Engine") == []
    assert "| never |" in text and "| none |" in text and "`kv_leaked_blocks`" in text and "leak (a \\| b)" in text


def test_rows_are_written_as_json_lines_beside_the_other_engines(tmp_path, monkeypatch):
    monkeypatch.setenv(dt.ROWS_VARIABLE, str(tmp_path / "rows"))
    (tmp_path / "rows").mkdir()
    other = {"engine": "sglang 0.5.23 Engine", "fault": "leak", "canary": "violations=0"}
    (tmp_path / "rows" / dt.ROWS_FILE).write_text(json.dumps(other) + "\n" + json.dumps(MISSED) + "\n")
    path = dt.write_rows("vllm 0.33.0", [ROW])
    assert path == tmp_path / "rows" / "detection.json"
    assert dt.read_rows(path) == [other, ROW]  # the engine's earlier rows replaced, the others kept
    assert dt.read_rows(path, "vllm 0.33.0") == [ROW]
    with pytest.raises(ValueError, match="a row of engine 'vllm 0.33.0' among the rows of 'SGLang'"):
        dt.write_rows("SGLang", [ROW])
    with pytest.raises(ValueError, match="a detection row has the keys"):
        dt.write_rows("vllm 0.33.0", [{"engine": "vllm 0.33.0"}])


def test_the_docs_table_is_well_formed():
    rows = dt.docs_rows(dt.DOCS.read_text())
    assert rows and all(tuple(row) == dt.KEYS for row in rows)
    with pytest.raises(ValueError, match="markers are not in the text"):
        dt.docs_rows("no table here")
