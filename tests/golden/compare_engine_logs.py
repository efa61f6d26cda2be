"""Compare two captures of the engine suites' otel-swa lines (``capture_engine_logs.py``).

Usage::

    python3 tests/golden/compare_engine_logs.py BASE NEW [--noise BASE2] [--context N] [--most N]

For each normalised file (``<suite>/lines/...``) of either capture it says ``identical``,
``DIFFERS`` (with a short unified diff), ``only in BASE`` or ``only in NEW``. With ``--noise BASE2``
(a second capture of the base commit), the lines that differ between BASE and BASE2 (same length)
are left out of the comparison: a file whose only differences from BASE are such lines is
``identical`` (the count said); a file whose length differs between BASE and BASE2 is ``not
comparable`` (the engine's own batching varied between two runs of the same code) and does not
count against NEW, its diff against NEW summed up in one line. Also says, per suite, the pytest
exit status of each capture (``pytest.txt``).

Exit status: 0 when every comparable file is identical and no file is missing from either side,
1 otherwise, 2 for a capture folder that does not exist.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path


def _files(capture: Path) -> "dict[str, Path]":
    return {path.relative_to(capture).as_posix(): path
            for path in sorted(capture.glob("*/lines/**/*")) if path.is_file()}


def _status(capture: Path, suite: str) -> str:
    report = capture / suite / "pytest.txt"
    if not report.exists():
        return "no pytest.txt"
    match = re.search(r"^exit status: (\S+)", report.read_text(), re.M)
    return f"pytest exit {match.group(1) if match else '?'}"


def _lines(path: Path) -> "list[str]":
    return path.read_text(encoding="utf-8").splitlines()


def _unstable(base: "list[str]", noise: "list[str]") -> "set[int] | None":
    """The indices of the lines of ``base`` that differ in ``noise`` (a second run of the same
    commit), or ``None`` when the two differ in length (the whole file is then not comparable)."""
    if len(base) != len(noise):
        return None
    return {i for i, (a, b) in enumerate(zip(base, noise)) if a != b}


def _diff(a: Path, b: Path, name_a: str, name_b: str, context: int, most: int) -> "tuple[int, str]":
    left = a.read_text(encoding="utf-8").splitlines(keepends=True)
    right = b.read_text(encoding="utf-8").splitlines(keepends=True)
    lines = list(difflib.unified_diff(left, right, fromfile=name_a, tofile=name_b, n=context))
    changed = sum(1 for line in lines if line[:1] in "+-" and not line.startswith(("+++", "---")))
    shown = "".join(lines[:most])
    if len(lines) > most:
        shown += f"    ... {len(lines) - most} more diff lines\n"
    return changed, shown


def compare(base: Path, new: Path, noise: "Path | None", context: int, most: int, out=sys.stdout) -> int:
    base_files, new_files = _files(base), _files(new)
    noise_files = _files(noise) if noise is not None else {}
    suites = sorted({name.split("/", 1)[0] for name in [*base_files, *new_files]})
    for suite in suites:
        extra = f", noise {_status(noise, suite)}" if noise is not None else ""
        print(f"suite {suite}: base {_status(base, suite)}, new {_status(new, suite)}{extra}", file=out)
    counts = {"identical": 0, "differs": 0, "missing": 0, "not comparable": 0}
    for name in sorted({*base_files, *new_files}):
        if name not in new_files:
            counts["missing"] += 1
            print(f"only in BASE    {name}", file=out)
            continue
        if name not in base_files:
            counts["missing"] += 1
            print(f"only in NEW     {name}", file=out)
            continue
        base_lines, new_lines = _lines(base_files[name]), _lines(new_files[name])
        size = len(base_lines)
        unstable = _unstable(base_lines, _lines(noise_files[name])) if name in noise_files else set()
        changed = {i for i, (a, b) in enumerate(zip(base_lines, new_lines)) if a != b}
        if base_lines == new_lines:
            counts["identical"] += 1
            print(f"identical       {name} ({size} lines)", file=out)
        elif unstable is None:
            counts["not comparable"] += 1
            verdict = f"{_diff(base_files[name], new_files[name], '', '', 0, 0)[0]} lines differ"
            print(f"not comparable  {name} ({size} lines; its length varies between two base runs; new: {verdict})",
                  file=out)
        elif len(base_lines) == len(new_lines) and changed <= unstable:
            counts["identical"] += 1
            print(f"identical       {name} ({size} lines; {len(changed)} of the {len(unstable)} that vary between "
                  f"two base runs differ)", file=out)
        else:
            counts["differs"] += 1
            changed, shown = _diff(base_files[name], new_files[name], f"BASE/{name}", f"NEW/{name}", context, most)
            print(f"DIFFERS         {name} ({changed} lines changed)", file=out)
            print("".join("    " + line for line in shown.splitlines(keepends=True)), end="", file=out)
    print(", ".join(f"{value} {key}" for key, value in counts.items()), file=out)
    return 1 if counts["differs"] or counts["missing"] else 0


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--noise", type=Path, help="a second capture of the base commit")
    parser.add_argument("--context", type=int, default=1, help="diff context lines (default 1)")
    parser.add_argument("--most", type=int, default=30, help="diff lines shown per file (default 30)")
    args = parser.parse_args(argv)
    for folder in (args.base, args.new, args.noise):
        if folder is not None and not folder.is_dir():
            print(f"compare_engine_logs: {folder} is not a folder", file=sys.stderr)
            return 2
    return compare(args.base, args.new, args.noise, args.context, args.most)


if __name__ == "__main__":
    sys.exit(main())
