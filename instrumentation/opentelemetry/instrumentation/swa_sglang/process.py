"""What the SGLang wiring reads of its process: the tensor / pipeline / data parallel ranks SGLang
published there, and otel-swa's settings (``otel_swa.config``) read without raising."""

from __future__ import annotations

import logging
from typing import Any, Callable

_log = logging.getLogger(__package__)  # the instrumentor's logger (opentelemetry.instrumentation.swa_sglang)


def configured(read: Callable[[], Any], unusable: str | None = None) -> Any:
    """``read()`` (an :mod:`otel_swa.config` reader: the setting, ``None`` when off), or ``None``
    when the setting is unusable (``config.ConfigError``), then logged with its traceback as
    ``unusable`` when given (the caller that logs it once), else not logged."""
    from otel_swa import config

    try:
        return read()
    except config.ConfigError:
        if unusable is not None:
            _log.exception(unusable)
        return None


def _ranks() -> dict[str, int]:
    """This process's tensor / pipeline / data parallel ranks as SGLang published them
    (``sglang.srt.runtime_context.get_parallel()``), as otel-swa attributes; empty when unknown."""
    from otel_swa.telemetry import semconv as sc

    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    except Exception:
        return {}
    ranks = {}
    for key, name in ((sc.ATTR_TP_RANK, "tp_rank"), (sc.ATTR_PP_RANK, "pp_rank"), (sc.ATTR_DP_RANK, "dp_rank")):
        try:
            value = getattr(parallel, name)
        except Exception:  # not published in this process
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            ranks[key] = value
    return ranks
