"""The SGLang instrumentor's wrapper of ``RadixAttention.forward``: every attention layer's
provenance stamps, checksums and write check (:mod:`.provenance`) and the read check of
sliding-window layers at sampled steps (:mod:`.read_check`)."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from opentelemetry.instrumentation.swa_sglang.attributes import PROVENANCE_ATTRIBUTE
from opentelemetry.instrumentation.swa_sglang.process import configured
from opentelemetry.instrumentation.swa_sglang.provenance import _after_layer, _stamp
from opentelemetry.instrumentation.swa_sglang.read_check import _check_read

_log = logging.getLogger(__package__)  # the instrumentor's logger (opentelemetry.instrumentation.swa_sglang)


class AttentionWiring:
    """The ``RadixAttention.forward`` wrapper of :class:`~opentelemetry.instrumentation.swa_sglang.SwaSglangInstrumentor`
    (``self._running``: the wiring of the model runner whose forward runs on this thread)."""

    def _wrap_attention(self, original: Callable) -> Callable:
        """``RadixAttention.forward``: the provenance stamps, checksums and write check of every
        attention layer, and the read check of sliding-window layers at sampled steps (module
        docstring); the original itself when both ``OTEL_SWA_READ_CHECK`` and
        ``OTEL_SWA_PROVENANCE`` are off."""
        from otel_swa import config

        reads = configured(config.read_check, "the read check is off: unusable OTEL_SWA_READ_CHECK(_QUERIES)") is not None
        provenance = configured(config.provenance, "provenance is off: unusable OTEL_SWA_PROVENANCE(_BUDGET)") is not None
        if not reads and not provenance:
            return original
        running = self._running
        failed: set = set()

        def failure(what: str, layer: Any, exc: Exception) -> None:
            if (what, type(exc)) not in failed:
                failed.add((what, type(exc)))
                _log.exception("the %s of layer %s failed; the forward goes on (later %s errors are not logged)",
                               what, getattr(layer, "layer_id", "?"), type(exc).__name__)

        @functools.wraps(original)
        def forward(layer, q, k, v, forward_batch, *args, **kwargs):
            wired = layer.__dict__.get(PROVENANCE_ATTRIBUTE)
            if wired is not None and layer.layer_id == wired.layout["first_layer"]:
                try:
                    _stamp(wired, forward_batch)
                except Exception as exc:  # telemetry never breaks the forward
                    failure("provenance stamp", layer, exc)
            output = original(layer, q, k, v, forward_batch, *args, **kwargs)
            if wired is not None:
                try:
                    _after_layer(wired, layer, k, v, forward_batch, args, kwargs)
                except Exception as exc:
                    failure("provenance check", layer, exc)
            wiring = getattr(running, "wiring", None)
            if wiring is None or wiring.read_check is None or not wiring.reporter.checks_wanted():
                return output
            try:
                _check_read(wiring, layer, q, output, forward_batch, kwargs)
            except Exception as exc:
                failure("read check", layer, exc)
            return output

        return forward
