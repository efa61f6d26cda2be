"""Process life: delivering and exporting what otel-swa holds when a process ends or an engine shuts
down.

One module owns these hooks so that their order is right everywhere:

* **interpreter exit** (``atexit``): every tracked reporter is flushed (its pending samples reach
  its sinks) *before* the OpenTelemetry SDK's own exit hooks shut the providers down. The SDK
  registers ``provider.shutdown`` with ``atexit`` when a provider is built; ``atexit`` runs hooks
  last-in first-out, so :func:`track` (re-)registers otel-swa's hook after every provider it is
  told about, which makes it run first; callbacks given to :func:`after_exit_flush` run right
  after that flush (SGLang's scheduler answering a flush request of its main process);
* **SIGTERM** (what supervisors, ``kill`` and container runtimes send): Python's default action
  ends the process without running exit hooks, so neither otel-swa's nor the SDK's would run.
  When the first reporter is tracked, in the main thread, and SIGTERM still has its default action
  (an engine or application that installed its own handler keeps it), a handler is installed that
  runs :func:`flush_all` for at most the OTLP timeout less half a second
  (:func:`sigterm_flush_timeout_s`) and then lets SIGTERM end the process as before (same exit
  status), so a process told to stop ends within the OTLP timeout even with the collector down.
  ``OTEL_SWA_SIGTERM_FLUSH=0`` leaves SIGTERM alone;
* **an engine's shutdown** (:func:`flush_all`, called by the instrumentors where the engine has a
  shutdown path: SGLang's ``Engine.shutdown`` kills its scheduler processes with SIGKILL, which
  runs no exit hook, so the instrumentor asks each scheduler to flush first): reporters are
  flushed, then the tracked providers' ``force_flush`` export their buffers side by side, the
  whole within the OTLP timeout (:func:`otel_swa.config.otlp_timeout_s`).

* **a teardown after the signals' default action is back** (:func:`flush_holding_signals`, called by
  the vLLM instrumentor before the engine core's teardown): the same flush with SIGTERM and SIGINT
  held until it returns;

* **fork** (``os.register_at_fork``): a forked child inherits the parent's reporters and SDK
  providers, their counts and buffers. In the child every tracked reporter is reset (its totals,
  forward count and pending samples are the parent's: see ``SwaDivergenceReporter.reset_after_fork``)
  and the exporters :func:`otel_swa.telemetry.configure` built export nothing (they would send the
  parent's numbers again and, for OTLP over gRPC, flood the log once the child closes the parent's
  file descriptors). A child that should export calls ``configure()`` itself; a spawned child (a new
  interpreter, what SGLang and vLLM's multiprocessing use by default) starts clean anyway.

* **liveness at the end** (:func:`expect_forward_steps`, called by the instrumentors for each
  reporter they make, with the engine method that steps it): at interpreter exit, on SIGTERM and
  in :func:`flush_all` (an engine's shutdown), before the flush, each such reporter that delivered
  no sample in its life gives its liveness warning (``SwaDivergenceReporter.liveness_warning``:
  "instrumented, 0 samples in N steps", cause ``no_forward_step`` when the engine's hook never
  stepped it): an instrumented engine whose forward steps never reached otel-swa is said in its
  log, as an event and in ``kv_cache.swa.reporter.liveness.warnings``, not silent;
* **other objects a forked child must not use as they are** (:func:`reset_in_child`, e.g. an OTLP
  exporter's connection pool, whose sockets belong to the parent: closing them in a child that
  closed its descriptors fails with ``Bad file descriptor``, or closes a descriptor the child
  opened since under the same number): their ``reset_after_fork()`` runs in the child.

What a SIGKILL without either still loses: nothing the reporter delivered on CPU (a record reaches
the sinks at the step it was sampled), but what the SDK's batching processors had not exported
yet: up to one schedule delay of events and spans (``OTEL_BLRP_SCHEDULE_DELAY``, default 1 s;
``OTEL_BSP_SCHEDULE_DELAY``, default 5 s) and the metric points since the last periodic export
(``OTEL_METRIC_EXPORT_INTERVAL``, default 60 s, or otel-swa's ``OTEL_SWA_METRIC_EXPORT_INTERVAL``,
5 s, while an engine instrumentor's reporter lives: :mod:`otel_swa.telemetry.export_schedule`); a
log line written through the OpenTelemetry logs pipeline (the ``swa_logline`` exporter behind a
batching processor) is in the first group.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["track", "flush_all", "FlushResult", "expect_forward_steps", "check_liveness",
           "reset_in_child", "sigterm_flush_timeout_s", "after_exit_flush", "flush_holding_signals"]

_log = logging.getLogger(__name__)

_lock = threading.Lock()
_reporters: "weakref.WeakSet[Any]" = weakref.WeakSet()
_providers: list["weakref.ref[Any]"] = []
_sigterm_installed = False
_expected: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()  # reporter -> its hook
_in_child: "weakref.WeakSet[Any]" = weakref.WeakSet()  # objects reset in a forked child


@dataclass(frozen=True)
class FlushResult:
    """What :func:`flush_all` did.

    Attributes:
        reporters: reporters flushed.
        providers: providers whose ``force_flush`` returned in time and reported success.
        failed: providers whose ``force_flush`` raised, returned False or ran out of time.
        seconds: time taken.
    """

    reporters: int
    providers: int
    failed: int
    seconds: float


def _after_fork_in_child() -> None:
    # the parent's lock may have been held by another thread at the fork: this child owns a new one
    global _lock
    _lock = threading.Lock()
    for reporter in list(_reporters):
        reset = getattr(reporter, "reset_after_fork", None)
        if reset is None:
            continue
        try:
            reset()
        except Exception:
            _log.exception("resetting an SWA divergence reporter in a forked child failed")
    for item in list(_in_child):
        try:
            item.reset_after_fork()
        except Exception:
            _log.exception("resetting %s in a forked child failed", type(item).__name__)


def reset_in_child(item: Any) -> None:
    """Call ``item.reset_after_fork()`` in every process forked from this one (``item`` is held by
    a weak reference)."""
    with _lock:
        _in_child.add(item)


def expect_forward_steps(reporter: Any, hook: str) -> None:
    """Expect the engine to step ``reporter`` from ``hook`` (the engine method an instrumentor
    wrapped, e.g. ``"SGLang ModelRunner.forward"``): at the end of the process (exit, SIGTERM,
    :func:`flush_all`) a reporter that delivered no sample gives its liveness warning, naming
    ``hook`` when no forward step reached it. ``reporter`` is held by a weak reference."""
    with _lock:
        _expected[reporter] = hook
    expect = getattr(reporter, "expect_steps_from", None)
    if callable(expect):
        expect(hook)  # and when it is closed (an engine's shutdown, its garbage collection)


def check_liveness() -> int:
    """Give the liveness warning of every expected reporter (:func:`expect_forward_steps`) that
    delivered no sample in its life (once each); return how many warned. Never raises."""
    with _lock:
        expected = list(_expected.items())
    warned = 0
    for reporter, hook in expected:
        try:
            if reporter.liveness_warning(final=True, hook=hook) is not None:
                warned += 1
        except Exception:
            _log.exception("the liveness check of an SWA divergence reporter failed")
    return warned


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _on_sigterm(signum: int, frame: Any) -> None:
    try:
        flush_all(sigterm_flush_timeout_s())
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_flush() -> None:
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed = True
    from otel_swa import config

    try:
        if not config.sigterm_flush():
            return
    except config.ConfigError:
        _log.exception("SIGTERM is left alone")
        return
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        pass


def _at_exit() -> None:
    flush_all(export=False)  # the SDK's own exit hooks, which run next, export and shut down
    _run_after_exit_flush()


_after_exit_flush: list = []


def after_exit_flush(callback: Any) -> None:
    """Run ``callback()`` at interpreter exit right after otel-swa's own flush of the tracked
    reporters, before the SDK's providers shut down (an instrumentor that must tell another process
    its flush is done: SGLang's scheduler answering a pending flush request). Each callback once, in
    registration order; one that raises is logged."""
    with _lock:
        if callback not in _after_exit_flush:
            _after_exit_flush.append(callback)
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)


def _run_after_exit_flush() -> None:
    for callback in list(_after_exit_flush):
        try:
            callback()
        except Exception:
            _log.exception("an otel-swa exit callback failed")


def track(reporter: Any = None, providers: Iterable[Any] = ()) -> None:
    """Flush ``reporter`` at interpreter exit and in :func:`flush_all`, and force-flush
    ``providers`` (OpenTelemetry SDK tracer / meter / logger providers; anything with
    ``force_flush``) in :func:`flush_all`. Both are held by weak references. Call it after the
    providers exist: it moves otel-swa's exit hook after theirs, so that it runs before they shut
    down."""
    with _lock:
        if reporter is not None:
            _reporters.add(reporter)
        known = [ref() for ref in _providers]
        for provider in providers:
            if provider is not None and hasattr(provider, "force_flush") and not any(p is provider for p in known):
                try:
                    _providers.append(weakref.ref(provider))
                except TypeError:  # not weakly referenceable: not ours to keep alive
                    continue
                known.append(provider)
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)
    _install_sigterm_flush()


def flush_all(timeout_s: "float | None" = None, *, export: bool = True) -> FlushResult:
    """Flush every tracked reporter, then (``export``) force-flush every tracked provider, the whole
    within about ``timeout_s`` seconds (default: the OTLP exporters' timeout,
    :func:`otel_swa.config.otlp_timeout_s`). First, the reporters an instrumentor expects to be
    stepped that delivered no sample give their liveness warning (:func:`check_liveness`): this is
    the end of the process (exit, SIGTERM, an engine's shutdown). Never raises.

    The providers are flushed side by side (:func:`_force_flush_within`): the SDK's ``force_flush``
    exports in the calling thread and does not stop at its ``timeout_millis``, so a collector that is
    down would otherwise hold each provider for a whole export timeout, one after the other."""
    start = time.monotonic()
    if timeout_s is None:
        timeout_s = _otlp_timeout_s()
    check_liveness()
    with _lock:
        reporters = list(_reporters)
        providers = [p for p in (ref() for ref in _providers) if p is not None]
    for reporter in reporters:
        try:
            reporter.flush()
        except Exception:
            _log.exception("flushing an SWA divergence reporter failed")
    flushed = failed = 0
    if export:
        flushed, failed = _force_flush_within(providers, start + timeout_s)
    return FlushResult(len(reporters), flushed, failed, round(time.monotonic() - start, 3))


def _otlp_timeout_s() -> float:
    from otel_swa import config

    return config.otlp_timeout_s()


#: What a SIGTERM flush leaves of the OTLP timeout for the process to end (seconds).
SIGTERM_EXIT_MARGIN_S = 0.5


def flush_holding_signals(timeout_s: "float | None" = None) -> FlushResult:
    """:func:`flush_all` (default timeout :func:`sigterm_flush_timeout_s`) with SIGTERM and SIGINT
    held until it returns, then each signal that arrived meanwhile delivered again, once, to the
    action that was in place before (the process ends as it would have, after its samples are out).

    For a process that tears down after it has given those signals their default action back:
    vLLM's engine core restores ``SIG_DFL`` when it leaves its busy loop, then tears its executor
    down while the API server, stopped by the same Ctrl-C, sends it SIGTERM
    (``vllm.v1.utils.shutdown``); a SIGTERM in that teardown ended the process before the exit
    hooks, and the last samples were lost. Outside the main thread (no signal handler can be set
    there) it is :func:`flush_all`. Never raises."""
    if timeout_s is None:
        timeout_s = sigterm_flush_timeout_s()
    if threading.current_thread() is not threading.main_thread():
        return flush_all(timeout_s)
    arrived: list = []
    previous: dict = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[signum] = signal.signal(signum, lambda number, frame: arrived.append(number))
        except (ValueError, OSError):  # no signals in this interpreter
            pass
    try:
        return flush_all(timeout_s)
    finally:
        for signum, action in previous.items():
            try:  # an action set outside Python reads as None: the default one stands for it
                signal.signal(signum, signal.SIG_DFL if action is None else action)
            except (ValueError, OSError):
                pass
        for signum in dict.fromkeys(arrived):
            os.kill(os.getpid(), signum)


def sigterm_flush_timeout_s() -> float:
    """How long the SIGTERM handler flushes: the OTLP timeout less :data:`SIGTERM_EXIT_MARGIN_S`
    (at least a tenth of it), so that a process told to stop ends within the OTLP timeout even when
    the collector is down."""
    timeout = _otlp_timeout_s()
    return max(timeout - SIGTERM_EXIT_MARGIN_S, timeout / 10)


def _force_flush_within(providers: list, deadline: float) -> tuple[int, int]:
    """``force_flush`` every provider, each in a daemon thread of its own, and wait for them until
    ``deadline`` (``time.monotonic()``); returns ``(flushed, failed)``, a provider still exporting at
    the deadline counting as failed (it goes on in the background and ends with the process)."""
    if not providers:
        return 0, 0
    outcome: dict[int, bool] = {}

    def flush(index: int, provider: Any) -> None:
        left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        try:
            outcome[index] = provider.force_flush(left_ms) is not False if left_ms > 0 else False
        except Exception:
            _log.exception("force_flush of %s failed", type(provider).__name__)
            outcome[index] = False

    threads = [threading.Thread(target=flush, args=(i, p), name=f"otel-swa-flush-{i}", daemon=True)
               for i, p in enumerate(providers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    flushed = sum(1 for i in range(len(providers)) if outcome.get(i) is True)
    return flushed, len(providers) - flushed
