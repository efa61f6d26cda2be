"""The plot's rows and title when a log mixes ranked lines (``TP0``) and lines without a rank."""

import pytest

from otel_swa.logsource import group_by_rank, logged_records
from otel_swa.plot import plot_records

matplotlib = pytest.importorskip("matplotlib")

BODY = 'kv_canary_swa_divergence={{"forward_ct":{ct},"verify_full":90,"verify_swa":40,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":5}}'


@pytest.fixture
def drawn(monkeypatch):
    """The figure handed to savefig, kept for inspection (the file is still written)."""
    from matplotlib.figure import Figure

    figures = []
    original = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _rows(fig):
    # left panel of each row: its y label names the rank (first line)
    return [ax.get_ylabel() for ax in fig.axes[0::2]]


def test_unranked_lines_next_to_ranked_ones_are_a_labelled_counted_row(tmp_path, drawn):
    log = "\n".join([
        f"[2025-06-01 12:34:56 TP0] {BODY.format(ct=20)}",
        f"[2025-06-01 12:34:56 TP1] {BODY.format(ct=20)}",
        f"[2025-06-01 12:34:56 TP2] {BODY.format(ct=20)}",
        f"2025-06-01 12:34:57,001 INFO {BODY.format(ct=40)}",
        f"{BODY.format(ct=60)}",
    ]) + "\n"
    plot_records(group_by_rank(logged_records(log)), tmp_path / "run.png")
    (fig,) = drawn
    assert _rows(fig) == [
        "TP0\ntokens at sampled step",
        "TP1\ntokens at sampled step",
        "TP2\ntokens at sampled step",
        "no rank\ntokens at sampled step",
    ]
    assert fig._suptitle.get_text() == "SWA KV cache over a run: 5 records, 4 rows"


def test_log_without_ranks_has_one_unlabelled_row_and_no_rank_count(tmp_path, drawn):
    log = f"{BODY.format(ct=20)}\n{BODY.format(ct=40)}\n"
    plot_records(group_by_rank(logged_records(log)), tmp_path / "run.png")
    (fig,) = drawn
    assert _rows(fig) == ["tokens at sampled step"]
    assert fig._suptitle.get_text() == "SWA KV cache over a run: 2 records"


def _appended_log():
    from otel_swa.record import SwaDivergenceRecord, run_start_line

    lines = []
    for run in (2, 3):  # two runs, appended: forward_ct goes back to 20
        lines.append(f"[2025-06-01 12:34:56 TP0] {run_start_line('attention', pid=run)}")
        for ct in range(20, 20 * run + 1, 20):
            lines.append(f"[2025-06-01 12:34:56 TP0] {SwaDivergenceRecord(ct, 9 * ct, 4 * ct, 3, 5, verify_source='attention').line()}")
    return "\n".join(lines) + "\n"


def test_plot_draws_each_run_of_an_appended_log_as_a_row_of_its_own(tmp_path, drawn, capsys):
    from otel_swa.cli import main

    log = tmp_path / "run.log"
    log.write_text(_appended_log())
    assert main(["plot", str(log), "-o", str(tmp_path / "run.png")]) == 0
    (fig,) = drawn
    assert _rows(fig) == ["run 1 TP0\ntokens at sampled step", "run 2 TP0\ntokens at sampled step"]
    # each row's line goes forward only: no line drawn back to the start of the next run
    assert [list(ax.lines[0].get_xdata()) for ax in fig.axes[0::2]] == [[20, 40], [20, 40, 60]]
    assert "5 records, 2 panel row(s)" in capsys.readouterr().out
    drawn.clear()
    assert main(["plot", str(log), "-o", str(tmp_path / "last.png"), "--run", "last"]) == 0
    assert _rows(drawn[0]) == ["TP0\ntokens at sampled step"]


def test_records_label_each_record_with_its_run(tmp_path, capsys):
    import json

    from otel_swa.cli import main

    log = tmp_path / "run.log"
    log.write_text(_appended_log())
    assert main(["records", str(log)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["line_no"], r["run"], r["forward_ct"], r["verify_source"]) for r in rows] == [
        (2, 1, 20, "attention"), (3, 1, 40, "attention"),
        (5, 2, 20, "attention"), (6, 2, 40, "attention"), (7, 2, 60, "attention")]
