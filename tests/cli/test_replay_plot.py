"""`replay --plot` checks its output before the run: matplotlib, the suffix, the folder, the reporter."""

import functools
import sys

import pytest
from cli_support import one_line_error

from otel_swa.cli import main

RUN = ["replay", "--requests", "3", "--no-model", "--no-progress", "--interval", "20"]


def _fail_if_run(*args, **kwargs):
    raise AssertionError("the run started although --plot could not be written")


@pytest.fixture
def no_run(monkeypatch):
    import otel_swa.reference.replay as reference_replay

    monkeypatch.setattr(reference_replay, "replay", _fail_if_run)


_one_line_error = functools.partial(one_line_error, nothing_on_stdout=True)


def test_missing_folder_fails_before_the_run(no_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "missing" / "x.png"
    assert main(RUN + ["--plot", str(out)]) == 2
    assert _one_line_error(capsys) == (
        f"otel-swa replay: cannot write {str(out)!r}: the folder {str(out.parent)!r} does not exist"
    )


def test_wrong_suffix_fails_before_the_run(no_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(RUN + ["--plot", str(tmp_path / "x.txt")]) == 2
    assert "'.txt' is not an image format matplotlib writes; use one of " in _one_line_error(capsys)


def test_without_matplotlib_fails_before_the_run(no_run, monkeypatch, tmp_path, capsys):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(RUN + ["--plot", str(tmp_path / "x.png")]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("otel-swa replay: drawing a plot needs matplotlib")
    assert line.endswith("pip install 'otel-swa[plot]'")


def test_reporter_off_fails_before_the_run(no_run, monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("OTEL_SWA_DIVERGENCE_INTERVAL", "0")
    args = [a for a in RUN if a not in ("--interval", "20")]
    assert main(args + ["--plot", str(tmp_path / "x.png")]) == 2
    assert _one_line_error(capsys) == (
        f"otel-swa replay: --plot {str(tmp_path / 'x.png')!r} needs records, but the reporter is off (interval 0)"
    )


def test_plot_is_written_after_a_good_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(RUN + ["--plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run.png").stat().st_size > 0
    assert f"plot written to {tmp_path / 'run.png'}" in capsys.readouterr().out
