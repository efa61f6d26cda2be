"""The forward-step span, its links to the requests of the batch, and request spans.

:class:`ForwardSpans` is what an engine wraps around each forward step::

    with forward_spans.forward_span(batch_info):   # span "forward step", current while inside
        logits = model(batch)
        reporter.step(view)                        # the reporter keeps this context for the sample

``batch_info`` is any object with the attributes ``forward_ct``, ``batch_size``, ``num_prefill``,
``num_decode`` and ``request_ids`` (the reference engine's batch info has them), or the same values
as keyword arguments. The span (kind INTERNAL) carries only bounded attributes (counts; never a
request id) and one link per request of the batch, to the request's span as identified by its W3C
``traceparent`` header (``00-<trace-id>-<span-id>-<flags>``, W3C Trace Context, parsed with
OpenTelemetry's TraceContext propagator), as a serving front end receives it.

Which steps get a span (``OTEL_SWA_FORWARD_SPANS``, or ``ForwardSpans(mode=...)``): ``sampled``, the
default, starts the span only at the forward steps where the reporter takes a sample (``forward_ct``
a multiple of the sampling interval), so every sample's event, span event and exemplars still point
at a forward-step span linked to the request spans of its batch: the request-trace correlation of
what the reporter measures is kept, at ``1 / interval`` of the cost of a span per step (about
100 us with 48 links on 2 CPU cores: ``benchmarks/bench_telemetry.py``). ``all`` spans every step
(an engine with no other tracing of its steps may want them), ``off`` none. On a step without a span
the context manager yields the API's invalid span and the current context is left as it was; it
costs a few hundred nanoseconds. When the interval is not known (``interval=`` not given and the
interval variables unset), ``sampled`` spans every step.

Link limit: OpenTelemetry keeps at most ``SpanLimits.max_links`` links per span (128 by default,
``OTEL_SPAN_LINK_COUNT_LIMIT``) and silently drops the rest. The helper adds at most that many and
counts the others in ``forward_step.links.dropped``; requests with no usable traceparent are counted
in ``forward_step.links.missing``. With no traceparent lookup configured no link is looked for:
both counts are 0 (``links.missing`` 0 then means "no lookup", not "every request linked").

:class:`RequestSpans` gives each request a span of its own (kind SERVER, root of its own trace),
started at arrival and ended when the request finishes, and hands out its traceparent; it can be
given to :class:`ForwardSpans` as the traceparent lookup.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from contextlib import contextmanager
from typing import Any, ContextManager, Iterable, Iterator, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_swa import config
from otel_swa.telemetry import semconv as sc

__all__ = [
    "parse_traceparent",
    "format_traceparent",
    "ForwardSpans",
    "RequestSpans",
    "SystemRandomIdGenerator",
    "use_system_random_ids",
]

_log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()


def parse_traceparent(traceparent: Any) -> SpanContext | None:
    """The remote ``SpanContext`` of a W3C ``traceparent`` value, or ``None`` if it is not a valid
    one (any value that is not a ``str`` included; nothing is raised).

    Parsed by OpenTelemetry's ``TraceContextTextMapPropagator`` (W3C Trace Context level 1); results
    are cached because a request's traceparent is looked up at every step it takes part in.
    """
    if not isinstance(traceparent, str):  # checked before the cache: an unhashable value cannot be a key
        return None
    link = _link(traceparent)
    return None if link is None else link.context


@functools.lru_cache(maxsize=8192)
def _link(traceparent: str) -> Link | None:
    """The span link to the span of ``traceparent`` (the one cache: a request takes part in many
    steps)."""
    span_context = trace.get_current_span(_PROPAGATOR.extract({"traceparent": traceparent})).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def format_traceparent(span_context: SpanContext) -> str | None:
    """The W3C ``traceparent`` value of ``span_context`` (``00-<32 hex>-<16 hex>-<2 hex>``), or
    ``None`` for an invalid span context (no tracing SDK installed: the API's no-op spans)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
    return carrier.get("traceparent")


class SystemRandomIdGenerator(IdGenerator):
    """Trace and span ids from the operating system's random source (``random.SystemRandom``).

    The SDK's default ``RandomIdGenerator`` draws from Python's global ``random`` state, which
    engines seed for reproducible sampling (SGLang's ``random_seed``, default 0): every run, and every
    rank, would then start the same trace ids. ``os.urandom`` is not touched by any seed and differs
    in forked children too.
    """

    def __init__(self) -> None:
        self._random = random.SystemRandom()

    def generate_span_id(self) -> int:
        span_id = self._random.getrandbits(64)
        while span_id == trace.INVALID_SPAN_ID:
            span_id = self._random.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = self._random.getrandbits(128)
        while trace_id == trace.INVALID_TRACE_ID:
            trace_id = self._random.getrandbits(128)
        return trace_id


_SYSTEM_IDS = SystemRandomIdGenerator()


def use_system_random_ids(tracer: Any) -> bool:
    """Give ``tracer`` (an SDK ``Tracer``, or the API's proxy once it has one) the
    :class:`SystemRandomIdGenerator` when it uses the SDK's seedable default; only this tracer
    changes, not its provider's other tracers. Returns whether the tracer's ids are now independent
    of Python's ``random`` seed (``False``: a proxy with no SDK tracer yet; call again later)."""
    real = getattr(tracer, "_real_tracer", None) or tracer
    generator = getattr(real, "id_generator", None)
    if generator is None:
        return False
    if type(generator) is RandomIdGenerator:
        real.id_generator = _SYSTEM_IDS
    return True


#: What ``forward_span`` gives on a step without a span: reusable, enters to the invalid span.
_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def _default_max_links() -> int:
    return SpanLimits().max_links  # OTEL_SPAN_LINK_COUNT_LIMIT, else 128


class ForwardSpans:
    """Starts the forward-step span with links to the request spans of the batch.

    Args:
        tracer: the ``Tracer`` to start spans with.
        traceparents: how to find a request's W3C traceparent from its request id: a mapping, or a
            callable returning the string or ``None``; ``None``: no links.
        max_links: most links per forward-step span; default ``SpanLimits().max_links``
            (``OTEL_SPAN_LINK_COUNT_LIMIT``, 128). Keep it at or below the tracer provider's limit.
        mode: which steps get a span, ``sampled``, ``all`` or ``off`` (module docstring); default
            ``OTEL_SWA_FORWARD_SPANS`` (``sampled``).
        interval: the reporter's sampling interval, for ``sampled``; default the interval variables
            (``OTEL_SWA_DIVERGENCE_INTERVAL``, SGLang's), as the instrumentors read them. Settable
            later (:attr:`interval`), e.g. when the reporter is made after the spans.
        environ: the environment for the defaults (default ``os.environ``).

    Raises:
        ValueError: ``max_links`` is negative, ``interval`` below 1, an unknown ``mode``.
        TypeError: ``traceparents`` is neither a mapping nor callable.
        otel_swa.config.ConfigError: ``OTEL_SWA_FORWARD_SPANS`` holds an unknown value.
    """

    def __init__(
        self,
        tracer: Tracer,
        traceparents: Any = None,
        *,
        max_links: int | None = None,
        mode: str | None = None,
        interval: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if max_links is None:
            max_links = _default_max_links()
        if isinstance(max_links, bool) or not isinstance(max_links, int) or max_links < 0:
            raise ValueError(f"max_links={max_links!r}; expected an integer >= 0")
        if mode is None:
            mode = config.forward_spans(environ)
        if mode not in config.FORWARD_SPANS_CHOICES:
            raise ValueError(f"mode={mode!r}; expected one of {', '.join(config.FORWARD_SPANS_CHOICES)}")
        if interval is None:
            try:
                interval = config.divergence_interval_if_set(environ) or None
            except config.ConfigError:  # the reporter's own set-up reports it
                interval = None
        self.mode = mode
        self.interval = interval
        if traceparents is not None and not isinstance(traceparents, Mapping) and not callable(traceparents):
            raise TypeError(
                f"traceparents must be a mapping or a callable request_id -> traceparent, got {type(traceparents).__name__}"
            )
        self._tracer = tracer
        self._ids_independent = use_system_random_ids(tracer)
        self._traceparents = traceparents
        # decided once: an isinstance check against the Mapping ABC per request costs more than the lookup
        if traceparents is None:
            self._get = None
        elif isinstance(traceparents, Mapping):
            self._get = traceparents.get
        else:
            self._get = traceparents
        self.max_links = max_links

    @property
    def interval(self) -> int | None:
        """The sampling interval ``sampled`` follows (``None``: unknown, every step gets a span)."""
        return self._interval

    @interval.setter
    def interval(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"interval={value!r}; expected an integer >= 1 or None")
        self._interval = value

    def spans_step(self, forward_ct: Any) -> bool:
        """Whether forward step ``forward_ct`` gets a span under :attr:`mode` (a step whose
        ``forward_ct`` is unknown gets one under ``sampled``)."""
        if self.mode == "all":
            return True
        if self.mode == "off":
            return False
        interval = self._interval
        return interval is None or forward_ct is None or int(forward_ct) % interval == 0

    def _lookup(self, request_id: Any) -> str | None:
        if self._get is None:
            return None
        try:
            return self._get(request_id)
        except Exception:  # a lookup failure never breaks the forward step
            _log.exception("traceparent lookup failed for a request; no link added")
            return None

    def links(self, request_ids: Iterable[Any]) -> tuple[list[Link], int, int]:
        """The links for ``request_ids`` and the counts ``(dropped over the limit, missing)``.

        With no traceparent lookup configured, ``([], 0, 0)`` at once (no request is looked at).
        """
        if self._get is None:
            return [], 0, 0
        links: list[Link] = []
        dropped = missing = 0
        for request_id in request_ids:
            traceparent = self._lookup(request_id)
            link = _link(traceparent) if type(traceparent) is str else None
            if link is None:
                missing += 1
            elif len(links) < self.max_links:
                links.append(link)
            else:
                dropped += 1
        return links, dropped, missing

    def forward_span(
        self,
        batch_info: Any = None,
        *,
        forward_ct: int | None = None,
        batch_size: int | None = None,
        num_prefill: int | None = None,
        num_decode: int | None = None,
        request_ids: Iterable[Any] | None = None,
        context: Context | None = None,
        link_contexts: Iterable[SpanContext | None] | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> ContextManager[Span]:
        """A context manager running the body inside a new current span ``forward step``; yields
        the span. On a step :meth:`spans_step` leaves out, it yields the API's invalid span and
        changes nothing (no lookup, no link, no span).

        Values come from ``batch_info``'s attributes of the same names unless given as keywords.
        ``context`` is the parent (default: the current context). ``link_contexts``: span
        contexts of the batch's requests to link to directly (an engine that keeps its own request
        spans), instead of looking ``request_ids`` up; ``None`` entries and invalid contexts count
        as missing. ``attributes``: more bounded span attributes (the process's ranks). An
        exception in the body is recorded on the span (status ERROR) and re-raised.
        """
        if forward_ct is None:
            forward_ct = getattr(batch_info, "forward_ct", None)
        if self.mode != "all" and not self.spans_step(forward_ct):
            return _NO_SPAN
        return self._forward_span(
            batch_info, forward_ct, batch_size, num_prefill, num_decode, request_ids, context, link_contexts, attributes,
        )

    @contextmanager
    def _forward_span(
        self, batch_info, forward_ct, batch_size, num_prefill, num_decode, request_ids, context, link_contexts, attributes,
    ) -> Iterator[Span]:
        if not self._ids_independent:
            self._ids_independent = use_system_random_ids(self._tracer)

        def pick(name: str, value: Any) -> Any:
            return value if value is not None else getattr(batch_info, name, None)

        batch_size = pick("batch_size", batch_size)
        num_prefill = pick("num_prefill", num_prefill)
        num_decode = pick("num_decode", num_decode)
        request_ids = pick("request_ids", request_ids) or ()
        if link_contexts is not None:
            links, dropped, missing = self._direct_links(link_contexts)
        else:
            links, dropped, missing = self.links(request_ids)
        span_attributes = dict(attributes) if attributes else {}
        span_attributes.update({
            key: int(value)
            for key, value in (
                (sc.ATTR_FORWARD_CT, forward_ct),
                (sc.ATTR_BATCH_SIZE, batch_size),
                (sc.ATTR_NUM_PREFILL, num_prefill),
                (sc.ATTR_NUM_DECODE, num_decode),
            )
            if value is not None
        })
        span_attributes[sc.ATTR_LINKS_DROPPED] = dropped
        span_attributes[sc.ATTR_LINKS_MISSING] = missing
        with self._tracer.start_as_current_span(
            sc.FORWARD_SPAN_NAME, context=context, kind=SpanKind.INTERNAL, attributes=span_attributes, links=links
        ) as span:
            yield span

    def _direct_links(self, span_contexts: Iterable[SpanContext | None]) -> tuple[list[Link], int, int]:
        links: list[Link] = []
        dropped = missing = 0
        seen = set()
        for span_context in span_contexts:
            if span_context is None or not span_context.is_valid:
                missing += 1
                continue
            key = (span_context.trace_id, span_context.span_id)
            if key in seen:  # one link per request span, even if it appears twice
                continue
            seen.add(key)
            if len(links) < self.max_links:
                links.append(Link(span_context))
            else:
                dropped += 1
        return links, dropped, missing

    __call__ = forward_span


class RequestSpans:
    """One span per request (kind SERVER, a new trace each), keyed by request id.

    Args:
        tracer: the ``Tracer`` to start spans with.

    A request's traceparent is available from :meth:`start` until :meth:`end`; the object itself is
    the lookup callable :class:`ForwardSpans` accepts.
    """

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        use_system_random_ids(tracer)
        self._spans: dict[Any, tuple[Span, str]] = {}

    def start(self, request_id: Any, *, attributes: Mapping[str, Any] | None = None, start_time: int | None = None) -> str | None:
        """Start the span of ``request_id`` (root of its own trace) and return its traceparent
        (``None`` when no tracing SDK is installed and the span is the API's no-op span).

        ``start_time`` is in nanoseconds since the epoch (default now).

        Raises:
            ValueError: a span for ``request_id`` is already open.
        """
        if request_id in self._spans:
            raise ValueError(f"request {request_id!r} already has an open span")
        span = self._tracer.start_span(
            sc.REQUEST_SPAN_NAME, context=Context(), kind=SpanKind.SERVER,
            attributes=dict(attributes or {}), start_time=start_time,
        )
        traceparent = format_traceparent(span.get_span_context())
        self._spans[request_id] = (span, traceparent)
        return traceparent

    def traceparent(self, request_id: Any) -> str | None:
        """The traceparent of the open span of ``request_id``, or ``None``."""
        entry = self._spans.get(request_id)
        return None if entry is None else entry[1]

    __call__ = traceparent

    def span(self, request_id: Any) -> Span | None:
        """The open span of ``request_id``, or ``None``."""
        entry = self._spans.get(request_id)
        return None if entry is None else entry[0]

    def end(self, request_id: Any, *, attributes: Mapping[str, Any] | None = None, end_time: int | None = None) -> None:
        """End the span of ``request_id`` (no-op when it has none)."""
        entry = self._spans.pop(request_id, None)
        if entry is None:
            return
        if attributes:
            entry[0].set_attributes(dict(attributes))
        entry[0].end(end_time=end_time)

    def end_all(self) -> None:
        """End every open request span (at shutdown)."""
        for request_id in list(self._spans):
            self.end(request_id)

    def __len__(self) -> int:
        return len(self._spans)
