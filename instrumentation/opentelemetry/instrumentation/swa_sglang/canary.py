"""The SGLang instrumentor's wrappers of SGLang's KV canary (``CanaryManager``): the reporter it
gets at construction, and the verified entries of each forward's plans it counts."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

from opentelemetry.instrumentation.swa_sglang.attributes import CANARY_ATTRIBUTE
from opentelemetry.instrumentation.swa_sglang.process import _ranks

_log = logging.getLogger(__package__)  # the instrumentor's logger (opentelemetry.instrumentation.swa_sglang)


class KvCanaryWiring:
    """``CanaryManager.__init__`` and ``pre_ops_maybe_inside_graph`` wrappers of
    :class:`~opentelemetry.instrumentation.swa_sglang.SwaSglangInstrumentor`."""

    def _wrap_canary_init(self, original: Callable) -> Callable:
        instrumentor = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(manager, *args, **kwargs):
            original(manager, *args, **kwargs)
            try:
                # device and is_eagle_draft_decode may come by position or by keyword
                bound = signature.bind(manager, *args, **kwargs)
                bound.apply_defaults()
                reporter = None
                if not bound.arguments.get("is_eagle_draft_decode", False):
                    reporter = instrumentor._new_reporter(
                        bound.arguments["device"], verify_source="kv_canary", attributes=_ranks()
                    )
                setattr(manager, CANARY_ATTRIBUTE, reporter)
            except Exception:
                _log.exception("SWA divergence reporter not attached to the KV canary")

        return __init__

    def _wrap_pre_ops(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def pre_ops_maybe_inside_graph(manager, forward_batch, *args, **kwargs):
            output = original(manager, forward_batch, *args, **kwargs)
            reporter = getattr(manager, CANARY_ATTRIBUTE, None)
            if reporter is not None:
                try:
                    from otel_swa.views.sglang import observe_verified

                    for group, plan in zip(manager._buffer_groups, output.verify_plans):
                        observe_verified(reporter, group, plan.verify_num_valid)
                except Exception:
                    _log.exception("verified KV entries not counted")
            return output

        return pre_ops_maybe_inside_graph
