"""The golden runs: small ``otel-swa replay`` runs of the reference engine whose logs together hold
every line kind otel-swa writes, and what ``otel-swa check`` and ``otel-swa records`` print on them.

Each scenario is one ``otel-swa replay ... --log-file FILE`` (run in-process through
:func:`otel_swa.cli.main`, with a fault made on purpose on the engine the replay builds) and gives
these texts, normalised (:func:`normalise`), each kept as a file under ``tests/golden/data/``:

* ``<name>.log``: the log file, every line;
* ``<name>.replay.txt``: the replay's exit status, its summary rows (the ``wall time`` row left
  out: it is a measured time), its standard error and what it logged at WARNING or above;
* ``<name>.check.txt``: ``otel-swa check -v --run each FILE``: exit status and output;
* ``<name>.records.jsonl`` / ``<name>.records.csv``: ``otel-swa records`` in both formats;
* ``foreign_corrupt.metrics.json``: one run's metric points (:mod:`golden_metrics`).

The faults come from ``tests/cli`` and ``tests/reference`` (imported from there as they are) and
from :mod:`golden_faults`; a change that moves one of them moves the import here, and one that
changes what a fault does changes these runs.

What is normalised, and only that (everything else must stay byte for byte): the date and time of
the log prefix and of ``records``' timestamps (``<time>``), the process id of the run start line
(``"pid":<pid>``) and the log file's path (``<log>``). Every run starts from an environment without
``OTEL_*`` and SGLang's interval variable, plus the scenario's own variables.

To write the files again (only from a commit whose lines are the reference)::

    PYTHONPATH=$PWD:$PWD/instrumentation .venv/bin/python tests/golden/golden_scenarios.py --write

``--write DIR`` writes them elsewhere (to compare by hand); ``--metrics`` also writes the metric points.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
# the fault injections of the other test folders (tests/cli, tests/reference) are used as they are
for _folder in (HERE, HERE.parent / "cli", HERE.parent / "reference"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import golden_faults  # noqa: E402

#: The options every scenario shares: a small window and a sample every 5 forward steps.
BASE = ["replay", "--window", "32", "--interval", "5", "--no-progress"]


@dataclass(frozen=True)
class Scenario:
    """One golden run.

    Attributes:
        name: the stem of its files.
        argv: ``otel-swa`` arguments after :data:`BASE` (``--log-file`` is added).
        env: environment variables of the run.
        engine_fault: ``fault(engine)`` on the engine the replay builds, or ``None``.
        patch: ``patch(monkeypatch)`` before the run (faults of the tests/cli kind), or ``None``.
        lines: what its log must show (checked by the test, so a golden file cannot lose it).
    """

    name: str
    argv: tuple
    env: dict = field(default_factory=dict)
    engine_fault: "Callable | None" = None
    patch: "Callable | None" = None
    lines: tuple = ()


def _leaky(monkeypatch):
    import leaky_swa_pool  # tests/cli: SGLang #27789, #36081

    leaky_swa_pool.install(monkeypatch, every=40)


def _premature(monkeypatch):
    import window_faults  # tests/cli: sgl-project/sglang#29860

    window_faults.install_premature(monkeypatch)


def _raw_full_read(engine):
    import read_faults  # tests/reference: sglang 0.5.23's torch-native SWA read

    read_faults.install_raw_full_read(engine)


def _write_at_full_index(engine):
    import provenance_faults  # tests/reference: sgl-project/sglang#20181

    provenance_faults.install_swa_write_at_full_index(engine, at=12)


def _foreign_and_corrupt(engine):
    import provenance_faults  # tests/reference: swapped ownership; SGLang's real_kv_post_forward

    provenance_faults.install_swapped_ownership(engine, at=18)
    provenance_faults.install_byte_flip(engine, 33, "swa")


SCENARIOS = (
    # the clean run: run start, record, audit and provenance lines; page size 4 and a small SWA pool
    # so that SWA slots are re-used (divergence above 0)
    Scenario("clean", ("--requests", "16", "--page-size", "4", "--swa-pool", "2048"),
             lines=("otel_swa_run_start=", "kv_canary_swa_divergence=", "otel_swa_audit=", "otel_swa_provenance=")),
    # the slot audit: a leaked page (tests/cli/leaky_swa_pool.py), then a page freed while mapped
    # (stale tokens, then shared slots once it is handed out again)
    Scenario("leaked", ("--requests", "12", "--no-model"), patch=_leaky,
             lines=('"fault":"swa_leaked_slots"',)),
    Scenario("stale_shared", ("--requests", "12", "--page-size", "4", "--no-model"),
             engine_fault=lambda engine: golden_faults.install_freed_while_mapped(engine, at_eviction=20),
             lines=('"fault":"swa_stale_tokens"', '"fault":"swa_shared_slots"')),
    # the window check: premature evictions (tests/cli/window_faults.py)
    Scenario("premature", ("--requests", "10", "--no-model"), patch=_premature,
             lines=('"fault":"swa_premature_evictions"',)),
    # the read check: sliding-window reads at the raw FULL slots (an SWA pool as large as the FULL one)
    Scenario("read_mismatch", ("--requests", "8", "--page-size", "4", "--full-pool", "8192", "--swa-pool", "8192"),
             engine_fault=_raw_full_read, lines=('"fault":"swa_read_mismatches"',)),
    # the write check: sliding-window stores at the raw FULL slots from step 12
    Scenario("write_mismatch", ("--requests", "8", "--page-size", "4", "--full-pool", "8192", "--swa-pool", "8192"),
             engine_fault=_write_at_full_index, lines=('"fault":"kv_write_mismatches"',)),
    # provenance: two requests' SWA mapping entries swapped at step 18, a written byte flipped at 33
    Scenario("foreign_corrupt", ("--requests", "8"), engine_fault=_foreign_and_corrupt,
             lines=('"fault":"kv_foreign_tokens"', '"fault":"kv_corrupt_tokens"')),
    # the liveness warning: samples refused from step 9 to 31 (a view whose host seq_lens are wrong)
    Scenario("liveness", ("--requests", "8", "--no-model"), env={"OTEL_SWA_LIVENESS_STEPS": "15"},
             engine_fault=lambda engine: golden_faults.install_silent_view(engine, 9, 31),
             lines=("otel_swa_liveness=",)),
    # a pipeline of two micro-batches, every micro-batch of a sampled round, on pipeline rank 1
    Scenario("micro_batch", ("--requests", "8", "--page-size", "4", "--swa-pool", "2048"),
             env={"OTEL_SWA_MICRO_BATCHES": "every", "OTEL_SWA_PP_RANK": "1", "OTEL_SWA_TP_RANK": "2"},
             engine_fault=golden_faults.install_pipeline, lines=('"micro_batch":1',)),
)

_TIME_RE = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?")
_PID_RE = re.compile(r'"pid":\d+')


def normalise(text: str, log_path: "str | None" = None) -> str:
    """``text`` with what truly varies between two runs of the same scenario replaced: the log
    file's path by ``<log>``, dates and times by ``<time>``, the run start line's pid by ``<pid>``."""
    if log_path:
        text = text.replace(log_path, "<log>")
    text = _TIME_RE.sub("<time>", text)
    return _PID_RE.sub('"pid":<pid>', text)


def _summary(stdout: str) -> str:
    """The replay summary rows of ``stdout`` (from ``otel-swa replay summary`` on), the measured
    ``wall time`` row left out."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("otel-swa replay summary")), len(lines))
    return "".join(line + "\n" for line in lines[start:] if not line.lstrip().startswith("wall time"))


def _call(argv: list) -> "tuple[int, str, str]":
    """``otel-swa ARGV`` in this process: (exit status, stdout, stderr and what was logged at
    WARNING or above). Logging goes to a handler of its own on the root logger (``LEVEL:
    message``; the logger's name is left out, so a function moved to another module keeps its
    text), so it reads the same under pytest's log capture as in a plain process."""
    from otel_swa.cli import main

    out, err, logged = io.StringIO(), io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(logged)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        root.removeHandler(handler)
    return code, out.getvalue(), err.getvalue() + (f"--- logged\n{logged.getvalue()}" if logged.getvalue() else "")


def _clean_environment(monkeypatch, env: dict) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_") or name.startswith("SGLANG_KV_CANARY"):
            monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _wrap_engine(monkeypatch, fault: Callable) -> None:
    from otel_swa.reference import replay as reference_replay

    real = reference_replay.ReferenceEngine

    def engine(*args, **kwargs):
        built = real(*args, **kwargs)
        fault(built)
        return built

    monkeypatch.setattr(reference_replay, "ReferenceEngine", engine)


def _report(code: int, out: str, err: str) -> str:
    return f"exit status {code}\n--- stdout\n{out}--- stderr\n{err}"


def run(scenario: Scenario, workdir: Path) -> "dict[str, str]":
    """Run ``scenario`` with its log in ``workdir``; return its golden texts, normalised, by file name."""
    import torch

    log = workdir / f"{scenario.name}.log"
    if log.exists():
        log.unlink()
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _clean_environment(monkeypatch, scenario.env)
        if scenario.patch is not None:
            scenario.patch(monkeypatch)
        if scenario.engine_fault is not None:
            _wrap_engine(monkeypatch, scenario.engine_fault)
        code, out, err = _call([*BASE, *scenario.argv, "--log-file", str(log)])
        texts = {
            f"{scenario.name}.log": log.read_text(encoding="utf-8"),
            f"{scenario.name}.replay.txt": _report(code, _summary(out), err),
            f"{scenario.name}.check.txt": _report(*_call(["check", "-v", "--run", "each", str(log)])),
            f"{scenario.name}.records.jsonl": _report(*_call(["records", str(log)])),
            f"{scenario.name}.records.csv": _report(*_call(["records", "--format", "csv", str(log)])),
        }
    torch.set_num_threads(threads)
    return {name: normalise(text, str(log)) for name, text in texts.items()}


def _write(directory: Path, metrics: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for scenario in SCENARIOS:
            for name, text in run(scenario, Path(work)).items():
                (directory / name).write_text(text, encoding="utf-8")
            print(f"{scenario.name}: written")
        if metrics:
            import golden_metrics

            (directory / golden_metrics.FILE).write_text(golden_metrics.dump(golden_metrics.collect(Path(work))),
                                                         encoding="utf-8")
            print("metrics: written")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write the golden files of tests/golden")
    parser.add_argument("--write", nargs="?", const=str(DATA), metavar="DIR", required=True,
                        help=f"the folder to write them to (default {DATA})")
    parser.add_argument("--metrics", action="store_true", help="also the metric points")
    args = parser.parse_args()
    _write(Path(args.write), args.metrics)
