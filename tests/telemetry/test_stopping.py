"""``otel_swa.telemetry.stopping.shutdown_providers``: the bound, and the cut (Ctrl-C).

The providers here stand in for SDK providers whose shutdown waits on an OTLP exporter retrying a
dead collector: their ``shutdown`` returns only once the exporter's own ``shutdown`` was called (as
the OTLP exporters' retry loop, opentelemetry-exporter-otlp 1.45, ends when ``shutdown`` sets its
event), or never. No verdict depends on how long anything took.
"""

import threading
import time

from otel_swa.telemetry import stopping


class RetryingExporter:
    def __init__(self, signal):
        self.signal = signal
        self.shut_down = threading.Event()

    def shutdown(self):
        self.shut_down.set()


class ProviderWaitingOnItsExporter:
    def __init__(self, exporter):
        self.exporter = exporter
        self.finished = threading.Event()

    def shutdown(self):
        self.exporter.shut_down.wait(600)
        self.finished.set()


class QuickProvider:
    def __init__(self):
        self.finished = threading.Event()

    def shutdown(self):
        self.finished.set()


def test_a_cut_shuts_the_busy_exporters_down_and_names_their_signals():
    busy = RetryingExporter("traces")
    idle = RetryingExporter("logs")
    providers = {"logs": QuickProvider(), "traces": ProviderWaitingOnItsExporter(busy)}
    cut = threading.Event()
    cut.set()  # Ctrl-C came before the stop: the providers get CUT_GRACE_S, not the 600 s deadline
    late, cut_short = stopping.shutdown_providers(providers, time.monotonic() + 600, cut, [busy, idle])
    assert (late, cut_short) == (["traces"], ["traces"])
    assert busy.shut_down.is_set() and not idle.shut_down.is_set()  # only the busy one is aborted
    assert providers["traces"].finished.wait(60)  # its retry loop ended: the provider's shutdown returns


def test_without_a_cut_a_provider_past_the_deadline_is_left_and_its_exporter_kept():
    busy = RetryingExporter("metrics")
    providers = {"metrics": ProviderWaitingOnItsExporter(busy)}
    late, cut_short = stopping.shutdown_providers(providers, time.monotonic(), threading.Event(), [busy])
    assert (late, cut_short) == (["metrics"], [])
    assert not busy.shut_down.is_set()
    busy.shutdown()  # let the daemon thread go


def test_providers_that_finish_are_neither_late_nor_cut():
    providers = {"logs": QuickProvider(), "traces": QuickProvider()}
    cut = threading.Event()
    cut.set()
    assert stopping.shutdown_providers(providers, time.monotonic() + 600, cut) == ([], [])
    assert all(p.finished.is_set() for p in providers.values())
