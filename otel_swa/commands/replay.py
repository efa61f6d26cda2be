"""Replay an LLM request trace through the reference hybrid-SWA engine with the SWA divergence reporter on.

The default run (no options) replays the first 200 requests of the Azure LLM inference trace 2023
(conversation service) shipped with the package, samples the SWA KV cache every 20 forward steps,
prints each sample as SGLang's ``kv_canary_swa_divergence=`` line and ends with a summary.

Environment (read through :mod:`otel_swa.config`; an unusable value exits with status 2 and names
the variable):

* ``OTEL_SWA_DIVERGENCE_INTERVAL`` (else SGLang's ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``):
  the sampling interval when ``--interval`` is not given; ``0`` switches the reporter off (no line;
  the summary says so). Unset: every 20 forward steps.
* ``OTEL_SWA_RING_SIZE``: slots of the reporter's device-to-host ring.
* ``OTEL_SWA_DP_RANK``, ``OTEL_SWA_PP_RANK``, ``OTEL_SWA_TP_RANK``: the rank tokens of the log
  prefix, in SGLang's shape ``[time DP1 PP0 TP3]`` (DP and PP only when set; TP0 by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from otel_swa import config as otel_swa_config
from otel_swa.commands._args import non_negative_int, positive_float, positive_int
from otel_swa.commands._output import StdoutLogHandler, discard_stdout
from otel_swa.record import SwaDivergenceRecord

#: The SGLang log format (``[time{rank tokens}] message``), so the output reads like an engine's log.
LOG_FORMAT = "[%(asctime)s{prefix}] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
EXPORTERS = ("logline", "console", "otlp", "none")
#: The standard OpenTelemetry variables that choose exporters per signal (used without --exporter).
_SIGNAL_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER")


def _exporter_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
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
    eng.add_argument("--seed", type=int, default=cfg.seed, help="seed of the model weights and prompt tokens (default: %(default)s)")
    eng.add_argument("--no-model", action="store_true", help="skip the attention math (KV cache bookkeeping and reporter only; faster)")
    rep = parser.add_argument_group("reporter and output")
    rep.add_argument("--interval", type=positive_int, default=None,
                     help="sample every N forward steps (default: OTEL_SWA_DIVERGENCE_INTERVAL or SGLang's variable when set, "
                          "where 0 switches the reporter off; else "
                          f"{DEFAULT_REPLAY.interval})")
    rep.add_argument("--exporter", type=_exporter_list, action="extend", default=None, metavar="NAMES",
                     help="where samples go: logline (SGLang's line on stdout), console (OpenTelemetry console exporters), "
                          "otlp (OTLP, configured by the standard OTEL_EXPORTER_OTLP_* variables), none; "
                          "comma-separated or repeated (default: logline, plus the exporters that OTEL_TRACES_EXPORTER, "
                          "OTEL_METRICS_EXPORTER and OTEL_LOGS_EXPORTER name when any is set)")
    rep.add_argument("--log-file", metavar="FILE", help="also append the log lines to FILE")
    rep.add_argument("--plot", metavar="PNG", help="draw the run's records to this image (needs the 'plot' extra)")
    rep.add_argument("--no-progress", action="store_true",
                     help="no progress on stderr (default: a bar on a terminal; elsewhere, such as a CI log, "
                          "a line every 30 s of a long run)")


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


def _line_logger(log_file: str | None, prefix: str) -> logging.Logger:
    logger = logging.getLogger("otel_swa.replay")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    formatter = logging.Formatter(LOG_FORMAT.replace("{prefix}", prefix), LOG_DATEFMT)
    handlers: list[logging.Handler] = [StdoutLogHandler()]
    if log_file:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
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
    from otel_swa.config import ConfigError
    from otel_swa.logline import LogLineSink
    from otel_swa.reference.config import EngineConfig
    from otel_swa.reference.replay import replay
    from otel_swa.reference.scheduler import RequestTooLargeError
    from otel_swa.reference.trace import load_trace
    from otel_swa.reporter import SwaDivergenceReporter

    try:
        interval = _interval(args)
        ring_size = otel_swa_config.ring_size()
        prefix = rank_prefix(otel_swa_config.parallel_ranks())
        engine_config = dataclasses.replace(
            EngineConfig(),
            window=args.window, full_pool_size=args.full_pool, swa_pool_size=args.swa_pool,
            page_size=args.page_size, max_running=args.max_running, token_budget=args.token_budget,
            seed=args.seed, run_model=not args.no_model,
        )
        requests = load_trace(args.trace, limit=args.requests or None)
        _check_pool_memory(engine_config, _available_memory())
        if args.log_file:
            _check_log_file(args.log_file)
        plot_path = _check_plot(args.plot, interval) if args.plot else None
    except (ConfigError, ValueError, OSError, ImportError) as exc:
        print(f"otel-swa replay: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print(f"otel-swa replay: the trace {args.trace!r} holds no request", file=sys.stderr)
        return 2

    exporters = args.exporter if args.exporter is not None else ["logline"]
    records: list[SwaDivergenceRecord] = []
    reporter = None
    if interval > 0:  # 0: the reporter is off, as in an engine (no reporter work at all)
        reporter = SwaDivergenceReporter(
            interval, device="cpu", ring_size=ring_size, sinks=[lambda record, context: records.append(record)]
        )
    logger = None
    if "logline" in exporters and reporter is not None:
        logger = _line_logger(args.log_file, prefix)
    telemetry = None
    otel_exporters = [name for name in exporters if name in ("console", "otlp")]
    # Without --exporter, the standard OTEL_{TRACES,METRICS,LOGS}_EXPORTER variables choose the
    # OpenTelemetry exporters (as under opentelemetry-instrument); the line stays on by default.
    from_environment = args.exporter is None and any(os.environ.get(name, "").strip() for name in _SIGNAL_VARIABLES)
    line_by_exporter = False
    if otel_exporters or from_environment:
        from otel_swa.telemetry import configure

        # With an OpenTelemetry pipeline the SGLang line is one more exporter on it (swa_logline,
        # written to the same logger); without one, a plain sink writes it at no OpenTelemetry cost.
        if from_environment:
            chosen = None
            line_by_exporter = "swa_logline" in os.environ.get("OTEL_LOGS_EXPORTER", "")
        else:
            if logger is not None:
                otel_exporters.append("logline")
            chosen = ",".join(otel_exporters)
            line_by_exporter = logger is not None
        try:
            telemetry = configure(exporters=chosen, default_service_name="otel-swa-replay",
                                  logline_logger=logger.name if logger is not None else None)
        except ConfigError as exc:
            print(f"otel-swa replay: {exc}", file=sys.stderr)
            return 2
        except ValueError as exc:  # the SDK refused one of the standard OTEL_* variables
            print(f"otel-swa replay: OpenTelemetry cannot be set up from the environment: {exc}{_otel_hint(exc)}",
                  file=sys.stderr)
            return 2
        if reporter is not None:
            telemetry.attach(reporter)
    if logger is not None and not line_by_exporter:
        reporter.add_sink(LogLineSink(logger))
    hooks: dict[str, Any] = {}
    if telemetry is not None:
        from otel_swa.engine_wrapping import request_span_hooks

        hooks = request_span_hooks(telemetry.start_request_span, telemetry.end_request_span)
    progress = not args.no_progress and sys.stderr.isatty()
    if not args.no_progress and not progress:  # a log, not a terminal: a plain line now and then
        from otel_swa.commands._progress import ProgressLines

        hooks["on_step"] = _both(hooks.get("on_step"), ProgressLines(len(requests)))
    try:
        summary = replay(
            requests, engine_config, reporter,
            progress=progress, arrivals=args.arrivals, time_scale=args.time_scale,
            forward_span=telemetry.forward_span if telemetry is not None else None,
            **hooks,
        )
    except RequestTooLargeError as exc:
        print(f"otel-swa replay: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if not _is_allocation_error(exc):
            raise
        print(f"otel-swa replay: {_pool_too_large(args, exc)}", file=sys.stderr)
        return 2
    finally:
        if reporter is not None:
            reporter.close()
        if telemetry is not None:
            telemetry.shutdown()
        if logger is not None:
            _close_logger(logger)
    try:
        _print_summary(args, interval, summary, records, reporter.stats if reporter is not None else None)
    except BrokenPipeError:  # the reader of stdout is gone; the plot is still drawn
        discard_stdout()
    if plot_path is not None:
        from otel_swa.plot import PlotUnavailableError, plot_records

        try:
            plot_records(records, plot_path, title=f"otel-swa replay of {args.trace} ({summary.requests_total} requests)")
        except (PlotUnavailableError, ValueError, OSError) as exc:
            print(f"otel-swa replay: cannot draw {args.plot}: {exc}", file=sys.stderr)
            return 2
        print(f"plot written to {plot_path}")
    return 0


def _check_plot(path: str, interval: int) -> Path:
    """Check ``--plot`` before the run: matplotlib imports, the suffix is an image format, the folder
    exists, and the reporter is on (else there is nothing to draw).

    Returns:
        the path the image will have (``.png`` appended when there is no suffix).

    Raises:
        PlotUnavailableError: matplotlib is not installed (the message gives the pip command).
        ValueError, OSError: the path cannot take an image, or the reporter is off.
    """
    from otel_swa.plot import check_image_path

    out = check_image_path(path)
    if interval == 0:
        raise ValueError(f"--plot {path!r} needs records, but the reporter is off (interval 0)")
    return out


def _check_log_file(path: str) -> None:
    """Open ``--log-file`` for appending once, before the run, so a bad path fails at once.

    Raises:
        ValueError: the file cannot be opened (the message names the option, the path and why).
    """
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ValueError(f"--log-file {path!r} cannot be opened for appending: {exc.strerror or exc}") from None


#: Standard OpenTelemetry variables the SDK validates when the providers are built: a word in the
#: SDK's error -> the variable and the values it accepts (OpenTelemetry SDK environment variables).
_OTEL_HINTS = {
    "exemplar filter": "OTEL_METRICS_EXEMPLAR_FILTER expects always_on, always_off or trace_based",
}


def _otel_hint(exc: Exception) -> str:
    text = str(exc).lower()
    for word, hint in _OTEL_HINTS.items():
        if word in text:
            return f" ({hint})"
    return " (check the OTEL_* environment variables)"


#: Host bytes per slot of the reference engine's pools, besides the KV entries: a free-list entry
#: (a Python int in a deque, about 36 bytes) in each pool, plus the int64 full-to-SWA mapping (8
#: bytes) per FULL slot. A coarse figure, enough to refuse a size no machine can hold before the
#: engine starts filling its free lists.
_FREE_LIST_BYTES_PER_SLOT = 36
_MAPPING_BYTES_PER_FULL_SLOT = 8


def _available_memory() -> int | None:
    """Bytes of host memory available now (``MemAvailable`` of /proc/meminfo, else the physical
    memory), or ``None`` when the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _check_pool_memory(config: Any, available: int | None) -> None:
    """Refuse pool sizes whose host memory alone exceeds what is available.

    Raises:
        ValueError: the message names the option that is too large, the estimate and what is available.
    """
    if available is None:
        return
    kv_bytes = 2 * 4 * config.num_heads * config.head_dim if config.run_model else 0  # float32 K and V
    need = {
        "--full-pool": config.full_pool_size * (_FREE_LIST_BYTES_PER_SLOT + _MAPPING_BYTES_PER_FULL_SLOT + kv_bytes),
        "--swa-pool": config.swa_pool_size * (_FREE_LIST_BYTES_PER_SLOT + kv_bytes),
    }
    if sum(need.values()) <= available:
        return
    option = max(need, key=need.__getitem__)
    slots = config.full_pool_size if option == "--full-pool" else config.swa_pool_size
    raise ValueError(
        f"{option} {slots} slots is too large for this machine's memory: the KV pools need about "
        f"{_gib(sum(need.values()))} of host memory, {_gib(available)} is available; lower {option}"
    )


def _gib(n_bytes: int) -> str:
    """``n_bytes`` in GiB, or in MiB below 1 GiB (one decimal)."""
    if n_bytes < 2**30:
        return f"{n_bytes / 2**20:,.1f} MiB"
    return f"{n_bytes / 2**30:,.1f} GiB"


def _is_allocation_error(exc: BaseException) -> bool:
    """A host or device memory allocation failed (torch raises RuntimeError, or its subclass
    OutOfMemoryError, with "allocate" in the message; Python raises MemoryError)."""
    return isinstance(exc, MemoryError) or "allocate" in str(exc).lower()


def _pool_too_large(args: argparse.Namespace, exc: BaseException) -> str:
    """One line naming the pool option that is too large for this machine's memory."""
    match = re.search(r"allocate (\d+) bytes", str(exc))
    tried = f" (an allocation of {int(match.group(1)):,} bytes failed)" if match else ""
    option, value = max((("--full-pool", args.full_pool), ("--swa-pool", args.swa_pool)), key=lambda item: item[1])
    return (f"cannot allocate the KV pools{tried}: {option} {value} slots is too large for this machine's memory; "
            f"lower {option}")


def _both(first: Any, second: Any) -> Any:
    """One ``on_step`` hook calling ``first`` (when given), then ``second``."""
    if first is None:
        return second

    def on_step(result: Any) -> None:
        first(result)
        second(result)

    return on_step


def _print_summary(args: argparse.Namespace, interval: int, summary: Any, records: list, stats: Any) -> None:
    last = records[-1] if records else None
    rows = [
        ("trace", f"{args.trace} ({summary.requests_total} requests)"),
        ("engine", f"window {args.window}, FULL pool {args.full_pool} slots, SWA pool {args.swa_pool} slots, page size {args.page_size}"),
        ("forward steps", f"{summary.forward_steps}"),
        ("requests finished", f"{summary.requests_finished} / {summary.requests_total}"),
        ("samples delivered", "reporter off (interval 0)" if stats is None else
         f"{stats.samples_delivered} / {stats.samples_taken} taken (every {interval} forward steps)"),
        ("peak divergence", _peak(records, "swa_full_idx_divergence", "tokens")),
        ("peak out-of-window", _peak(records, "swa_out_of_window_tokens", "tokens")),
        ("last verify_full", f"{last.verify_full} entries" if last else "n/a"),
        ("last verify_swa", f"{last.verify_swa} entries" if last else "n/a"),
        ("SWA slot audit", _audit_summary(records)),
        ("peak slots in use", f"FULL {summary.peak_full_slots} / {summary.full_pool_size}, SWA {summary.peak_swa_slots} / {summary.swa_pool_size}"),
        ("wall time", f"{summary.wall_s:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print("otel-swa replay summary")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def _peak(records: list, field: str, unit: str) -> str:
    return f"{max(getattr(r, field) for r in records)} {unit}" if records else "n/a"


def _audit_summary(records: list) -> str:
    audited = [r for r in records if r.audited]
    if not audited:
        return "n/a"
    peaks = {name: max(getattr(r, name) for r in audited) for name in ("swa_leaked_slots", "swa_stale_tokens", "swa_shared_slots")}
    verdict = "clean" if not any(peaks.values()) else "FAULTS"
    return (f"{verdict}: peak leaked {peaks['swa_leaked_slots']} slots, stale {peaks['swa_stale_tokens']} tokens, "
            f"shared {peaks['swa_shared_slots']} slots ({len(audited)} samples)")
