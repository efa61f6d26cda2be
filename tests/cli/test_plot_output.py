"""`otel-swa plot` and `replay --plot`: the output path is checked (suffix, folder) with one clear line."""

import pytest
from cli_support import SGLANG_LINE as LOG
from cli_support import one_line_error as _one_line_error

from otel_swa.cli import main

pytest.importorskip("matplotlib")

# what matplotlib 3.x writes with its Agg canvas (the PDF/PS/SVG/PGF backends register the rest)
WORKING = ".eps, .jpeg, .jpg, .pdf, .pgf, .png, .ps, .raw, .rgba, .svg, .svgz, .tif, .tiff"


def test_plot_to_a_text_suffix_says_which_suffixes_work(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    out = tmp_path / "run.txt"
    assert main(["plot", str(log), "-o", str(out)]) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"otel-swa: error: cannot write {str(out)!r}: '.txt' is not an image format matplotlib writes; use one of ")
    listed = line.split("use one of ")[1].split(", ")
    for suffix in WORKING.split(", "):
        assert suffix in listed
    assert not out.exists()


@pytest.mark.parametrize("name, written", [("run.png", "run.png"), ("run.SVG", "run.SVG"), ("run.pdf", "run.pdf"), ("run", "run.png")])
def test_plot_accepts_image_suffixes_and_names_the_file_written(tmp_path, capsys, name, written):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    assert main(["plot", str(log), "-o", str(tmp_path / name)]) == 0
    assert (tmp_path / written).stat().st_size > 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / written} ")


def test_plot_into_a_missing_folder(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    out = tmp_path / "missing" / "run.png"
    assert main(["plot", str(log), "-o", str(out)]) == 2
    assert _one_line_error(capsys) == (
        f"otel-swa: error: cannot write {str(out)!r}: the folder {str(out.parent)!r} does not exist"
    )
