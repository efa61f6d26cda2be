"""Healthy multi-rank logs whose lines several writers wrote at once pass; one broken rank fails, named.

Each trial writes two logs, one writer per rank (``concurrent_writer.py``: otel-swa's lines after an
SGLang-style ``[time TPn]`` prefix, written in 1, 2 or 3 writes per line): a healthy log, and the
same with the last rank's SWA path broken (no divergence, no out-of-window token, both pools read
alike). Both logs are judged by the three fronts: ``otel-swa check``, the pytest assertion and
the ``swa_records`` fixture. The verdicts are known from how the logs were written: every healthy
rank passes (its samples are idle 70 % of the time, its first one too), the broken rank fails.

Lines written in one write (1 part) come from real processes writing one file at once through
``O_APPEND``: such a line is never split, whatever the load. Lines written in 2 or 3 parts are
interleaved by a seeded scheduler (``concurrent_writer.interleaved``), not by the operating system,
so that every trial holds lines broken by other writers' parts on any machine under any load
(how many is asserted), and the same ones at every run.

Time: about 10 s on 2 CPU cores (3 trials of real processes, 6 of seeded interleavings; judging).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from otel_swa.cli import main
from otel_swa.testing import SwaDivergenceNotObserved, SwaRecordCapture, assert_swa_divergence_observed

sys.path.insert(0, str(Path(__file__).parent))
from concurrent_writer import interleaved, rank_lines  # noqa: E402

WRITER = Path(__file__).with_name("concurrent_writer.py")
RECORDS = 60  # per rank; seeded logs of 60 gave as few wrong verdicts as of 150 (2 in 480, 4 in 960), at 2.5 times less work
YIELD = "0.3"  # the share of lines whose writer yields the processor between their parts
_PREFIX = re.compile(r"\[2026-01-01 00:00:00 TP\d+\] ")


def write_logs(tmp_path: Path, ranks: int, parts: int) -> tuple[Path, Path]:
    """The healthy and the broken log, each written by ``ranks`` processes at once."""
    healthy, broken = tmp_path / "healthy.log", tmp_path / "broken.log"
    procs = []
    for path in (healthy, broken):
        for rank in range(ranks):
            argv = [sys.executable, str(WRITER), str(path), str(rank), str(RECORDS), str(parts), "1", YIELD]
            if path is broken and rank == ranks - 1:
                argv.append("broken")
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE))
    for proc in procs:  # the start: each writer waits for its standard input to close
        proc.stdin.close()
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    return healthy, broken


def interleave_logs(tmp_path: Path, ranks: int, parts: int, seed: int) -> tuple[Path, Path]:
    """The healthy and the broken log, each the writes of ``ranks`` writers interleaved by the
    scheduler seeded with ``seed``."""
    paths = []
    for name, broken_rank in (("healthy", None), ("broken", ranks - 1)):
        writers = [rank_lines(rank, RECORDS, parts, 1, float(YIELD), broken=rank == broken_rank)
                   for rank in range(ranks)]
        path = tmp_path / f"{name}.log"
        path.write_text(interleaved(writers, seed))
        paths.append(path)
    return paths[0], paths[1]


def interleaved_lines(text: str) -> int:
    """Lines another process's write broke into: two log prefixes, or none before a message."""
    return sum(1 for line in text.splitlines() if len(_PREFIX.findall(line)) > 1 or (line and not line.startswith("[")))


def verdicts(path: Path, capsys) -> list[tuple[bool, str]]:
    """``(ok, explanation)`` of the assertion, the fixture and ``otel-swa check`` on ``path``."""
    out = []
    for front in ("assertion", "fixture"):
        try:
            if front == "assertion":
                observation = assert_swa_divergence_observed(path, timeout_s=0)
            else:
                capture = SwaRecordCapture()
                capture.follow(path)
                observation = capture.assert_observed(timeout_s=0)
            out.append((True, observation.explain()))
        except SwaDivergenceNotObserved as exc:
            out.append((False, str(exc)))
    code = main(["check", str(path)])
    out.append((code == 0, capsys.readouterr().out))
    return out


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_concurrent_ranks_healthy_pass_and_a_broken_rank_fails_by_name(tmp_path, capsys, ranks, parts):
    if parts == 1:
        healthy, broken = write_logs(tmp_path, ranks, parts)
    else:
        healthy, broken = interleave_logs(tmp_path, ranks, parts, seed=ranks * 10 + parts)
    for path in (healthy, broken):
        text = path.read_text()
        assert text.count("kv_canary_swa_divergence=") == ranks * RECORDS
        if parts == 1:
            assert interleaved_lines(text) == 0, "a line written in one write is never split"
        else:  # the trial is only worth its name when other writers' parts landed inside lines
            assert interleaved_lines(text) >= 20, text[:2000]
    for ok, message in verdicts(healthy, capsys):
        assert ok, message
        assert f"{ranks * RECORDS} record(s) seen" in message
        assert "runs:" not in message and "FAILED" not in message
    broken_rank = f"TP{ranks - 1}"
    for ok, message in verdicts(broken, capsys):
        assert not ok, message
        failed = [line for line in message.splitlines() if re.match(r"  \S.*: FAILED, \d+ record", line)]
        assert len(failed) == 1 and broken_rank in failed[0], message
        assert "FAILED runs" not in message and "FAILED audit" not in message, message


def test_the_seeded_interleaving_is_the_same_at_every_run_and_breaks_lines_as_processes_do():
    writers = [rank_lines(rank, 20, 3, 1, float(YIELD), broken=False) for rank in range(4)]
    text = interleaved(writers, seed=7)
    assert text == interleaved(writers, seed=7) != interleaved(writers, seed=8)
    # every write is there once, each writer's in its own order
    assert sorted(text) == sorted("".join(chunk for lines in writers for chunks, _ in lines for chunk in chunks))
    for rank, lines in enumerate(writers):  # each writer's messages in its own order (audit lines repeat across ranks)
        at = 0
        for chunks, _ in lines:
            at = text.index(chunks[1], at) + len(chunks[1])
    # lines broken both ways: two prefixes before a message, and a message with no prefix of its own
    assert any(len(_PREFIX.findall(line)) > 1 for line in text.splitlines())
    assert any(line and not line.startswith("[") for line in text.splitlines())


def data_parallel_log(seed: int, records: int = 60, interval: int = 2) -> tuple[str, dict]:
    """A log two data-parallel ranks wrote line by line (every line whole, its own ``[time DPn]``
    prefix), as SGLang's ``dp_size=2`` schedulers write one log: each rank samples every
    ``interval`` forward steps at its own, changing load (its requests differ from the other
    rank's), and the lines land in the order the ranks reach them. Returns the text and each
    rank's ``forward_ct`` values in the order written."""
    import random

    rng = random.Random(seed)
    totals = {rank: [0, 0] for rank in (0, 1)}
    clock = {rank: rng.random() for rank in (0, 1)}
    queue = []
    written = {f"DP{rank}": [] for rank in (0, 1)}
    for rank in (0, 1):
        at = clock[rank]
        for k in range(1, records + 1):
            step = k * interval
            load = rng.randint(40, 160)  # tokens read per forward step, moving with the rank's batch
            totals[rank][0] += load * interval
            totals[rank][1] += max(1, load // 5) * interval
            at += rng.uniform(0.5, 1.5)  # each rank at its own pace: the other can write several lines meanwhile
            queue.append((at, rank, step, tuple(totals[rank])))
    lines = []
    for _, rank, step, (full, swa) in sorted(queue):
        written[f"DP{rank}"].append(step)
        lines.append(f"[2026-01-01 00:00:00 DP{rank}] otel_swa[verify=attention] kv_canary_swa_divergence="
                     f'{{"forward_ct":{step},"verify_full":{full},"verify_swa":{swa},'
                     f'"swa_full_idx_divergence":{1 + step % 7},"swa_out_of_window_tokens":{2 + step % 5}}}')
    return "\n".join(lines) + "\n", written


@pytest.mark.parametrize("seed", range(12))
def test_a_clean_data_parallel_log_of_whole_lines_keeps_every_record_with_its_prefix(tmp_path, capsys, seed):
    # the ranks' loads differ, so one rank's record can fit the other's pace better than its own:
    # with every line whole, the prefix names the rank and the log is one run, both ranks passing
    text, written = data_parallel_log(seed)
    path = tmp_path / "dp.log"
    path.write_text(text)
    assert main(["records", str(path)]) == 0
    import json

    got: dict = {}
    for line in capsys.readouterr().out.splitlines():
        rec = json.loads(line)
        got.setdefault(rec["rank"], []).append(rec["forward_ct"])
        assert rec["run"] == 1, line
    assert got == written
    code = main(["check", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "runs:" not in out and "FAILED" not in out and "stood after another process's log prefix" not in out
