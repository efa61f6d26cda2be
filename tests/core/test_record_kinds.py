"""The record package's shape: one table of line kinds over the prefix table, one match shape, every
prefix spelled in one place, every name the repository imports from ``otel_swa.record`` there."""

from __future__ import annotations

import ast
from pathlib import Path

import otel_swa.record as record
from otel_swa.record import LINE_KINDS, LineMatch
from otel_swa.record.prefixes import PREFIX_WORDS

ROOT = Path(__file__).resolve().parents[2]


def _python_files(*folders: str):
    for folder in folders:
        yield from (p for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def test_every_prefix_has_one_kind_and_every_kind_one_prefix():
    assert sorted(kind.prefix for kind in LINE_KINDS) == sorted(PREFIX_WORDS)
    assert [kind.pairs for kind in LINE_KINDS if kind.prefix == record.LINE_PREFIX] == ["record"]
    for kind in LINE_KINDS:
        assert kind.match_type.per_record == (kind.pairs in ("once", "each")), kind
        assert (kind.changes is not None) == kind.match_type.per_record, kind


def test_every_kind_is_found_as_the_one_match_shape():
    for kind in LINE_KINDS:
        assert issubclass(kind.match_type, LineMatch)
        assert kind.match_type._fields == LineMatch._fields, kind.match_type


def test_no_module_but_the_prefix_table_spells_a_prefix():
    spelled = []
    for path in _python_files("otel_swa", "instrumentation"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                spelled += [(path.relative_to(ROOT).as_posix(), p) for p in PREFIX_WORDS if node.value.startswith(p)]
    assert sorted(spelled) == sorted(("otel_swa/record/prefixes.py", p) for p in PREFIX_WORDS)


def test_every_name_imported_from_the_record_package_is_there():
    wanted = set()
    for path in _python_files("otel_swa", "instrumentation", "tests", "benchmarks", "examples"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "otel_swa.record":
                wanted.update(alias.name for alias in node.names)
    assert {"SwaDivergenceRecord", "find_all", "AuditPairing", "Offender"} <= wanted
    assert sorted(name for name in wanted if not hasattr(record, name)) == []
    assert sorted(name for name in record.__all__ if not hasattr(record, name)) == []
