"""The write check on vLLM's KV cache: where it is hooked in the model runner, and how it reaches the
scheduler's reporter.

``GPUModelRunner.initialize_kv_cache(self, kv_cache_config, ...)`` (V1 ``vllm/v1/worker/
gpu_model_runner.py`` line 6990, V2 ``vllm/v1/worker/gpu/model_runner.py`` line 623; both runners
allocate the KV cache there, and vLLM's worker calls it before ``compile_or_warm_up_model``
captures the CUDA graphs, ``vllm/v1/worker/gpu_worker.py`` lines 907, 994) is wrapped: after it
returns, where the runner may be checked (:func:`off_reason`: a CUDA device or the CPU (vLLM's
``CPUModelRunner``, ``vllm/v1/worker/cpu_model_runner.py``, whose ``initialize_kv_cache`` calls
this one), the uni-process
executor, world size 1, ``OTEL_SWA_PROVENANCE`` not ``off``), the runner gets a
:class:`RunnerWriteCheck` (a :class:`~otel_swa.device.write_check.WriteCheck` and its
:class:`~otel_swa.device.gate.SamplingGate` on the runner's device, ``layers="rotate"``), each
attention layer of a sliding-window or full KV cache group whose implementation is understood
(:data:`otel_swa.views.vllm_write.SUPPORTED_IMPLS`) carries its :class:`~otel_swa.views.vllm_write.
WriteLayer`, and the implementation classes' ``do_kv_cache_update`` are wrapped (restored by
``uninstrument()``): the original store first, then, for a layer that carries a ``WriteLayer``, at a
sampled step or inside a capture, the check of what it was given against what the cache now holds.
An exception in that part is logged once per runner and never reaches the store.

The reporter is the scheduler's, made at its first ``schedule()`` (after the runner: vLLM's
``EngineCore`` builds the executor, then the KV cache, then the ``Scheduler``). The process keeps a
small registry (:data:`REGISTRY`): when it holds exactly one live reporter and one runner's check,
the check is attached to that reporter (:meth:`~otel_swa.reporter.SwaDivergenceReporter.
attach_write_check`); with several of either, or none, nothing is attached and that is logged
once. The ``execute_model`` wrapper calls the paired reporter's ``before_forward()`` before each
forward (the sampling flag on the device, capture-safe) and, after a sampled forward, keeps the
batch's request ids for the offender.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

_log = logging.getLogger("opentelemetry.instrumentation.swa_vllm")

__all__ = ["MORE_WRAPPED", "RUNNER_ATTRIBUTE", "LAYER_ATTRIBUTE", "WIRED_DEVICE_TYPES", "REGISTRY", "RunnerWriteCheck",
           "off_reason", "wire_runner", "wrap_once"]

#: The model runners' ``initialize_kv_cache`` (module, class, method, parameters relied on), vLLM 0.33.
MORE_WRAPPED = (
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "initialize_kv_cache", ("kv_cache_config",)),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "initialize_kv_cache", ("kv_cache_config",)),
)
#: Attribute of a model runner holding its :class:`RunnerWriteCheck`.
RUNNER_ATTRIBUTE = "_otel_swa_write_check"
#: Attribute of an ``Attention`` module holding ``(RunnerWriteCheck, WriteLayer)``.
LAYER_ATTRIBUTE = "_otel_swa_write_layer"
#: Device types where the check is wired: the GPU the runner uses, and the CPU of vLLM's CPU model
#: runner (``vllm/v1/worker/cpu_model_runner.py``, a ``GPUModelRunner`` subclass whose
#: ``initialize_kv_cache`` calls this one, with the CPU_ATTN backend).
WIRED_DEVICE_TYPES = ("cuda", "cpu")


def _once(key: str, level: int, message: str, *args: Any) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        _log.log(level, message, *args)


_LOGGED: "set[str]" = set()


def off_reason(runner: Any) -> "str | None":
    """Why the write check is not wired for ``runner``, or ``None`` when it is (module docstring)."""
    from otel_swa import config

    device = getattr(runner, "device", None)
    device_type = getattr(device, "type", str(device).split(":")[0])
    if device_type not in WIRED_DEVICE_TYPES:
        return f"the model runner's device is {device}, not CUDA or the CPU"
    parallel = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend != "uni":
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
        return (f"the executor is {name!r}, not 'uni': the model runner may run in a process of its own, apart "
                "from the scheduler's reporter")
    world = getattr(parallel, "world_size", 1)
    if world != 1:
        return f"the world size is {world} (tensor or pipeline parallel)"
    if config.provenance() is None:
        return "OTEL_SWA_PROVENANCE is off"
    return None


class RunnerWriteCheck:
    """One model runner's write check (module docstring).

    Args:
        device: the runner's device.
        layers: the :class:`~otel_swa.views.vllm_write.WriteLayer` list.
        positions: the runner's positions buffer (``int64 [max_num_tokens]``) or ``None``.
        graph_mode: :data:`otel_swa.device.gate.GRAPH_MODES`.
    """

    def __init__(self, device: Any, layers: list, positions: Any, graph_mode: str) -> None:
        from otel_swa.device.gate import SamplingGate
        from otel_swa.device.write_check import WriteCheck

        self.gate = SamplingGate(device, graph_mode=graph_mode)
        self.check = WriteCheck(device, self.gate, layers="rotate")
        self.layers = layers
        self.positions = positions
        #: ``layer_id -> (layer name, KV cache group, rows known)`` for the offender.
        self.layer_names = {w.layer_id: (w.name, w.group, w.rows) for w in layers}
        self.reporter: Any = None  # set when paired
        self.runner: "weakref.ref | None" = None  # set by the registry
        self.request_ids: "list[str] | None" = None  # of the last sampled forward
        #: the runner's :class:`~opentelemetry.instrumentation.swa_vllm.provenance.RunnerProvenance`, or None
        self.provenance: Any = None
        #: the read check of the sliding-window layers (:mod:`.read_check`), or ``None``
        self.read: Any = None
        self.failures = 0

    def before_forward(self, scheduler_output: Any = None) -> None:
        """Before each forward (the ``execute_model`` wrapper): the paired reporter's sampling
        decision onto this check's gate (:meth:`~otel_swa.reporter.SwaDivergenceReporter.
        before_forward`), and to provenance the step's batch (:meth:`~opentelemetry.instrumentation.
        swa_vllm.provenance.RunnerProvenance.before_forward`). Never raises (a failure is logged once)."""
        if self.provenance is not None:
            self.provenance.before_forward(scheduler_output)
        reporter = self.reporter
        if reporter is not None:
            try:
                reporter.before_forward()
            except Exception:
                self.failed("the sampling flag was not set")

    def after_forward(self, runner: Any) -> None:
        """After a forward: at a sampled one, the batch's request ids (for the offender). Never
        raises (a failure is logged once)."""
        if self.gate.due:
            try:
                from otel_swa.views.vllm_write import runner_request_ids

                self.request_ids = runner_request_ids(runner)
            except Exception:
                self.request_ids = None
                self.failed("the batch's request ids were not read")

    def failed(self, what: str) -> None:
        """Log the first failure of this runner's part with its traceback; count the others."""
        self.failures += 1
        if self.failures == 1:
            _log.exception("otel-swa: vLLM's KV cache write check: %s; later failures are not logged", what)

    def after_store(self, write_layer: Any, impl: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        check = self.check
        checked = self.gate.wanted() and check.wants(write_layer.layer_id, write_layer.swa)
        if not checked and self.provenance is None:
            return
        from otel_swa.views.vllm_write import layer_store

        store = layer_store(write_layer, impl, key, value, kv_cache, slot_mapping, positions=self.positions)
        if self.provenance is not None:
            self.provenance.after_store(write_layer, store, slot_mapping)
        if checked:
            check.check_layer(store)


class _Registry:
    """This process's scheduler reporters and model runners' write checks (module docstring)."""

    def __init__(self) -> None:
        self._reporters: "list[weakref.ref]" = []
        self._checks: "list[weakref.ref]" = []

    def _live(self, refs: "list[weakref.ref]") -> list:
        alive = [r() for r in refs]
        refs[:] = [r for r, o in zip(refs, alive) if o is not None and not getattr(o, "closed", False)]
        return [r() for r in refs]

    def add_reporter(self, reporter: Any) -> None:
        self._reporters.append(weakref.ref(reporter))
        self._pair()

    def add_check(self, wired: RunnerWriteCheck, runner: Any) -> None:
        """Register a runner's check; one the same runner had before (a KV cache initialized
        again) is dropped, and a reporter paired with it is given the new one."""
        kept = []
        for ref in self._checks:
            old = ref()
            if old is not None and old.runner is not None and old.runner() is runner:
                old.reporter = None
                continue
            kept.append(ref)
        wired.runner = weakref.ref(runner)
        self._checks = kept + [weakref.ref(wired)]
        self._pair()

    def clear(self) -> None:
        for wired in self._live(self._checks):
            wired.reporter = None
        self._reporters, self._checks = [], []

    def _pair(self) -> None:
        reporters, checks = self._live(self._reporters), self._live(self._checks)
        if not reporters:
            return  # the scheduler comes after the runner: paired then
        if len(reporters) == 1 and len(checks) == 1:
            wired, reporter = checks[0], reporters[0]
            if wired.reporter is not reporter:
                reporter.attach_write_check(wired.check, batch=lambda: wired.request_ids, layers=wired.layer_names)
                if wired.provenance is not None:
                    reporter.attach_provenance(wired.provenance.provenance)
                if wired.read is not None:
                    reporter.attach_read_check(wired.read, batch=lambda: wired.request_ids, layers=wired.layer_names)
                wired.reporter = reporter
                _log.info("otel-swa: vLLM's KV cache write check is wired (%d layers)%s", len(wired.layers),
                          "" if wired.read is None else ", and the read check of its sliding-window layers")
            return
        for wired in checks:
            wired.reporter = None
        if not checks:
            _once("no-check", logging.INFO, "otel-swa: vLLM's KV cache write check is not wired in this process: no "
                  "model runner here has one (it needs the uni-process executor, world size 1 and CUDA or the CPU; the "
                  "runner's process logs why); the records' kv_write_* fields stay empty")
        else:
            _once("several", logging.WARNING, "otel-swa: vLLM's KV cache write check is not wired: %d scheduler "
                  "reporters and %d model runners in this process, the pairing is ambiguous; the records' "
                  "kv_write_* fields stay empty", len(reporters), len(checks))


#: The registry of this process.
REGISTRY = _Registry()


def _wrap_store(original: Callable) -> Callable:
    """The wrapper of an implementation's ``do_kv_cache_update`` (module docstring)."""

    @functools.wraps(original)
    def do_kv_cache_update(impl, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        result = original(impl, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)
        carried = getattr(layer, "__dict__", {}).get(LAYER_ATTRIBUTE)
        if carried is not None:
            wired, write_layer = carried
            try:
                wired.after_store(write_layer, impl, key, value, kv_cache, slot_mapping)
            except Exception:  # otel-swa's part never breaks the store
                wired.failed(f"the check failed at layer {write_layer.name}")
        return result

    do_kv_cache_update._otel_swa_store = True
    return do_kv_cache_update


def wrap_once(cls: type, name: str, wrap: Callable[[Callable], Callable], marker: str, originals: dict) -> None:
    """Replace method ``name`` of an implementation class by ``wrap(method)`` unless ``originals``
    (the instrumentor's table of what ``uninstrument()`` restores) has it already; a method the
    class inherits is wrapped on the class itself (recorded as absent: removed again), and one
    inherited from a class wrapped already (its wrapper carries ``marker``) is wrapped around its
    original, never twice."""
    if (cls, name) in originals:
        return
    from otel_swa.engine_wrapping import _ABSENT

    own = cls.__dict__.get(name)
    function = own if own is not None else getattr(cls, name)
    if getattr(function, marker, False):
        function = function.__wrapped__
    setattr(cls, name, wrap(function))
    originals[(cls, name)] = _ABSENT if own is None else own


def wire_runner(runner: Any, kv_cache_config: Any, originals: dict) -> "RunnerWriteCheck | None":
    """Give ``runner`` its write check after ``initialize_kv_cache`` (module docstring), wrap the
    ``do_kv_cache_update`` of its layers' implementation classes once (``originals``: the
    instrumentor's table of what ``uninstrument()`` restores), and register it. Returns the
    runner's check, or ``None`` where it is not wired (logged once per reason)."""
    from otel_swa import config
    from otel_swa.views.vllm_write import runner_positions, write_layers

    runner.__dict__.pop(RUNNER_ATTRIBUTE, None)
    reason = off_reason(runner)
    if reason is not None:
        _once("off:" + reason, logging.INFO, "otel-swa: vLLM's KV cache write check is not wired: %s", reason)
        return None
    config_now = getattr(runner, "kv_cache_config", None) or kv_cache_config
    forward_context = runner.vllm_config.compilation_config.static_forward_context
    layers, left_out = write_layers(config_now, forward_context)
    if left_out:
        _once("left-out", logging.INFO, "otel-swa: vLLM's KV cache write check leaves out %d layers whose attention "
              "backend stores otherwise (first: %s)", len(left_out), left_out[0])
    if not layers:
        _once("no-layers", logging.INFO, "otel-swa: vLLM's KV cache write check is not wired: no attention layer "
              "of a sliding-window or full KV cache group runs a supported backend")
        return None
    wired = RunnerWriteCheck(runner.device, layers, runner_positions(runner), config.graph_checks())
    try:
        from opentelemetry.instrumentation.swa_vllm.provenance import runner_provenance

        wired.provenance = runner_provenance(runner, config_now, layers, wired.gate, left_out)
    except Exception:
        _log.exception("otel-swa: vLLM's KV provenance was not wired")
    for write_layer in layers:
        write_layer.layer.__dict__[LAYER_ATTRIBUTE] = (wired, write_layer)
        wrap_once(type(write_layer.layer.impl), "do_kv_cache_update", _wrap_store, "_otel_swa_store", originals)
    try:
        from .read_check import wire_read_check

        wire_read_check(wired, originals)
    except Exception:
        wired.read = None
        _log.exception("otel-swa: vLLM's read check was not wired")
    runner.__dict__[RUNNER_ATTRIBUTE] = wired
    REGISTRY.add_check(wired, runner)
    return wired


def wrap_initialize_kv_cache(originals: dict) -> Callable[[Callable], Callable]:
    """The wrapper factory for ``GPUModelRunner.initialize_kv_cache`` (module docstring)."""

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def initialize_kv_cache(runner, kv_cache_config, *args, **kwargs):
            result = original(runner, kv_cache_config, *args, **kwargs)
            try:
                wire_runner(runner, kv_cache_config, originals)
            except Exception:
                _log.exception("otel-swa: vLLM's KV cache write check was not wired")
            return result

        return initialize_kv_cache

    return wrap
