"""Replay an LLM request trace through the reference hybrid-SWA engine with the SWA divergence reporter on.

The default run (no options) replays the first 200 requests of the Azure LLM inference trace 2023
(conversation service) shipped with the package, samples the SWA KV cache every 20 forward steps,
prints each sample as SGLang's ``kv_canary_swa_divergence=`` line and ends with a summary.

Environment (read through :mod:`otel_swa.config`; every ``OTEL_SWA_*`` variable is checked first,
those the run does not use included: an unusable value exits with status 2 and one line,
``NAME='value': expected ...``):

* ``OTEL_SWA_DIVERGENCE_INTERVAL`` (else SGLang's ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``):
  the sampling interval when ``--interval`` is not given; ``0`` switches the reporter off (no line;
  the summary says so). Unset: every 20 forward steps.
* ``OTEL_SWA_RING_SIZE``: slots of the reporter's device-to-host ring.
* ``OTEL_SWA_DP_RANK``, ``OTEL_SWA_PP_RANK``, ``OTEL_SWA_TP_RANK``: the rank tokens of the log
  prefix, in SGLang's shape ``[time DP1 PP0 TP3]`` (DP and PP only when set; TP0 by default).

Exit status: 0 the run ended and found nothing wrong; 1 its own SWA slot audit found leaked slots,
stale tokens or shared slots, or the reporter was on and took no sample (the run was shorter than
the interval); 2 unusable options, input or environment (one line on stderr); 3 every export of a
signal to an exporter that sends failed (nothing of it reached a collector); 130 interrupted
(Ctrl-C): every sample taken so far is delivered and the summary printed first. The summary's wall
time is the process's, from its start to the summary (the stop after the replay included). Standard output
that its reader closes (``| head``) stops quietly; standard output or a ``--log-file`` that cannot
take more (``> /dev/full``, ``--log-file /dev/full``, a pipe nobody reads) is named once on stderr
with the error, the run goes on without it, and the exit status is 2 (unless 1 or 130).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import Any, Callable

from otel_swa import config as otel_swa_config
from otel_swa import environment_variables as ev
from otel_swa.commands._args import non_negative_int, positive_float, positive_int
from otel_swa.commands._interrupt import INTERRUPTED, CommandInterrupt
from otel_swa.commands._output import FileLogHandler, GuardedStdout, StdoutLogHandler
from otel_swa.commands._replay_checks import (
    available_memory as _available_memory,
    check_log_file,
    check_plot,
    check_pool_memory,
    is_allocation_error,
    pool_too_large,
)
from otel_swa.commands._replay_summary import (
    EXPORTS_FAILED,
    Progress,
    WallTime,
    export_row,
    print_summary,
    summary_rows,
    verdict_of,
)
from otel_swa.record import SwaDivergenceRecord

#: The SGLang log format (``[time{rank tokens}] message``), so the output reads like an engine's log.
LOG_FORMAT = "[%(asctime)s{prefix}] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
EXPORTERS = ("logline", "console", "otlp", "prometheus", "none")
#: The standard OpenTelemetry variables that choose exporters per signal (used without --exporter).
_SIGNAL_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER")


def _exporter_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no exporter; expected one or more of {', '.join(EXPORTERS)} "
                                         "(none: nothing but the summary)")
    for name in names:
        if name not in EXPORTERS:
            raise argparse.ArgumentTypeError(f"unknown exporter {name!r}; expected one of {', '.join(EXPORTERS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from otel_swa.reference.config import ARRIVALS, DEFAULT_REPLAY  # torch-free: --help stays fast

    cfg = DEFAULT_REPLAY.config
    src = parser.add_argument_group("trace")
    src.add_argument("--trace", default=DEFAULT_REPLAY.trace, metavar="conv|code|FILE",
                     help="packaged Azure 2023 trace ('conv' or 'code') or a CSV file in its format (default: %(default)s)")
    src.add_argument("--requests", type=non_negative_int, default=DEFAULT_REPLAY.limit, metavar="N",
                     help="requests taken from the start of the trace; 0 = the whole trace (default: %(default)s)")
    src.add_argument("--all", action="store_const", const=0, dest="requests", help="replay the whole trace (same as --requests 0)")
    src.add_argument("--arrivals", choices=ARRIVALS, default=DEFAULT_REPLAY.arrivals,
                     help="ignore arrival times (all requests at t=0) or honour them, compressed (default: %(default)s)")
    src.add_argument("--time-scale", type=positive_float, default=DEFAULT_REPLAY.time_scale, metavar="X",
                     help="with --arrivals compress, arrival times are divided by X (default: %(default)s)")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--window", type=positive_int, default=cfg.window, help="sliding window in tokens (default: %(default)s)")
    eng.add_argument("--full-pool", type=positive_int, default=cfg.full_pool_size, metavar="SLOTS", help="FULL pool size in slots (default: %(default)s)")
    eng.add_argument("--swa-pool", type=positive_int, default=cfg.swa_pool_size, metavar="SLOTS", help="SWA pool size in slots (default: %(default)s)")
    eng.add_argument("--page-size", type=positive_int, default=cfg.page_size, help="slots per page (default: %(default)s)")
    eng.add_argument("--max-running", type=positive_int, default=cfg.max_running, help="most requests per forward step (default: %(default)s)")
    eng.add_argument("--token-budget", type=positive_int, default=cfg.token_budget, help="most new tokens per forward step (default: %(default)s)")
    eng.add_argument("--max-context-len", type=positive_int, default=cfg.max_context_len, metavar="TOKENS",
                     help="longest request in KV positions (prompt + output - 1); a request longer than this, or than a "
                          "pool can hold, is reported and skipped, and the summary counts it (default: %(default)s)")
    eng.add_argument("--seed", type=int, default=cfg.seed, help="seed of the model weights and prompt tokens (default: %(default)s)")
    eng.add_argument("--no-model", action="store_true", help="skip the attention math (KV cache bookkeeping and reporter only; faster)")
    rep = parser.add_argument_group("reporter and output")
    rep.add_argument("--interval", type=positive_int, default=None,
                     help="sample every N forward steps (default: OTEL_SWA_DIVERGENCE_INTERVAL or SGLang's variable when set, "
                          "where 0 switches the reporter off; else "
                          f"{DEFAULT_REPLAY.interval})")
    rep.add_argument("--exporter", type=_exporter_list, action="extend", default=None, metavar="NAMES",
                     help="where samples go: logline (SGLang's line on stdout), console (OpenTelemetry console exporters), "
                          "otlp (OTLP, configured by the standard OTEL_EXPORTER_OTLP_* variables), prometheus (metrics on an "
                          "HTTP endpoint for Prometheus to scrape: OTEL_EXPORTER_PROMETHEUS_HOST/PORT, default localhost:9464; "
                          "OTEL_SWA_PROMETHEUS_LINGER=S keeps it up at the end until one more scrape), none; "
                          "comma-separated or repeated (default: logline, plus the exporters that OTEL_TRACES_EXPORTER, "
                          "OTEL_METRICS_EXPORTER and OTEL_LOGS_EXPORTER name when any is set)")
    rep.add_argument("--log-file", metavar="FILE", help="also append the log lines to FILE")
    rep.add_argument("--plot", metavar="PNG", help="draw the run's records to this image (needs the 'plot' extra)")
    rep.add_argument("--no-progress", action="store_true",
                     help="no progress on stderr (default: a bar on a terminal; elsewhere, such as a CI log, "
                          "a line every 30 s of a long run)")


#: ``EngineConfig`` fields set from options, and the option that sets each (for messages).
_POOL_OPTIONS = (("full_pool", "--full-pool"), ("swa_pool", "--swa-pool"))


def check_pool_options(args: argparse.Namespace) -> None:
    """Refuse pool sizes that are not whole pages and a token budget below ``--max-running``,
    naming the options (``EngineConfig`` would refuse them too, naming its fields).

    Raises:
        ValueError: the message names the options, their values and what was expected.
    """
    for dest, option in _POOL_OPTIONS:
        slots = getattr(args, dest)
        if slots % args.page_size:
            whole = max(args.page_size, slots - slots % args.page_size)
            raise ValueError(f"{option} {slots} is not a multiple of --page-size {args.page_size}; expected whole "
                             f"pages (e.g. {option} {whole})")
    if args.token_budget < args.max_running:
        raise ValueError(f"--token-budget {args.token_budget} is below --max-running {args.max_running}; expected "
                         f"a budget of at least one new token per running request")


def _interval(args: argparse.Namespace) -> int:
    """``--interval``, else the environment's interval when set (0 = reporter off), else 20.

    Raises:
        ConfigError: the variable in use is not an integer >= 0.
    """
    from otel_swa.reference.config import DEFAULT_REPLAY

    if args.interval is not None:
        return args.interval
    from_env = otel_swa_config.divergence_interval_if_set()
    return DEFAULT_REPLAY.interval if from_env is None else from_env


def rank_prefix(ranks: dict[str, int]) -> str:
    """SGLang's rank tokens for the log prefix, each after a space: `` DP1 PP0 TP3``.

    ``ranks`` is :func:`otel_swa.config.parallel_ranks`'s dict; DP and PP appear only when set, TP
    always (``TP0`` by default), the shape :mod:`otel_swa.logsource` reads back as the rank.
    """
    tokens = [f"DP{ranks['dp']}"] if "dp" in ranks else []
    if "pp" in ranks:
        tokens.append(f"PP{ranks['pp']}")
    tokens.append(f"TP{ranks.get('tp', 0)}")
    return "".join(" " + token for token in tokens)


def _line_logger(log_file: FileLogHandler | None, prefix: str, out: GuardedStdout) -> logging.Logger:
    logger = logging.getLogger("otel_swa.replay")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    formatter = logging.Formatter(LOG_FORMAT.replace("{prefix}", prefix), LOG_DATEFMT)
    handlers: list[logging.Handler] = [StdoutLogHandler(out)]
    if log_file is not None:
        handlers.append(log_file)
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger


def _close_logger(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        handler.flush()
        handler.close()
        logger.removeHandler(handler)


def run(args: argparse.Namespace) -> int:
    started = getattr(args, "started_at", None) or time.monotonic()
    interrupt = getattr(args, "interrupt", None)
    own = None
    if interrupt is None:  # called without otel_swa.cli.main: Ctrl-C handled here for the command
        interrupt = own = CommandInterrupt("replay").install()
    try:
        with contextlib.ExitStack() as deferred:
            return _run(args, started, interrupt, deferred)
    except KeyboardInterrupt:  # Ctrl-C before the run began (imports, the trace): nothing ran
        return _interrupted_before_run(args, started)
    finally:
        if own is not None:
            own.uninstall()


def _interrupted_before_run(args: argparse.Namespace, started: float) -> int:
    """The summary of a run interrupted while it started (nothing was replayed); exit status 130."""
    rows = [("trace", f"{args.trace}"),
            ("interrupted", "before the run began (Ctrl-C while starting up: imports, the trace); nothing was replayed"),
            ("wall time", f"{time.monotonic() - started:.1f} s")]
    print_summary(rows, GuardedStdout())
    print(f"otel-swa replay: interrupted before the run began; exit status {INTERRUPTED}", file=sys.stderr)
    return INTERRUPTED


def _run(args: argparse.Namespace, started: float, interrupt: CommandInterrupt, deferred: contextlib.ExitStack) -> int:
    from otel_swa.config import ConfigError
    from otel_swa.reference.config import EngineConfig
    from otel_swa.reference.trace import load_trace

    try:
        otel_swa_config.check_environment()  # every OTEL_SWA_* variable, used by this run or not
        check_pool_options(args)
        interval = _interval(args)
        ring_size = otel_swa_config.ring_size()
        prefix = rank_prefix(otel_swa_config.parallel_ranks())
        read_check = otel_swa_config.read_check()
        provenance = otel_swa_config.provenance()
        engine_config = dataclasses.replace(
            EngineConfig(),
            window=args.window, full_pool_size=args.full_pool, swa_pool_size=args.swa_pool,
            page_size=args.page_size, max_running=args.max_running, token_budget=args.token_budget,
            seed=args.seed, run_model=not args.no_model, max_context_len=args.max_context_len,
            read_check=read_check[0] if read_check else "off",
            read_check_queries=read_check[1] if read_check else EngineConfig.read_check_queries,
            provenance=provenance[0] if provenance else "off",
            provenance_budget=provenance[1] if provenance else EngineConfig.provenance_budget,
        )
        requests = load_trace(args.trace, limit=args.requests or None)
        check_pool_memory(engine_config, _available_memory())
        if args.log_file:
            check_log_file(args.log_file)
        plot_path = check_plot(args.plot, interval) if args.plot else None
    except (ConfigError, ValueError, OSError, ImportError) as exc:
        print(f"otel-swa replay: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print(f"otel-swa replay: the trace {args.trace!r} holds no request", file=sys.stderr)
        return 2
    # torch is imported here, after every option was checked: a bad one is refused at once
    from otel_swa.logline import LogLineSink
    from otel_swa.reference.replay import replay
    from otel_swa.reference.scheduler import RequestTooLargeError
    from otel_swa.reporter import SwaDivergenceReporter

    interrupt.raise_if_requested()  # a Ctrl-C the imports swallowed (it came while torch loaded): no run
    # from here on the first Ctrl-C raises nothing: the run stops at the end of the forward step
    # under way (every sample taken is delivered), the stop cuts the exporters' waits short, and
    # the summary is printed; a second Ctrl-C ends the process at once (CommandInterrupt)
    deferred.enter_context(interrupt.deferred("stopping: the samples taken are delivered, the exporters' waits cut "
                                              "short, then the summary"))
    out = GuardedStdout()  # every writer of standard output goes through it: no traceback for | head or a full disk
    log_file = None  # the --log-file handler: a write error there is said once and ends its writes only
    exporters = args.exporter if args.exporter is not None else ["logline"]
    records: list[SwaDivergenceRecord] = []
    reporter = None
    if interval > 0:  # 0: the reporter is off, as in an engine (no reporter work at all)
        reporter = SwaDivergenceReporter(
            interval, device="cpu", ring_size=ring_size, sinks=[lambda record, context: records.append(record)],
            micro_batches=otel_swa_config.micro_batches(), liveness_steps=otel_swa_config.liveness_steps(interval),
        )
    logger = None
    if "logline" in exporters and reporter is not None:
        if args.log_file:
            try:
                log_file = FileLogHandler(args.log_file)
            except OSError as exc:
                print(f"otel-swa replay: --log-file {args.log_file!r} cannot be opened for appending: "
                      f"{exc.strerror or exc}", file=sys.stderr)
                return 2
        logger = _line_logger(log_file, prefix, out)
    telemetry = None
    otel_exporters = [name for name in exporters if name in ("console", "otlp", "prometheus")]
    # Without --exporter, the standard OTEL_{TRACES,METRICS,LOGS}_EXPORTER variables choose the
    # OpenTelemetry exporters (as under opentelemetry-instrument); the line stays on by default.
    from_environment = args.exporter is None and any(os.environ.get(name, "").strip() for name in _SIGNAL_VARIABLES)
    line_by_exporter = False
    if otel_exporters or from_environment:
        from otel_swa.telemetry import configure

        # With an OpenTelemetry pipeline the SGLang line is one more exporter on it (swa_logline,
        # written to the same logger); without one, a plain sink writes it at no OpenTelemetry cost.
        console: dict[str, Any] = {}
        if from_environment:
            chosen = None
            line_by_exporter = "swa_logline" in os.environ.get("OTEL_LOGS_EXPORTER", "")
        else:
            if "console" in otel_exporters:  # built here, writing through the guard
                otel_exporters.remove("console")
                console = _console_processors(out)
            if logger is not None:
                otel_exporters.append("logline")
            chosen = ",".join(otel_exporters) or "none"
            line_by_exporter = logger is not None
        try:
            telemetry = configure(exporters=chosen, default_service_name="otel-swa-replay",
                                  logline_logger=logger.name if logger is not None else None, **console)
        except ConfigError as exc:
            _shutdown_quietly(console)
            print(f"otel-swa replay: {exc}", file=sys.stderr)
            return 2
        interrupt.on_first(telemetry.cut_short)  # a Ctrl-C ends the exporters' waits
        if reporter is not None:
            telemetry.attach(reporter)
        endpoint = telemetry.prometheus_endpoint
        if endpoint is not None:  # where to scrape, before the run's first line
            print(f"otel-swa replay: metrics for Prometheus at {endpoint.url}", file=sys.stderr, flush=True)
    if logger is not None and not line_by_exporter:
        reporter.add_sink(LogLineSink(logger))
    hooks: dict[str, Any] = {}
    if telemetry is not None:
        from otel_swa.engine_wrapping import request_span_hooks

        hooks = request_span_hooks(telemetry.start_request_span, telemetry.end_request_span)
    progress = Progress()
    hooks["on_step"] = _both(_both(hooks.get("on_step"), progress), lambda result: interrupt.raise_if_requested())
    bar = not args.no_progress and sys.stderr.isatty()
    if not args.no_progress and not bar:  # a log, not a terminal: a plain line now and then
        from otel_swa.commands._progress import ProgressLines

        hooks["on_step"] = _both(hooks["on_step"], ProgressLines(len(requests)))
    summary: Any = progress
    interrupted = False
    on_engine: "Callable[[Any], None] | None" = None
    if telemetry is not None:  # the KV pools' usage and what the window saves, as gauges
        pools = telemetry.pools
        engines: list = []  # alive until the telemetry's last collection, at its shutdown

        def register_engine(engine: Any) -> None:
            engines.append(engine)
            pools.register(lambda e: e.pools.usage(), owner=engine)
            if reporter is not None and engine.kv is not None:
                reporter.add_sink(pools.savings_sink(engine.kv.swa_bytes_per_token))

        on_engine = register_engine

    try:
        interrupt.raise_if_requested()  # a Ctrl-C while the pipeline was set up: no run
        summary = replay(
            requests, engine_config, reporter,
            progress=bar, arrivals=args.arrivals, time_scale=args.time_scale,
            forward_span=telemetry.forward_span if telemetry is not None else None,
            on_engine=on_engine,
            **hooks,
        )
    except KeyboardInterrupt as exc:  # Ctrl-C: deliver what was sampled, then the summary and 130
        interrupted = True
        summary = getattr(exc, "summary", summary)  # the engine's summary so far (ReplayInterrupted)
    except RequestTooLargeError as exc:
        print(f"otel-swa replay: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if not is_allocation_error(exc):
            raise
        print(f"otel-swa replay: {pool_too_large(args, exc)}", file=sys.stderr)
        return 2
    finally:
        stopping = time.monotonic()
        if reporter is not None:
            reporter.close()
        if telemetry is not None:
            endpoint = telemetry.prometheus_endpoint
            if endpoint is not None and endpoint.linger_s > 0 and not interrupt.requested:
                endpoint.begin_linger()  # a scrape made once this line is read is the one waited for
                print(f"otel-swa replay: waiting up to {endpoint.linger_s:g} s for one more scrape of "
                      f"{endpoint.url} ({ev.OTEL_SWA_PROMETHEUS_LINGER})", file=sys.stderr, flush=True)
            telemetry.shutdown()
        if logger is not None:
            _close_logger(logger)
    stop_s = time.monotonic() - stopping
    in_stop = interrupt.requested and not interrupted  # Ctrl-C after the run's end, while it stopped
    stats = reporter.stats if reporter is not None else None
    export_stats = telemetry.export_stats() if telemetry is not None else {}
    verdict = verdict_of(records, stats, interrupted, export_stats)
    wall = WallTime(total_s=time.monotonic() - started, stop_s=stop_s)
    rows = summary_rows(args, interval, summary, records, stats, verdict, len(requests), wall)
    exported = export_row(export_stats) if telemetry is not None else None
    if exported is not None:  # what reached a collector, beside what the reporter delivered
        at = next((i + 1 for i, (name, _) in enumerate(rows) if name == "samples delivered"), len(rows))
        rows.insert(at, ("exported", exported))
    cut = telemetry.cut_signals if telemetry is not None else []
    if in_stop:  # the run was whole; the stop after it was interrupted
        rows.insert(len(rows) - 1, ("interrupted", "after the run, while it stopped (Ctrl-C)" + _cut_text(cut)))
        verdict = dataclasses.replace(verdict, interrupted=True)
    elif interrupted and cut:
        at = next(i for i, (name, _) in enumerate(rows) if name == "interrupted")
        rows[at] = (rows[at][0], rows[at][1] + _cut_text(cut))
    print_summary(rows, out)
    not_drawn = f"otel-swa replay: --plot {args.plot}: not drawn, the run was interrupted"
    if plot_path is not None and verdict.interrupted:
        print(not_drawn, file=sys.stderr)
    for reason in verdict.reasons(interval, summary.forward_steps):
        print(f"otel-swa replay: {reason}", file=sys.stderr)
    if interrupt.requested and not verdict.interrupted:  # a Ctrl-C while it summed up: 130, no plot
        if plot_path is not None:
            print(not_drawn, file=sys.stderr)
        print(f"otel-swa replay: interrupted (Ctrl-C) after the summary; exit status {INTERRUPTED}", file=sys.stderr)
        verdict = dataclasses.replace(verdict, interrupted=True)
    interrupted = verdict.interrupted
    if plot_path is not None and not interrupted:
        from otel_swa.plot import PlotUnavailableError, plot_records

        try:
            plot_records(records, plot_path, title=f"otel-swa replay of {args.trace} ({len(requests)} requests)")
        except (PlotUnavailableError, ValueError, OSError) as exc:
            print(f"otel-swa replay: cannot draw {args.plot}: {exc}", file=sys.stderr)
            return 2
        out.write(f"plot written to {plot_path}\n")
        out.flush()
    return _with_outputs(verdict.exit_status, out, log_file)


def _with_outputs(status: int, out: GuardedStdout, log_file: FileLogHandler | None) -> int:
    """The exit status once the outputs are counted: 2 when standard output or the log file could
    not be written (a full disk; each said once on stderr), unless interrupted (130) or a fault was
    found (1); a reader that closed standard output is no failure."""
    lost = out.failed is not None or (log_file is not None and log_file.failed is not None)
    return 2 if lost and status in (0, EXPORTS_FAILED) else status


def _cut_text(cut: list) -> str:
    """What a Ctrl-C cut off, for the ``interrupted`` row."""
    if not cut:
        return ""
    return f"; the exporters' waits were cut short: the last exports of {', '.join(cut)} were not sent"


def _console_processors(out: Any) -> dict[str, list]:
    """The OpenTelemetry console exporters of ``--exporter console``, writing to ``out`` (the SDK's
    own default is the ``sys.stdout`` of the moment it was imported, which no guard can wrap)."""
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, ConsoleLogRecordExporter
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    return {
        "span_processors": [BatchSpanProcessor(ConsoleSpanExporter(out=out))],
        "metric_readers": [PeriodicExportingMetricReader(ConsoleMetricExporter(out=out))],
        "log_record_processors": [BatchLogRecordProcessor(ConsoleLogRecordExporter(out=out))],
    }


def _shutdown_quietly(console: dict[str, list]) -> None:
    for items in console.values():
        for item in items:
            try:
                item.shutdown()
            except Exception:  # nothing was exported yet; a failing shutdown changes nothing
                pass


def _both(first: Any, second: Any) -> Any:
    """One ``on_step`` hook calling ``first`` (when given), then ``second``."""
    if first is None:
        return second

    def on_step(result: Any) -> None:
        first(result)
        second(result)

    return on_step
