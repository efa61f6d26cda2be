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
    assert fig._suptitle.get_text() == "SWA KV cache over a run: 5 records, 4 ranks"


def test_log_without_ranks_has_one_unlabelled_row_and_no_rank_count(tmp_path, drawn):
    log = f"{BODY.format(ct=20)}\n{BODY.format(ct=40)}\n"
    plot_records(group_by_rank(logged_records(log)), tmp_path / "run.png")
    (fig,) = drawn
    assert _rows(fig) == ["tokens at sampled step"]
    assert fig._suptitle.get_text() == "SWA KV cache over a run: 2 records"
