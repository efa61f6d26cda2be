"""The vLLM detection table of docs/engines.md ("what otel-swa catches"), from the vLLM suite's runs.

The vLLM suite runs its faults made on purpose (``tests/engines/shims/vllm_faults.py``) and writes
one row per run, a JSON object a line, into ``<dir>/detection.json`` (:func:`write_rows`; the SGLang
suite appends its rows to the same file), ``<dir>`` being ``$OTEL_SWA_DETECTION_DIR`` or, unset, a
temporary directory. A row has the keys :data:`KEYS`:

``engine``, ``fault``, ``upstream``
    the engine, the fault's name (with the configuration it ran in) and the upstream report it
    re-creates;
``signal``
    the first otel-swa field that fails ``otel-swa check`` and was non-zero in the run, else the
    first reported field that was, else ``none``;
``injected_at``, ``first_forward_ct``
    the forward step the fault was made in, and the first sampled step whose record shows the
    signal (``None``: never);
``offender``
    that record's first offender of the signal (:meth:`otel_swa.record.Offender.describe`), ``None``
    when the signal has none;
``check_exit``
    the exit status of ``otel-swa check`` on the run's log.

The table in docs/engines.md stands between the :data:`BEGIN` and :data:`END` markers; the suite
compares it with the rows it measured. ``python tests/engines/detection_table.py [DIR]`` prints the
table from the vLLM rows in ``DIR/detection.json``; ``--write`` puts it into docs/engines.md.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

#: The keys of a row, in the table's column order.
KEYS = ("engine", "fault", "upstream", "signal", "injected_at", "first_forward_ct", "offender", "check_exit")
#: Where the suites write their rows (a directory); unset: a temporary directory.
ROWS_VARIABLE = "OTEL_SWA_DETECTION_DIR"
ROWS_FILE = "detection.json"
#: The engine of the vLLM suite's rows.
ENGINE = "vllm 0.33.0"
HEADER = ("engine", "fault (configuration)", "re-creates", "otel-swa signal", "made at step",
          "first flagged at step", "first offender named", "`otel-swa check` exit")
BEGIN = "<!-- detection table: vllm (written by tests/engines/detection_table.py from the vLLM suite's rows) -->"
END = "<!-- end of the vllm detection table -->"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def rows_dir() -> Path:
    """The rows' directory (created): ``$OTEL_SWA_DETECTION_ROWS``, else one temporary directory per process."""
    global _TMP
    path = os.environ.get(ROWS_VARIABLE, "").strip()
    if not path:
        if _TMP is None:
            _TMP = tempfile.mkdtemp(prefix="otel-swa-detection-")
        path = _TMP
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


_TMP: "str | None" = None


def write_rows(engine: str, rows: list) -> Path:
    """Put ``rows`` (dicts with :data:`KEYS`, each ``engine`` = ``engine``) into
    ``<dir>/detection.json`` in place of that engine's earlier rows, the other engines' kept.

    Raises:
        ValueError: a row lacks a key, has another, or names another engine.
    """
    for row in rows:
        if tuple(row) != KEYS:
            raise ValueError(f"a detection row has the keys {tuple(row)}; expected {KEYS}")
        if row["engine"] != engine:
            raise ValueError(f"a row of engine {row['engine']!r} among the rows of {engine!r}")
    path = rows_dir() / ROWS_FILE
    kept = [row for row in read_rows(path) if row.get("engine") != engine]
    path.write_text("".join(json.dumps(row) + "\n" for row in kept + list(rows)))
    return path


def read_rows(path: Path, engine: "str | None" = None) -> list[dict]:
    """The rows of ``path`` (a JSON object a line; ``[]`` when it does not exist), of ``engine`` only when given."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if engine is None or row.get("engine") == engine]


def _cell(key: str, value) -> str:
    if value is None:
        return "none" if key == "offender" else "never"
    if key == "signal" and value != "none":
        return f"`{value}`"
    return str(value).replace("|", "\\|")


def markdown(rows: list) -> list[str]:
    """The table's lines (header, rule, one line per row)."""
    lines = ["| " + " | ".join(HEADER) + " |", "| " + " | ".join("---" for _ in HEADER) + " |"]
    lines += ["| " + " | ".join(_cell(k, row[k]) for k in KEYS) + " |" for row in rows]
    return lines


def _parse(cell: str, key: str):
    cell = cell.strip().replace("\\|", "|")
    if key in ("injected_at", "first_forward_ct", "check_exit"):
        return None if cell == "never" else int(cell)
    if key == "signal":
        return cell.strip("`")
    if key == "offender" and cell == "none":
        return None
    return cell


def docs_rows(text: str, engine: "str | None" = None) -> list[dict]:
    """The rows of the table between :data:`BEGIN` and :data:`END` in ``text`` (those of
    ``engine`` only, when given), as dicts with :data:`KEYS`.

    Raises:
        ValueError: the markers are missing, or a line has another number of cells.
    """
    if BEGIN not in text or END not in text:
        raise ValueError("the detection table's markers are not in the text")
    body = text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()[2:]
    rows = []
    for line in body:
        cells = _split(line)
        if len(cells) != len(KEYS):
            raise ValueError(f"a detection table line has {len(cells)} cells, expected {len(KEYS)}: {line!r}")
        row = {key: _parse(cell, key) for key, cell in zip(KEYS, cells)}
        if engine is None or row["engine"] == engine:
            rows.append(row)
    return rows


def _split(line: str) -> list[str]:
    cells, current, escaped = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "|" and not escaped:
            cells.append(current)
            current = ""
        else:
            current += ch
        escaped = ch == "\\"
    cells.append(current)
    return cells


def main(argv: list[str]) -> int:
    write = "--write" in argv
    args = [a for a in argv[1:] if a != "--write"]
    rows = read_rows((Path(args[0]) if args else rows_dir()) / ROWS_FILE, ENGINE)
    table = "\n".join(markdown(rows))
    if not write:
        print(table)
        return 0
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        print(f"docs/engines.md lacks the lines {BEGIN!r} and {END!r}", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    DOCS.write_text(head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
