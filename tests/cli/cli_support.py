"""What several CLI tests share: one of SGLang's record lines, and the check that a command failed
with exactly one line on stderr and no traceback."""

from __future__ import annotations

#: One record line as SGLang's KV canary logs it (rank 0, forward step 20: divergence 3, 5 tokens out
#: of window, the SWA pool's verification behind the FULL pool's).
SGLANG_LINE = (
    '[2025-06-01 12:34:56 TP0] kv_canary_swa_divergence={"forward_ct":20,"verify_full":90,"verify_swa":40,'
    '"swa_full_idx_divergence":3,"swa_out_of_window_tokens":5}\n'
)


def one_line_error(capsys, *, nothing_on_stdout: bool = False) -> str:
    """The one line the command wrote on stderr (asserted: one line, no traceback; with
    ``nothing_on_stdout``, an empty stdout too)."""
    captured = capsys.readouterr()
    if nothing_on_stdout:
        assert captured.out == ""
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]
