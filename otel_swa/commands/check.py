"""Assert that a log shows the SWA path working: divergence, out-of-window tokens, verify lag.

The shell form of :func:`otel_swa.testing.assert_swa_divergence_observed`, with the same rules:
peak ``swa_full_idx_divergence`` >= ``--min-divergence`` and peak ``swa_out_of_window_tokens`` >=
``--min-out-of-window`` over all records, and ``verify_swa < verify_full`` on the last record
(unless ``--no-verify-lag``).

Exit status: 0 observed; 1 not observed (the explanation is printed on stdout); 2 unusable input (a
missing or unreadable file; the message is on stderr). The exit status is the verdict even when the
explanation cannot be written (a reader that closed the pipe, a full disk). With ``--wait SECONDS`` a file that is still
being written (or does not exist yet) is read again every ``--poll`` seconds until the signals are
observed or the time is up. Standard input (``-``) is read to its end.
"""

from __future__ import annotations

import argparse

from otel_swa.commands._loginput import (
    InputError,
    add_source_argument,
    error,
    load_records,
    non_negative_int,
    positive_seconds,
    seconds,
)
from otel_swa.commands._output import print_result
from otel_swa.testing.assertions import DEFAULT_POLL_S, judge, wait_for_observation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_argument(parser)
    parser.add_argument("--min-divergence", type=non_negative_int, default=1, metavar="N",
                        help="required peak swa_full_idx_divergence (default 1)")
    parser.add_argument("--min-out-of-window", type=non_negative_int, default=1, metavar="N",
                        help="required peak swa_out_of_window_tokens (default 1)")
    parser.add_argument("--no-verify-lag", dest="require_verify_lag", action="store_false",
                        help="do not require verify_swa < verify_full on the last record")
    parser.add_argument("--wait", type=seconds, default=0.0, metavar="SECONDS",
                        help="keep reading a growing file until observed or SECONDS have passed (default 0: read once)")
    parser.add_argument("--poll", type=positive_seconds, default=DEFAULT_POLL_S, metavar="SECONDS",
                        help=f"pause between reads while waiting (default {DEFAULT_POLL_S})")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing when the check passes")


def run(args: argparse.Namespace) -> int:
    thresholds = dict(
        min_divergence=args.min_divergence,
        min_out_of_window=args.min_out_of_window,
        require_verify_lag=args.require_verify_lag,
    )
    if args.source == "-":
        try:
            found, malformed = load_records("-")
        except InputError as exc:
            return error(str(exc))
        observation = judge(
            [item.record for item in found],
            malformed=malformed,
            source="standard input",
            last_line_no=found[-1].line_no if found else None,
            **thresholds,
        )
    else:
        observation = wait_for_observation(args.source, timeout_s=args.wait, poll_s=args.poll, **thresholds)
        if observation.problem is not None:
            return error(observation.problem)
    if not (observation.ok and args.quiet):
        print_result(observation.explain())  # the verdict stands even when it cannot be printed
    return 0 if observation.ok else 1
