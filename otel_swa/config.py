"""Every environment variable otel-swa reads, read and validated in one place.

Names are defined in :mod:`otel_swa.environment_variables`.
"""

from __future__ import annotations

import math
import os
import re
from typing import Mapping, MutableMapping

from otel_swa import environment_variables as ev

__all__ = [
    "ConfigError",
    "invalid",
    "read_int",
    "check_environment",
    "VARIABLE_READERS",
    "require_sglang",
    "require_vllm",
    "warned_names",
    "prometheus_port_offset",
    "divergence_interval",
    "divergence_interval_if_set",
    "ring_size",
    "parallel_ranks",
    "warn_once",
    "sigterm_flush",
    "metric_export_interval_ms",
    "otlp_timeout_s",
    "forward_spans",
    "FORWARD_SPANS_CHOICES",
    "micro_batches",
    "MICRO_BATCH_MODES",
    "prometheus_address",
    "prometheus_linger",
    "DEFAULT_PROMETHEUS_PORT",
    "liveness_steps",
    "DEFAULT_LIVENESS_INTERVALS",
    "graph_checks",
    "GRAPH_CHECKS_CHOICES",
    "provenance",
    "PROVENANCE_CHOICES",
]

DEFAULT_RING_SIZE = 4
#: The largest ``OTEL_SWA_RING_SIZE``: a ring holds a few samples in flight; thousands mean a typo,
#: and a huge value would only fail later as a host-memory allocation error.
MAX_RING_SIZE = 1024


class ConfigError(ValueError):
    """An environment variable (or an argument standing for one) has an unusable value."""


def invalid(name: str, value: str | None, expected: str) -> ConfigError:
    """The error for variable ``name`` holding ``value``, in the one shape every variable's error
    has: ``NAME='value': expected <what>`` (e.g. ``OTEL_SWA_RING_SIZE='0': expected an integer from
    1 to 1024``)."""
    return ConfigError(f"{name}={value!r}: expected {expected}")


def read_int(name: str, value: str | None, *, default: int, minimum: int, maximum: int | None = None) -> int:
    """Parse ``value`` (the raw text of variable ``name``) as a base-10 integer >= ``minimum`` (and
    <= ``maximum`` when given).

    ``None`` or blank text gives ``default``.

    Raises:
        ConfigError: the text is not an integer ("abc", "2.5") or is out of range ("-3"); the
            message (:func:`invalid`) names the variable, the value and the range expected.
    """
    if value is None or value.strip() == "":
        return default
    text = value.strip()
    expected = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
    try:
        number = int(text, 10)
    except ValueError:
        raise invalid(name, value, expected) from None
    if number < minimum or (maximum is not None and number > maximum):
        raise invalid(name, value, expected)
    return number


def _read_flag(name: str, environ: Mapping[str, str] | None, default: bool) -> bool:
    """Variable ``name`` as a switch: ``1`` on, ``0`` off (blanks ignored; unset or blank:
    ``default``).

    Raises:
        ConfigError: any other value ("maybe", "true", "2").
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip() not in ("0", "1"):
        raise invalid(name, raw, "0 or 1")
    return raw.strip() == "1"


def divergence_interval(environ: Mapping[str, str] | None = None) -> int:
    """The sampling interval in forward steps; 0 means the reporter is off.

    ``OTEL_SWA_DIVERGENCE_INTERVAL`` when set (even to 0), else SGLang's
    ``SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL``, else 0.

    Raises:
        ConfigError: the variable in use is not an integer >= 0.
    """
    env = os.environ if environ is None else environ
    if env.get(ev.OTEL_SWA_DIVERGENCE_INTERVAL, "").strip() != "":
        name = ev.OTEL_SWA_DIVERGENCE_INTERVAL
    else:
        name = ev.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL
    return read_int(name, env.get(name), default=0, minimum=0)


def divergence_interval_if_set(environ: Mapping[str, str] | None = None) -> int | None:
    """The sampling interval when one of its variables is set, else ``None``.

    Same variables and precedence as :func:`divergence_interval`; a variable set to blank text counts
    as unset. Lets a caller with its own default (``otel-swa replay`` samples every 20 steps) tell
    "explicitly 0: off" from "not configured".

    Raises:
        ConfigError: the variable in use is not an integer >= 0.
    """
    env = os.environ if environ is None else environ
    names = (ev.OTEL_SWA_DIVERGENCE_INTERVAL, ev.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL)
    if all(env.get(name, "").strip() == "" for name in names):
        return None
    return divergence_interval(env)


def ring_size(environ: Mapping[str, str] | None = None) -> int:
    """Slots of the device-to-host ring (``OTEL_SWA_RING_SIZE``, default 4, at most
    :data:`MAX_RING_SIZE`).

    Raises:
        ConfigError: not an integer from 1 to :data:`MAX_RING_SIZE`.
    """
    env = os.environ if environ is None else environ
    name = ev.OTEL_SWA_RING_SIZE
    return read_int(name, env.get(name), default=DEFAULT_RING_SIZE, minimum=1, maximum=MAX_RING_SIZE)


#: Sampling intervals without a delivered sample after which the reporter warns (liveness).
DEFAULT_LIVENESS_INTERVALS = 10


def liveness_steps(interval: int, environ: Mapping[str, str] | None = None) -> int:
    """Forward steps without a delivered sample before the liveness warning
    (``OTEL_SWA_LIVENESS_STEPS``; default :data:`DEFAULT_LIVENESS_INTERVALS` x ``interval``; 0:
    never).

    Raises:
        ConfigError: not an integer >= 0.
    """
    env = os.environ if environ is None else environ
    name = ev.OTEL_SWA_LIVENESS_STEPS
    return read_int(name, env.get(name), default=DEFAULT_LIVENESS_INTERVALS * interval, minimum=0)


#: Parallel dimension -> the variable holding this process's rank in it.
RANK_VARIABLES = {"tp": ev.OTEL_SWA_TP_RANK, "dp": ev.OTEL_SWA_DP_RANK, "pp": ev.OTEL_SWA_PP_RANK}


def parallel_ranks(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """The ranks set in ``OTEL_SWA_TP_RANK``, ``OTEL_SWA_DP_RANK``, ``OTEL_SWA_PP_RANK``.

    Returns ``{"tp": 0, "pp": 1}``-style dict holding only the variables that are set.

    Raises:
        ConfigError: a set variable is not an integer >= 0.
    """
    env = os.environ if environ is None else environ
    ranks = {}
    for dim, name in RANK_VARIABLES.items():
        value = read_int(name, env.get(name), default=-1, minimum=0)
        if value >= 0:
            ranks[dim] = value
    return ranks


def sigterm_flush(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SWA_SIGTERM_FLUSH``: whether to flush on SIGTERM (default True).

    Raises:
        ConfigError: a value other than 0 or 1.
    """
    return _read_flag(ev.OTEL_SWA_SIGTERM_FLUSH, environ, default=True)


def require_sglang(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SWA_REQUIRE_SGLANG`` (test suite only): whether an SGLang that does not import fails
    the SGLang engine tests instead of skipping them (default False).

    Raises:
        ConfigError: a value other than 0 or 1.
    """
    return _read_flag(ev.OTEL_SWA_REQUIRE_SGLANG, environ, default=False)


def require_vllm(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SWA_REQUIRE_VLLM`` (test suite only): as :func:`require_sglang`, for vLLM.

    Raises:
        ConfigError: a value other than 0 or 1.
    """
    return _read_flag(ev.OTEL_SWA_REQUIRE_VLLM, environ, default=False)


#: Default of ``OTEL_SWA_METRIC_EXPORT_INTERVAL`` (milliseconds): the OpenTelemetry default of
#: ``OTEL_BSP_SCHEDULE_DELAY``, so that metric points are no older than spans at a SIGKILL.
DEFAULT_METRIC_EXPORT_INTERVAL_MS = 5000


def metric_export_interval_ms(environ: Mapping[str, str] | None = None) -> int:
    """``OTEL_SWA_METRIC_EXPORT_INTERVAL``: milliseconds between metric exports while an engine
    instrumentor's reporter lives (default :data:`DEFAULT_METRIC_EXPORT_INTERVAL_MS`; 0: off).

    Raises:
        ConfigError: not an integer >= 0.
    """
    env = os.environ if environ is None else environ
    name = ev.OTEL_SWA_METRIC_EXPORT_INTERVAL
    return read_int(name, env.get(name), default=DEFAULT_METRIC_EXPORT_INTERVAL_MS, minimum=0)


#: The OTLP exporters' timeout when no variable sets one (seconds; OpenTelemetry's default).
DEFAULT_OTLP_TIMEOUT_S = 10.0

_OTLP_TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                           "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT")


def otlp_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """The longest OTLP export timeout set, in seconds as the Python exporters read
    ``OTEL_EXPORTER_OTLP_TIMEOUT`` and ``OTEL_EXPORTER_OTLP_<SIGNAL>_TIMEOUT`` (the specification
    says milliseconds; opentelemetry-exporter-otlp 1.45 reads seconds); :data:`DEFAULT_OTLP_TIMEOUT_S`
    when none is set. A value that is not a finite number >= 0 is passed over here
    (:func:`otel_swa.telemetry.otlp_env.check_otlp_environment` reports it). The bound of every
    wait otel-swa adds to a process's stop."""
    env = os.environ if environ is None else environ
    timeouts = []
    for name in _OTLP_TIMEOUT_VARIABLES:
        try:
            value = float(env[name])
        except (KeyError, ValueError):
            continue
        if math.isfinite(value) and value >= 0:
            timeouts.append(value)
    return max(timeouts) if timeouts else DEFAULT_OTLP_TIMEOUT_S


#: Values of ``OTEL_SWA_FORWARD_SPANS``, the default first.
FORWARD_SPANS_CHOICES = ("sampled", "all", "off")


def _choice(name: str, choices: tuple[str, ...], environ: Mapping[str, str] | None) -> str:
    """Variable ``name`` as one of ``choices`` (case and blanks ignored; unset or blank: the first).

    Raises:
        ConfigError: any other value (the message names the variable, the value and the choices).
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return choices[0]
    value = raw.strip().lower()
    if value not in choices:
        raise invalid(name, raw, f"one of {', '.join(choices)}")
    return value


def forward_spans(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_SWA_FORWARD_SPANS``: which forward steps get a span, one of
    :data:`FORWARD_SPANS_CHOICES` (default ``sampled``; case and blanks ignored).

    Raises:
        ConfigError: any other value (the message names the variable, the value and the choices).
    """
    return _choice(ev.OTEL_SWA_FORWARD_SPANS, FORWARD_SPANS_CHOICES, environ)


#: Values of ``OTEL_SWA_MICRO_BATCHES``, the default first.
MICRO_BATCH_MODES = ("one", "every")


def micro_batches(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_SWA_MICRO_BATCHES``: which micro-batches a sampling step samples under pipeline
    parallelism, one of :data:`MICRO_BATCH_MODES` (default ``one``; case and blanks ignored).

    Raises:
        ConfigError: any other value (the message names the variable, the value and the choices).
    """
    return _choice(ev.OTEL_SWA_MICRO_BATCHES, MICRO_BATCH_MODES, environ)


#: Values of ``OTEL_SWA_READ_CHECK``, the default first.
READ_CHECK_CHOICES = ("rotate", "all", "off")


def read_check(environ: Mapping[str, str] | None = None) -> "tuple[str, int] | None":
    """``OTEL_SWA_READ_CHECK`` and ``OTEL_SWA_READ_CHECK_QUERIES``: ``(layers, queries)`` for the read
    check (``layers`` one of ``rotate``, ``all``; default ``("rotate", 8)``), or ``None`` when it is
    ``off``.

    Raises:
        ConfigError: a value outside the choices, or queries not an integer from 1 to 256.
    """
    env = os.environ if environ is None else environ
    layers = _choice(ev.OTEL_SWA_READ_CHECK, READ_CHECK_CHOICES, env)
    queries = read_int(ev.OTEL_SWA_READ_CHECK_QUERIES, env.get(ev.OTEL_SWA_READ_CHECK_QUERIES), default=8,
                       minimum=1, maximum=256)
    return None if layers == "off" else (layers, queries)


#: Values of ``OTEL_SWA_GRAPH_CHECKS``, the default first (:data:`otel_swa.device.gate.GRAPH_MODES`).
GRAPH_CHECKS_CHOICES = ("masked", "conditional")


def graph_checks(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_SWA_GRAPH_CHECKS``: ``masked`` (default) or ``conditional``.

    Raises:
        ConfigError: any other value.
    """
    return _choice(ev.OTEL_SWA_GRAPH_CHECKS, GRAPH_CHECKS_CHOICES, environ)


#: Values of ``OTEL_SWA_PROVENANCE``, the default first: the checksum's coverage, or off.
PROVENANCE_CHOICES = ("all", "prefix", "off")


def provenance(environ: Mapping[str, str] | None = None) -> "tuple[str, int] | None":
    """``OTEL_SWA_PROVENANCE`` and ``OTEL_SWA_PROVENANCE_BUDGET``: ``(checksum, budget)`` for
    provenance (``checksum`` one of ``all``, ``prefix``; default ``("all", 4096)``), or ``None``
    when it is ``off``.

    Raises:
        ConfigError: a value outside the choices, or a budget not an integer from 1 to 1048576.
    """
    env = os.environ if environ is None else environ
    checksum = _choice(ev.OTEL_SWA_PROVENANCE, PROVENANCE_CHOICES, env)
    budget = read_int(ev.OTEL_SWA_PROVENANCE_BUDGET, env.get(ev.OTEL_SWA_PROVENANCE_BUDGET), default=4096,
                      minimum=1, maximum=1 << 20)
    return None if checksum == "off" else (checksum, budget)


#: What ``OTEL_SWA_WARNED`` holds: instrumentor names (``swa_sglang``), comma-separated.
_WARNED_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")


def warned_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """``OTEL_SWA_WARNED``: the instrumentors that already logged their one warning in this process
    tree (comma-separated names of letters, digits, ``_``, ``.``, ``-``; blanks around them ignored).

    Raises:
        ConfigError: an item that is no such name (``"swa_sglang;swa_vllm"``).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ev.OTEL_SWA_WARNED, "")
    names = [item.strip() for item in raw.split(",") if item.strip()]
    if not all(_WARNED_NAME_RE.fullmatch(item) for item in names):
        raise invalid(ev.OTEL_SWA_WARNED, raw, "instrumentor names separated by commas (set by otel-swa itself)")
    return names


def warn_once(name: str, environ: "MutableMapping[str, str] | None" = None) -> bool:
    """Whether this process tree has not yet logged ``name``'s one warning; marks it as logged.

    The marker is ``OTEL_SWA_WARNED`` (comma-separated names) in ``os.environ``, which child
    processes inherit, so each engine process started after the first warning stays quiet. An
    unusable marker (:func:`warned_names`) counts as empty and is replaced: this runs inside
    engines, where it must not raise.
    """
    env = os.environ if environ is None else environ
    try:
        warned = warned_names(env)
    except ConfigError:
        warned = []
    if name in warned:
        return False
    env[ev.OTEL_SWA_WARNED] = ",".join(warned + [name])
    return True


#: The OpenTelemetry specification's defaults for ``OTEL_EXPORTER_PROMETHEUS_HOST`` / ``_PORT``.
DEFAULT_PROMETHEUS_HOST = "localhost"
DEFAULT_PROMETHEUS_PORT = 9464
#: The longest ``OTEL_SWA_PROMETHEUS_LINGER`` (seconds).
MAX_PROMETHEUS_LINGER_S = 600.0


def prometheus_address(ranks: Mapping[str, int], environ: Mapping[str, str] | None = None) -> tuple[str, int, str]:
    """Where this process's Prometheus endpoint listens: ``(host, port, why)``.

    ``host`` is ``OTEL_EXPORTER_PROMETHEUS_HOST`` (default ``localhost``); ``port`` is
    ``OTEL_EXPORTER_PROMETHEUS_PORT`` (default 9464) plus the offset ``OTEL_SWA_PROMETHEUS_PORT_OFFSET``
    chooses: ``rank`` (default) the ``local_rank`` of ``ranks`` (:func:`otel_swa.ranks.process_ranks`:
    the launcher's ``LOCAL_RANK``), else its ``rank`` (``torch.distributed`` or ``RANK``), else 0; or
    the integer given. ``why`` says how the port was made (for messages), e.g. ``"9464 + LOCAL_RANK 1"``.

    Raises:
        ConfigError: a port or offset that is not an integer, or a port beyond 1 .. 65535.
    """
    env = os.environ if environ is None else environ
    host = (env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "").strip() or DEFAULT_PROMETHEUS_HOST
    base = read_int("OTEL_EXPORTER_PROMETHEUS_PORT", env.get("OTEL_EXPORTER_PROMETHEUS_PORT"),
                    default=DEFAULT_PROMETHEUS_PORT, minimum=1, maximum=65535)
    chosen = prometheus_port_offset(env)
    if chosen == "rank":
        if "local_rank" in ranks:
            offset, source = ranks["local_rank"], "LOCAL_RANK"
        elif "rank" in ranks:
            offset, source = ranks["rank"], "rank"
        else:
            offset, source = 0, ""
    else:
        offset, source = chosen, ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET
    port = base + offset
    why = f"{base} + {source} {offset}" if source else f"{base}"
    if port > 65535:
        raise ConfigError(f"the Prometheus port {why} = {port} is above 65535; lower OTEL_EXPORTER_PROMETHEUS_PORT "
                          f"or set {ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET}")
    return host, port, why


def prometheus_port_offset(environ: Mapping[str, str] | None = None) -> "int | str":
    """``OTEL_SWA_PROMETHEUS_PORT_OFFSET``: ``"rank"`` (unset, blank or ``rank``, any case) or the
    integer >= 0 given.

    Raises:
        ConfigError: anything else.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET)
    text = (raw or "").strip().lower()
    if text in ("", "rank"):
        return "rank"
    try:
        return read_int(ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET, text, default=0, minimum=0)
    except ConfigError:
        raise invalid(ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET, raw, "'rank' or an integer >= 0") from None


def prometheus_linger(environ: Mapping[str, str] | None = None) -> float:
    """``OTEL_SWA_PROMETHEUS_LINGER``: seconds the Prometheus endpoint waits at shutdown for one
    more scrape (default 0).

    Raises:
        ConfigError: not a number from 0 to :data:`MAX_PROMETHEUS_LINGER_S`.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ev.OTEL_SWA_PROMETHEUS_LINGER)
    if raw is None or raw.strip() == "":
        return 0.0
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_PROMETHEUS_LINGER_S:
        raise invalid(ev.OTEL_SWA_PROMETHEUS_LINGER, raw, f"seconds from 0 to {MAX_PROMETHEUS_LINGER_S:g}")
    return value


#: Each variable of :mod:`otel_swa.environment_variables` -> the function here that reads and
#: validates it (``environ`` in, the value out; ``ConfigError`` for an unusable value). Every name
#: of that module is here: :func:`check_environment` validates them all, and a test walks this
#: table with bad values.
VARIABLE_READERS: dict = {
    ev.OTEL_SWA_DIVERGENCE_INTERVAL: divergence_interval,
    ev.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL: lambda env: read_int(
        ev.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL, env.get(ev.SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL),
        default=0, minimum=0),
    ev.OTEL_SWA_RING_SIZE: ring_size,
    ev.OTEL_SWA_TP_RANK: parallel_ranks,
    ev.OTEL_SWA_DP_RANK: parallel_ranks,
    ev.OTEL_SWA_PP_RANK: parallel_ranks,
    ev.OTEL_SWA_REQUIRE_SGLANG: require_sglang,
    ev.OTEL_SWA_REQUIRE_VLLM: require_vllm,
    ev.OTEL_SWA_SIGTERM_FLUSH: sigterm_flush,
    ev.OTEL_SWA_METRIC_EXPORT_INTERVAL: metric_export_interval_ms,
    ev.OTEL_SWA_MICRO_BATCHES: micro_batches,
    ev.OTEL_SWA_LIVENESS_STEPS: lambda env: liveness_steps(1, env),
    ev.OTEL_SWA_FORWARD_SPANS: forward_spans,
    ev.OTEL_SWA_READ_CHECK: read_check,
    ev.OTEL_SWA_READ_CHECK_QUERIES: read_check,
    ev.OTEL_SWA_WARNED: warned_names,
    ev.OTEL_SWA_PROMETHEUS_PORT_OFFSET: prometheus_port_offset,
    ev.OTEL_SWA_PROMETHEUS_LINGER: prometheus_linger,
    ev.OTEL_SWA_GRAPH_CHECKS: graph_checks,
    ev.OTEL_SWA_PROVENANCE: provenance,
    ev.OTEL_SWA_PROVENANCE_BUDGET: provenance,
}


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validate every variable of :data:`VARIABLE_READERS` (all of
    :mod:`otel_swa.environment_variables`), set or not, in that order: the commands call it before
    they do anything, the engine instrumentors before they wrap anything.

    Raises:
        ConfigError: the first unusable value (the message names the variable, the value and what
            was expected: :func:`invalid`).
    """
    env = os.environ if environ is None else environ
    for read in dict.fromkeys(VARIABLE_READERS.values()):
        read(env)
