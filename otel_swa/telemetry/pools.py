"""KV cache pool usage as observable gauges, and the KV bytes the sliding window saves.

Pool usage. An engine's instrumentor registers a *pool usage source* (a callable returning one
:class:`~otel_swa.pool_usage.PoolUsage` per pool, host integers the engine already keeps: SGLang's
allocator and tree cache sizes, vLLM's ``BlockPool`` and block tables, the reference engine's free
lists) with :meth:`PoolMetrics.register`. The observable gauges of :data:`POOL_INSTRUMENTS` call the
sources when the SDK collects (``OTEL_METRIC_EXPORT_INTERVAL``, or a ``force_flush``), on the
collecting thread: nothing runs on the engine's forward path and nothing waits for a device.

All the gauges of one collection read each source once: the first gauge called in a collection
takes a snapshot of every source, the others report from it, so ``used + available + evictable``
of a pool add up at the collector as they did in the engine. Sources registered with the same
attributes (several reference engines in one process, without ranks) are summed per pool.

Each point has ``pool`` (``full`` | ``swa``) and the attributes given at registration (the process's
ranks, ``otel_swa.tp_rank`` / ``pp_rank`` / ``dp_rank``, when known). A source that raises, or
returns something other than a sequence of ``PoolUsage``, is logged once per kind of fault and
skipped in that collection; a source returning ``None`` (the engine cannot say now) is skipped
silently. A source whose ``owner`` was garbage-collected is dropped.

What the window saves. :meth:`PoolMetrics.savings_sink` gives a reporter sink that keeps, for the
latest delivered sample, ``swa_out_of_window_tokens x bytes_per_token``: the KV bytes the sampled
batch's out-of-window tokens would hold in the sliding-window layers under full attention, where
the engine gives those layers' bytes per token (SGLang's SWA KV pool, the reference engine's KV
storage). The observable gauge ``kv_cache.swa.memory.saved`` reports it at collection with the
context of the forward step where the sample was taken (exemplars point there), like the other
sample gauges; delivering a record costs one multiplication and no SDK call. Sinks with the same
attributes are summed; a sink whose reporter is gone stops reporting.

Names and units follow the OpenTelemetry metric naming rules (dotted lowercase, UCUM units with
annotations, a ratio has unit ``1``; ``limit`` for a known total, as in ``system.memory.limit``:
a gauge ending in ``_total`` would read as a counter in Prometheus). What SGLang and vLLM call each
figure: ``docs/telemetry.md``, "KV cache pools".
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from opentelemetry import metrics as metrics_api
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_swa.pool_usage import PoolUsage
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.metrics import GAUGE, STATS_GAUGE, InstrumentSpec
from otel_swa.version import __version__

__all__ = [
    "POOL_NAMESPACE",
    "POOL_INSTRUMENTS",
    "SAVINGS_INSTRUMENT",
    "PoolMetrics",
    "PoolRegistration",
    "WindowSavingsSink",
    "pool_metrics",
]

_log = logging.getLogger(__name__)

#: Prefix of the pool usage gauges (they cover the FULL pool too, hence not ``kv_cache.swa.``).
POOL_NAMESPACE = "kv_cache.pool."

#: The pool usage gauges: ``read`` is the :class:`~otel_swa.pool_usage.PoolUsage` field each reports.
POOL_INSTRUMENTS: tuple[InstrumentSpec, ...] = tuple(
    InstrumentSpec(POOL_NAMESPACE + name, STATS_GAUGE, unit, description, f"PoolUsage.{read}", read)
    for name, unit, read, description in (
        ("tokens.used", "{token}", "used",
         "KV cache slots of the pool held by running requests (total - available - evictable)"),
        ("tokens.available", "{token}", "available", "Free KV cache slots of the pool"),
        ("tokens.evictable", "{token}", "evictable",
         "KV cache slots of the pool whose KV only the prefix cache holds (freed when it evicts them)"),
        ("tokens.limit", "{token}", "total", "KV cache slots of the pool in all"),
        ("utilization", "1", "usage", "Share of the pool's slots held by running requests (used / limit)"),
    )
)

#: The window savings gauge (set by :class:`WindowSavingsSink` at each delivered sample).
SAVINGS_INSTRUMENT = InstrumentSpec(
    sc.NAMESPACE + "memory.saved", GAUGE, "By",
    "KV cache bytes the sliding window saves in the sampled batch against full attention: "
    "out-of-window tokens x KV bytes per token of the sliding-window layers (K and V, all layers)",
    "swa_out_of_window_tokens x the engine's SWA KV bytes per token",
)


@dataclass(eq=False)
class PoolRegistration:
    """One registered pool usage source (returned by :meth:`PoolMetrics.register`).

    Attributes:
        attributes: added to every point of this source (bounded values: ranks).
    """

    source: Callable[..., Any]
    attributes: dict
    owner: "weakref.ref[Any] | None" = None
    metrics: "PoolMetrics | None" = field(default=None, repr=False)
    logged: set = field(default_factory=set, repr=False)

    def unregister(self) -> None:
        """Stop reading this source (idempotent)."""
        if self.metrics is not None:
            self.metrics._remove(self)

    def read(self) -> "Sequence[PoolUsage] | None":
        """Call the source (with its owner, when it has one); ``None``: no figures now. Never raises."""
        try:
            if self.owner is None:
                result = self.source()
            else:
                owner = self.owner()
                if owner is None:
                    return None
                result = self.source(owner)
            if result is None:
                return None
            usages = tuple(result)
            for usage in usages:
                if not isinstance(usage, PoolUsage):
                    raise TypeError(f"the pool usage source returned a {type(usage).__name__}; expected PoolUsage")
            return usages
        except Exception as exc:  # telemetry never breaks the collection (nor the engine)
            kind = type(exc).__name__
            if kind not in self.logged:
                self.logged.add(kind)
                _log.exception("KV cache pool usage not read (%s); later %s errors of this source are not logged",
                               kind, kind)
            return None


class PoolMetrics:
    """The pool usage gauges of :data:`POOL_INSTRUMENTS` and the savings gauge on one meter.

    Use :meth:`for_meter` (or :func:`pool_metrics`): the SDK keeps one instrument per name and
    meter, so a second set of observable gauges on the same meter would never be called.

    Thread safety: :meth:`register` and the callbacks may run on any thread.
    """

    _by_meter: "weakref.WeakKeyDictionary[Any, PoolMetrics]" = weakref.WeakKeyDictionary()
    _by_meter_lock = threading.Lock()

    @classmethod
    def for_meter(cls, meter: Meter) -> "PoolMetrics":
        """The one :class:`PoolMetrics` of ``meter`` (made at the first call)."""
        with cls._by_meter_lock:
            try:
                found = cls._by_meter.get(meter)
            except TypeError:  # a meter that cannot be weakly referenced: not shared
                return cls(meter)
            if found is None:
                found = cls(meter)
                cls._by_meter[meter] = found
            return found

    def __init__(self, meter: Meter) -> None:
        self._lock = threading.Lock()
        self._registrations: list[PoolRegistration] = []
        # the snapshot of the current collection: (attributes key, pool) -> summed PoolUsage
        self._snapshot: "dict[tuple, PoolUsage] | None" = None
        self._consumed: set[str] = set()
        for spec in POOL_INSTRUMENTS:
            meter.create_observable_gauge(
                name=spec.name, unit=spec.unit, description=spec.description, callbacks=[self._callback(spec)]
            )
        self._savings_sinks: "weakref.WeakSet[WindowSavingsSink]" = weakref.WeakSet()
        meter.create_observable_gauge(
            name=SAVINGS_INSTRUMENT.name, unit=SAVINGS_INSTRUMENT.unit, description=SAVINGS_INSTRUMENT.description,
            callbacks=[self._savings_callback],
        )

    # ------------------------------------------------------------------ pool usage
    def register(
        self,
        source: Callable[..., Any],
        *,
        owner: Any = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> PoolRegistration:
        """Read ``source`` at every collection.

        Args:
            source: with ``owner``: ``source(owner)``, else ``source()``; returns a sequence of
                :class:`~otel_swa.pool_usage.PoolUsage` (one per pool) or ``None``. Host work only.
            owner: the engine object the figures belong to, held by a weak reference: when it is
                garbage-collected the source is dropped (so ``source`` should not hold it).
            attributes: added to every point (bounded values: the process's ranks).

        Returns:
            The registration (:meth:`PoolRegistration.unregister` stops it).

        Raises:
            TypeError: ``source`` is not callable, or ``owner`` cannot be weakly referenced.
        """
        if not callable(source):
            raise TypeError(f"source must be callable, got {type(source).__name__}")
        registration = PoolRegistration(
            source, dict(attributes or {}), weakref.ref(owner) if owner is not None else None, self
        )
        with self._lock:
            self._registrations.append(registration)
        return registration

    @property
    def registrations(self) -> tuple[PoolRegistration, ...]:
        """The sources read at each collection (live owners only)."""
        with self._lock:
            return tuple(r for r in self._registrations if r.owner is None or r.owner() is not None)

    def _remove(self, registration: PoolRegistration) -> None:
        with self._lock:
            self._registrations = [r for r in self._registrations if r is not registration]

    def _take_snapshot(self) -> dict[tuple, PoolUsage]:
        """Read every source once; sum the pools of sources with the same attributes. Lock held."""
        live = [r for r in self._registrations if r.owner is None or r.owner() is not None]
        self._registrations = live
        summed: dict[tuple, PoolUsage] = {}
        for registration in live:
            usages = registration.read()
            if not usages:
                continue
            key = tuple(sorted(registration.attributes.items()))
            for usage in usages:
                before = summed.get((key, usage.pool))
                if before is not None:
                    usage = PoolUsage(usage.pool, before.used + usage.used, before.available + usage.available,
                                      before.evictable + usage.evictable, before.total + usage.total)
                summed[(key, usage.pool)] = usage
        return summed

    def _callback(self, spec: InstrumentSpec) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(options: CallbackOptions) -> Iterator[Observation]:
            with self._lock:
                # a gauge called twice since the last snapshot means a new collection began
                if self._snapshot is None or spec.name in self._consumed:
                    self._snapshot = self._take_snapshot()
                    self._consumed = set()
                self._consumed.add(spec.name)
                snapshot = self._snapshot
            observations = []
            for (key, pool), usage in snapshot.items():
                value = getattr(usage, spec.read)
                if value is not None:  # no ratio for an empty pool
                    observations.append(Observation(value, {**dict(key), sc.ATTR_POOL: pool}))
            return iter(observations)

        return callback

    # ------------------------------------------------------------------ what the window saves
    def savings_sink(self, bytes_per_token: int, attributes: Mapping[str, Any] | None = None) -> "WindowSavingsSink":
        """A reporter sink for ``kv_cache.swa.memory.saved`` (add it with ``reporter.add_sink``; it
        is held weakly here: it reports while its reporter keeps it).

        Args:
            bytes_per_token: KV bytes one token takes in all the sliding-window layers together
                (K and V), as the engine allocated them.
            attributes: added to every point (the process's ranks).

        Raises:
            ValueError: ``bytes_per_token`` is not an integer >= 1.
        """
        sink = WindowSavingsSink(bytes_per_token, attributes)
        with self._lock:
            self._savings_sinks.add(sink)
        return sink

    def _savings_callback(self, options: CallbackOptions) -> Iterator[Observation]:
        with self._lock:
            latest = [sink.latest for sink in list(self._savings_sinks)]
        summed: dict[tuple, tuple[int, Any]] = {}
        for entry in latest:
            if entry is None:  # no sample delivered yet: nothing measured
                continue
            key, value, context = entry
            before = summed.get(key)
            summed[key] = (value + before[0], context) if before is not None else (value, context)
        return iter([Observation(value, dict(key), context=context) for key, (value, context) in summed.items()])


class WindowSavingsSink:
    """Reporter sink keeping ``swa_out_of_window_tokens x bytes_per_token`` of the latest record,
    which :class:`PoolMetrics` reports as ``kv_cache.swa.memory.saved`` (bytes) at collection.

    Called as ``sink(record, context)`` by the reporter (see :mod:`otel_swa.telemetry.sink`); never
    raises (a record without a usable ``swa_out_of_window_tokens`` is logged once, counted in
    :attr:`errors` and leaves the latest value as it was).

    Attributes:
        bytes_per_token: KV bytes per token of the sliding-window layers.
        attributes: the points' attributes.
        latest: ``(attributes key, bytes, context)`` of the latest record, ``None`` before the first.

    Raises (from the constructor):
        ValueError: ``bytes_per_token`` is not an integer >= 1.
    """

    def __init__(self, bytes_per_token: int, attributes: Mapping[str, Any] | None = None) -> None:
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token < 1:
            raise ValueError(f"bytes_per_token={bytes_per_token!r}; expected an integer >= 1 (bytes)")
        self.bytes_per_token = bytes_per_token
        self.attributes = dict(attributes or {})
        self.errors = 0
        self.latest: "tuple[tuple, int, Context | None] | None" = None
        self._key = tuple(sorted(self.attributes.items()))

    def __call__(self, record: Any, context: Context | None = None) -> None:
        try:
            tokens = record.swa_out_of_window_tokens
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise ValueError(f"swa_out_of_window_tokens={tokens!r}; expected an integer >= 0")
            self.latest = (self._key, tokens * self.bytes_per_token, context)  # one assignment: atomic
        except Exception:
            self.errors += 1
            if self.errors == 1:
                _log.exception("kv_cache.swa.memory.saved not updated; later failures are only counted")


def pool_metrics(meter_provider: Any = None) -> PoolMetrics:
    """The :class:`PoolMetrics` of otel-swa's meter on ``meter_provider`` (default: the global one),
    the meter the other otel-swa instruments use (scope ``otel_swa``, the package version and
    :data:`~otel_swa.telemetry.semconv.SCHEMA_URL`)."""
    provider = meter_provider if meter_provider is not None else metrics_api.get_meter_provider()
    meter = provider.get_meter(sc.SCOPE_NAME, __version__, schema_url=sc.SCHEMA_URL)
    return PoolMetrics.for_meter(meter)
