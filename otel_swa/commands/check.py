"""Assert that a log shows the SWA path working: divergence, out-of-window tokens, verify lag, a clean audit.

The shell form of :func:`otel_swa.testing.assert_swa_divergence_observed`, with the same verdict
(:func:`otel_swa.testing.judge.judge`): in the last run of the log, for every rank, peak
``swa_full_idx_divergence`` >= ``--min-divergence`` and peak ``swa_out_of_window_tokens`` >=
``--min-out-of-window``, ``verify_swa < verify_full`` on the last record (unless
``--no-verify-lag``), and, where otel-swa's audit lines are present, no leaked SWA slot, stale token,
shared SWA slot or premature eviction (a live token inside the sliding window without an SWA slot),
and, where its provenance lines are present, no KV write to the wrong slot, no slot holding another
token's KV, no K/V bytes changed after the write, no stale prefix-cache entry and no foreign block
(unless ``--no-audit``; each failure names its first offender); late-held SWA slots and unchecked
counts are shown, not judged. A rank whose runs are interleaved (two runs writing the
log at once) fails.

Exit status: 0 observed; 1 not observed (the explanation is printed on stdout); 2 unusable input (a
missing or unreadable file, an empty one, one that is not a text log such as a binary file; the
message is on stderr); 130 interrupted (Ctrl-C): during a ``--wait``, what was read by then is
judged and explained first (a file still missing or empty by then: one line says so). The exit status is the verdict even when the
explanation cannot be written (a reader that closed the pipe, a full disk). With ``--wait SECONDS`` a
file that is still being written (or does not exist yet) is read again every ``--poll`` seconds
until the verdict is a pass or the time is up; with ``--until end``, until the run being written
has ended (the next run's start, or ``--quiet-period`` seconds without anything new), judged
whole; when the first read does not end the wait, one line on stderr says what it waits for (not
with ``--quiet``).
Standard input (``-``) is read to its end, copied to a temporary file as it is read and judged
from there as a file is (memory bounded by the log's ranks and runs). A run whose otel-swa lines are only its start
marker or a liveness warning ("instrumented, 0 samples in N steps") fails.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import tempfile

from otel_swa.commands._loginput import (
    InputError,
    add_source_argument,
    check_log_start,
    error,
    non_negative_int,
    positive_seconds,
    seconds,
    source_name,
    unusable_text,
)
from otel_swa.logsource import TEXT_PROBE_BYTES
from otel_swa.commands._output import print_result
from otel_swa.commands._interrupt import INTERRUPTED
from otel_swa.testing.assertions import (
    DEFAULT_POLL_S,
    DEFAULT_QUIET_S,
    INTERRUPTED_NOTE,
    UNTIL_MODES,
    wait_for_observation,
)
from otel_swa.testing.judge import LINE_MODES, RANK_MODES, RUN_MODES
from otel_swa.testing.sources import text_source
from otel_swa.testing.streaming import judge_log_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_argument(parser)
    parser.add_argument("--min-divergence", type=non_negative_int, default=1, metavar="N",
                        help="required peak swa_full_idx_divergence (default 1)")
    parser.add_argument("--min-out-of-window", type=non_negative_int, default=1, metavar="N",
                        help="required peak swa_out_of_window_tokens (default 1)")
    parser.add_argument("--no-verify-lag", dest="require_verify_lag", action="store_false",
                        help="do not require verify_swa < verify_full on the last record")
    parser.add_argument("--no-audit", dest="require_clean_audit", action="store_false",
                        help="do not fail on leaked SWA slots, stale tokens, shared SWA slots or premature evictions found by otel-swa's "
                             "audit lines, nor on the KV provenance faults of its provenance lines (write mismatches, "
                             "foreign or corrupt tokens, stale prefix-cache entries, foreign blocks) (default: fail when "
                             "any is above 0)")
    parser.add_argument("--run", dest="runs", choices=RUN_MODES, default="last",
                        help="which run of a log that several runs wrote (forward_ct going back, or otel-swa's run "
                             "start lines): the last (default), each (all must pass) or all (the whole log as one)")
    parser.add_argument("--ranks", choices=RANK_MODES, default="each",
                        help="each: every rank of the log prefix (TP0, DP1 TP0...) must pass on its own (default); "
                             "all: the records of every rank judged together, for pipeline parallelism where one "
                             "micro-batch is sampled per interval")
    parser.add_argument("--lines", choices=LINE_MODES, default="auto",
                        help="whose lines: otel-swa's tagged lines, SGLang's own untagged lines, or both (each must "
                             "pass); auto (default): otel-swa's when present, else SGLang's")
    parser.add_argument("--wait", type=seconds, default=0.0, metavar="SECONDS",
                        help="keep reading a growing file until observed or SECONDS have passed (default 0: read once)")
    parser.add_argument("--new", action="store_true",
                        help="judge only the run being written: with --wait on a log that already holds finished "
                             "runs (--log-file appends), nothing passes until a record is written after check "
                             "starts; then the last run is judged whole, never an earlier, finished run")
    parser.add_argument("--until", choices=UNTIL_MODES, default="pass",
                        help="with --wait: pass (default): stop at the first read that passes (a fault logged later is "
                             "not seen); end: wait for the end of the run being written (the next run's start, or "
                             "--quiet-period without anything new) and judge it whole, for a server's log")
    parser.add_argument("--quiet-period", dest="quiet_s", type=positive_seconds, default=DEFAULT_QUIET_S,
                        metavar="SECONDS", help=f"with --until end: seconds without anything new after which the run "
                                                f"has ended (default {DEFAULT_QUIET_S:g})")
    parser.add_argument("--poll", type=positive_seconds, default=DEFAULT_POLL_S, metavar="SECONDS",
                        help=f"pause between reads while waiting (default {DEFAULT_POLL_S})")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every malformed line with its number and reason (default: the first)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing when the check passes")


def _file_problem(path: str) -> str | None:
    """Why the file at ``path`` is no log to judge (empty, not a text log), from its first bytes."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(TEXT_PROBE_BYTES)
    except OSError:
        return None  # the source itself said whether it could be read
    problem = unusable_text(path, head)
    return None if problem is None else str(problem)


def _judge_standard_input(rules: dict) -> object:
    """The verdict on standard input, read to its end: copied to a temporary file as it is read
    and judged from there as a file is (records let go as read: memory bounded by the log's ranks
    and runs, the disk holding the text); read whole where the file's split needs the whole log,
    or when no temporary file can be written (a full disk: then in memory, as before).

    Raises:
        InputError: standard input cannot be read, is empty or is not a text log.
    """
    stdin = sys.stdin.buffer
    try:
        with tempfile.NamedTemporaryFile(prefix="otel-swa-stdin-", suffix=".log") as spool:
            data = b""
            try:
                shutil.copyfileobj(stdin, spool, _SPOOL_CHUNK)
                spool.flush()
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                spool.seek(0)
                data = spool.read() + stdin.read()  # the disk is full: the rest in memory
            if not data:
                check_log_start(spool.name, "-")
                observation = judge_log_file(spool.name, **rules, name="standard input")
                if observation is not None:
                    return observation
                spool.seek(0)
                data = spool.read()  # the log's split needs the whole log
    except OSError as exc:
        raise InputError(f"standard input cannot be read ({exc.strerror or exc})") from None
    problem = unusable_text("-", data)
    if problem is not None:
        raise problem
    return wait_for_observation(text_source(data, "standard input"), **rules)


#: How much of standard input is copied at once (bytes).
_SPOOL_CHUNK = 2**20


def run(args: argparse.Namespace) -> int:
    rules = dict(
        min_divergence=args.min_divergence,
        min_out_of_window=args.min_out_of_window,
        require_verify_lag=args.require_verify_lag,
        require_clean_audit=args.require_clean_audit,
        runs=args.runs,
        ranks=args.ranks,
        lines=args.lines,
    )
    if args.source == "-":
        try:
            observation = _judge_standard_input(rules)
        except InputError as exc:
            return error(str(exc))
    else:
        observation = None
        if args.wait == 0 and not args.new and args.until == "pass" and os.path.isfile(args.source):
            observation = judge_log_file(args.source, **rules)  # read once, records let go as read
        if observation is None:
            def waiting(first: object) -> None:  # the first read did not end the wait: say what it waits for
                print(f"otel-swa check: waiting up to {args.wait:g} s for {source_name(args.source)} (Ctrl-C judges "
                      "what was read by then)", file=sys.stderr, flush=True)

            observation = wait_for_observation(args.source, timeout_s=args.wait, poll_s=args.poll, new_only=args.new,
                                               until=args.until, quiet_s=args.quiet_s, judge_on_interrupt=True,
                                               on_waiting=waiting if args.wait > 0 and not args.quiet else None, **rules)
        problem = observation.problem
        if problem is None and observation.records == 0:  # at the end of the wait: empty, or no log at all?
            problem = _file_problem(args.source)
        if problem is not None:
            if _interrupted(observation):  # nothing to judge: said, and the Ctrl-C's status
                print(f"otel-swa check: {problem}: nothing was read to judge", file=sys.stderr)
                return _said_interrupted()
            return error(problem)
    interrupted = _interrupted(observation)
    if not (observation.ok and args.quiet) or interrupted:
        print_result(observation.explain(verbose=args.verbose))  # the verdict stands even when it cannot be printed
    if interrupted:
        return _said_interrupted()
    return 0 if observation.ok else 1


def _interrupted(observation: object) -> bool:
    """Whether a Ctrl-C ended the wait (the observation's notes say so)."""
    return any(note.startswith(INTERRUPTED_NOTE) for note in observation.notes)


def _said_interrupted() -> int:
    print(f"otel-swa check: interrupted (Ctrl-C) while waiting; exit status {INTERRUPTED}", file=sys.stderr)
    return INTERRUPTED
