"""``otel-swa plot FILE`` read once, each row kept in bounded memory (:class:`otel_swa.plot.RowEnvelope`):
the same rows, labels and drawn values as the whole read of the log, and a long row drawn as its
minima and maxima per bucket of forward steps, its peaks exact."""

import math
import random
from pathlib import Path

import pytest
from test_streamed_verdict import TAG, audit_line, record_line, two_ranks_two_runs

import otel_swa.commands.plot as plot_command
from otel_swa.cli import main
from otel_swa.commands._loginput import load_entries
from otel_swa.plot import ENVELOPE_CAPACITY, RowEnvelope
from otel_swa.record import SwaDivergenceRecord as R


def drawn(row):
    """What a row draws: its records, bucket width, points of each series and lag steps (``nan`` as text)."""
    steps = row.lag_steps()
    return row.count, row.width, row.series(), None if steps is None else repr(steps)


def whole_rows(path, runs):
    entries, _ = load_entries(str(path))
    return {label: RowEnvelope.of(records, ENVELOPE_CAPACITY)
            for label, records in plot_command.rows_of(entries, runs).items()}


def both_writers(path, records=30):
    """SGLang's own record lines and otel-swa's tagged lines of two ranks in one log (otel-swa's drawn)."""
    lines = []
    for i in range(records):
        ct = 20 * (i + 1)
        for rank in ("TP0", "TP1"):
            prefix = f"[2026-12-07 10:00:{i % 60:02d} {rank}] "
            lines.append(prefix + record_line(ct, 900 * (i + 1), 300 * (i + 1), i % 5, i % 7))
            lines.append(prefix + TAG + record_line(ct, 1000 * (i + 1), 400 * (i + 1), i % 11, i % 13))
            lines.append(prefix + TAG + audit_line(ct))
    path.write_text("\n".join(lines) + "\n")


def cut_last_line(path):
    """Two ranks and two runs, the last line (a record) cut in the middle."""
    two_ranks_two_runs(path, records=12)
    text = path.read_text()
    path.write_text(text + "[2026-12-07 10:00:12 TP0] " + TAG + record_line(260, 13000, 5200, 1, 2)[:40])


def several_processes(path):
    """A record whose log prefix another process's write took: only the whole log can say whose it is."""
    two_ranks_two_runs(path, records=6)
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "forward_ct\":60" in line and "TP1]" in line)
    lines[at] = lines[at].split("] ", 1)[1]
    path.write_text("\n".join(lines) + "\n")


LOGS = {
    "two ranks, two runs": lambda path: two_ranks_two_runs(path, records=25, leaked_at=4),
    "two ranks, two runs, 3,000 records a row": lambda path: two_ranks_two_runs(path, records=3000),
    "SGLang's and otel-swa's lines": both_writers,
    "a cut last line": cut_last_line,
    "lines of several processes": several_processes,
}


@pytest.mark.parametrize("runs", ["each", "last"])
@pytest.mark.parametrize("log", list(LOGS))
def test_streamed_rows_are_the_whole_reads(tmp_path, capsys, monkeypatch, log, runs):
    path = tmp_path / "run.log"
    LOGS[log](path)
    streamed = plot_command.streamed_rows(str(path), runs)
    whole = whole_rows(path, runs)
    if log == "lines of several processes":
        assert streamed is None  # read whole
    else:
        rows, errors = streamed
        assert list(rows) == list(whole) and errors == []
        assert {label: drawn(row) for label, row in rows.items()} == {label: drawn(row) for label, row in whole.items()}
    expected = {
        "each": ["run 1 TP0", "run 1 TP1", "run 2 TP0", "run 2 TP1"],
        "last": ["TP0", "TP1"],
    }[runs] if log != "SGLang's and otel-swa's lines" else ["TP0", "TP1"]
    assert list(whole) == expected

    # the command, streamed and whole: the same rows handed to the figure, the same output
    handed = []
    monkeypatch.setattr(plot_command, "plot_records", lambda rows, out, title=None: handed.append(rows) or out)
    argv = ["plot", str(path), "-o", str(tmp_path / "run.png"), "--run", runs]
    capsys.readouterr()
    assert main(argv) == 0
    first = capsys.readouterr()
    monkeypatch.setattr(plot_command, "streamed_rows", lambda *args: None)
    assert main(argv) == 0
    assert capsys.readouterr() == first
    assert [{label: drawn(row) for label, row in rows.items()} for rows in handed[:1]] == [
        {label: drawn(row) for label, row in rows.items()} for rows in handed[1:]]
    if log == "a cut last line":
        assert "the last line (" in first.err and "read without it" in first.err
    if log == "two ranks, two runs, 3,000 records a row":
        assert all(row.reduced for row in handed[0].values())


def test_a_long_row_is_drawn_as_min_and_max_per_bucket_its_peaks_exact(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    n, spike_at, dip_at = 9000, 6123, 4321
    full = swa = 10**6
    lines, points = [], []
    for i in range(n):
        ct = 20 * (i + 1)
        div = 10**6 if i == spike_at else (i * 37) % 500
        oow = 7 if i == dip_at else 100 + (i * 53) % 900
        step = 5000 if i == spike_at else -40 if i == dip_at else (i * 13) % 300  # Δ(full - swa)
        swa += 100 + (i * 7) % 50
        full += 100 + (i * 7) % 50 + step  # both counters only grow
        points.append((ct, div, oow, step))
        lines.append(f"[2026-12-07 10:00:00 TP0] {TAG}" + record_line(ct, full, swa, div, oow))
    path = tmp_path / "run.log"
    path.write_text("\n".join(lines) + "\n")
    assert main(["plot", str(path), "-o", str(tmp_path / "run.png")]) == 0
    (fig,) = figures

    # forward_ct 20..180,000: the smallest power of two with at most 2,048 buckets is 128 (1,407 buckets)
    width = next(w for w in (2**k for k in range(30)) if len({ct // w for ct, *_ in points}) <= ENVELOPE_CAPACITY)
    assert width == 128
    buckets = {}
    for ct, div, oow, step in points:
        buckets.setdefault(ct // width, []).append((ct, div, oow, step))

    def extremes(index):
        out = set()
        for held_points in buckets.values():
            low = min(held_points, key=lambda p: (p[index], p[0]))
            high = max(held_points, key=lambda p: (p[index], -p[0]))
            out |= {(low[0], low[index]), (high[0], high[index])}
        return sorted(out)

    ax_tokens, ax_lag = fig.axes
    div_line, oow_line = ax_tokens.lines
    assert list(zip(div_line.get_xdata(), div_line.get_ydata())) == extremes(1)
    assert list(zip(oow_line.get_xdata(), oow_line.get_ydata())) == extremes(2)
    assert (20 * (spike_at + 1), 10**6) in extremes(1) and (20 * (dip_at + 1), 7) in extremes(2)
    assert max(div_line.get_ydata()) == 10**6 and min(oow_line.get_ydata()) == 7
    assert div_line.get_marker() == "None"
    # the lag of each interval (from the first record on), in the bucket of the forward_ct ending it
    lags = {}
    for ct, _, _, step in points[1:]:
        lags.setdefault(ct // width, []).append(step)
    band = ax_lag.patches[0]
    keys = sorted(lags)
    assert keys == list(range(keys[0], keys[-1] + 1))  # no gap: one step a bucket
    assert list(band.get_data().values) == [max(lags[k]) for k in keys]
    assert list(band.get_data().baseline) == [min(lags[k]) for k in keys]
    assert list(band.get_data().edges) == [20] + [(k + 1) * width for k in keys[:-1]] + [20 * n]
    assert max(band.get_data().values) == 5000 and min(band.get_data().baseline) == -40
    assert ax_tokens.get_title().endswith(f"min and max per 128 forward steps ({n} records)")
    assert "band from min to max per 128 forward steps" in ax_lag.get_title()


def test_an_envelope_keeps_every_point_up_to_its_capacity(tmp_path):
    records = [R(20 * (i + 1), 1000 * (i + 1) + i * i, 400 * (i + 1), i % 9, i % 4) for i in range(50)]
    row = RowEnvelope.of(records, capacity=50)
    assert not row.reduced and row.count == 50
    x = [20 * (i + 1) for i in range(50)]
    assert row.series() == {"swa_full_idx_divergence": (x, [i % 9 for i in range(50)]),
                            "swa_out_of_window_tokens": (x, [i % 4 for i in range(50)])}
    # Δ(full - swa) from record i to i + 1: 600 + 2i + 1
    assert row.lag_steps() == ([600 + 2 * i + 1 for i in range(49)], x, None)
    row.add(R(20 * 51, 10**6, 0, 0, 0))
    assert row.reduced and row.count == 51


def test_an_envelope_out_of_order_keeps_each_buckets_extremes():
    # forward_ct going back (a restarted reporter in one row): buckets still hold every record's extremes
    rng = random.Random(7)
    records = [R(rng.randrange(0, 5000), 0, 0, rng.randrange(0, 10**6), rng.randrange(0, 10**6)) for _ in range(3000)]
    row = RowEnvelope.of(records, capacity=64)
    assert row.reduced and len({r.forward_ct // row.width for r in records}) <= 64
    assert len({r.forward_ct // (row.width // 2) for r in records}) > 64
    for name in ("swa_full_idx_divergence", "swa_out_of_window_tokens"):
        by_bucket = {}
        for r in records:
            by_bucket.setdefault(r.forward_ct // row.width, []).append(getattr(r, name))
        x, y = row.series()[name]
        got = {}
        for ct, value in zip(x, y):
            got.setdefault(ct // row.width, set()).add(value)
        assert got == {k: {min(v), max(v)} for k, v in by_bucket.items()}
    # the verify counters never move: every interval whose forward_ct increases has a lag of 0
    highs, edges, lows = row.lag_steps()
    assert {v for v in highs + lows if not math.isnan(v)} == {0}
    assert edges == sorted(edges) and edges[-1] == max(r.forward_ct for r in records)


GOLDEN = sorted((Path(__file__).resolve().parents[1] / "golden" / "data").glob("*.log"))


@pytest.mark.parametrize("path", GOLDEN, ids=[path.stem for path in GOLDEN])
def test_the_golden_logs_streamed_are_the_whole_reads(path, capsys):
    for runs in ("each", "last"):
        rows, errors = plot_command.streamed_rows(str(path), runs)
        whole = whole_rows(path, runs)
        assert list(rows) == list(whole) == [None]
        assert [str(e) for e in errors] == [str(e) for e in load_entries(str(path))[1]]
        assert {label: drawn(row) for label, row in rows.items()} == {label: drawn(row) for label, row in whole.items()}
