"""Telemetry off the engine's thread: an attached sink's records go through a bounded FIFO queue to
one delivery thread; in order, nothing lost at flush/close, overflow counted and never waited for,
restartable after a fork."""

from __future__ import annotations

import threading

import pytest
import torch

from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.telemetry import SwaTelemetrySink
from otel_swa.telemetry import sink as sink_module
from otel_swa.views import SwaBatch

EMPTY = torch.zeros(0, dtype=torch.int64)
VIEW = SwaBatch(torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int64), EMPTY, EMPTY, ())


class GatedEvents:
    """Stands in for the sink's event emitters (``SampleEvents``): records which thread emitted
    which forward_ct, and can hold the delivery thread until the test opens the gate."""

    def __init__(self):
        self.emitted = []
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()

    def emit(self, record, context, extra=None):
        self.waiting.set()
        self.gate.wait(10)
        self.emitted.append((record.forward_ct, threading.current_thread().name))


def attached(pipeline, interval=1):
    events = GatedEvents()
    sink = SwaTelemetrySink(**pipeline.providers())
    sink.events = events
    reporter = sink.attach(SwaDivergenceReporter(interval))
    return reporter, sink, events


def test_records_are_delivered_in_order_on_the_delivery_thread_and_flush_delivers_the_rest(pipeline):
    reporter, sink, events = attached(pipeline)
    events.gate.clear()  # the thread takes the first record and waits at the gate
    for _ in range(50):
        reporter.step(VIEW)  # never waits for the gate: the engine's thread only queues
    assert reporter.stats.samples_delivered == 50  # handed off at the sampled step
    assert events.waiting.wait(10)
    events.gate.set()
    reporter.flush()  # delivers what is queued, after the record the thread holds
    assert [ct for ct, _ in events.emitted] == list(range(1, 51))
    assert events.emitted[0][1] == "otel-swa-telemetry"
    assert sink.records == 50 and sink.dropped == 0
    m = pipeline.metrics()
    assert [p.value for p in m["kv_cache.swa.forward_steps"]["points"]] == [50]


def test_a_full_queue_drops_and_counts_and_never_blocks_the_step(pipeline, monkeypatch, caplog):
    monkeypatch.setattr(sink_module._queue, "capacity", 5)
    reporter, sink, events = attached(pipeline)
    events.gate.clear()
    reporter.step(VIEW)
    assert events.waiting.wait(10)  # the thread is stalled inside the first record
    for _ in range(20):
        reporter.step(VIEW)  # 5 queued, 15 dropped, none waited for
    assert sink.dropped == 15
    assert "queue full" in caplog.text and caplog.text.count("queue full") == 1
    events.gate.set()
    reporter.close()
    assert [ct for ct, _ in events.emitted] == [1, 2, 3, 4, 5, 6]  # in order; the dropped ones never came
    m = pipeline.metrics()
    assert [p.value for p in m["kv_cache.swa.telemetry.records.dropped"]["points"]] == [15]


def test_after_a_fork_the_queue_is_the_childs_and_a_new_thread_delivers(pipeline):
    reporter, sink, events = attached(pipeline)
    events.gate.clear()
    reporter.step(VIEW)
    assert events.waiting.wait(10)
    reporter.step(VIEW)  # queued behind the stalled thread: the parent's record
    # in the child of a fork the parent's thread does not exist (its locks may be held)
    reporter.reset_after_fork()
    assert len(sink_module._queue) == 0
    child_events = GatedEvents()
    sink.events = child_events
    for _ in range(3):
        reporter.step(VIEW)
    reporter.flush()
    assert [ct for ct, _ in child_events.emitted] == [1, 2, 3]  # the child's own count
    events.gate.set()


def test_a_put_in_another_process_resets_the_queue_by_itself(pipeline, monkeypatch):
    reporter, sink, events = attached(pipeline)
    reporter.step(VIEW)
    reporter.flush()
    monkeypatch.setattr(sink_module._queue, "_pid", -1)  # as if this process were a forked child
    old_thread = sink_module._queue._thread
    reporter.step(VIEW)
    reporter.flush()
    assert sink_module._queue._pid != -1 and sink_module._queue._thread is not old_thread
    assert [ct for ct, _ in events.emitted] == [1, 2]


def test_calling_the_sink_delivers_on_the_calling_thread(pipeline):
    events = GatedEvents()
    sink = SwaTelemetrySink(**pipeline.providers())
    sink.events = events
    from otel_swa.record import SwaDivergenceRecord

    sink(SwaDivergenceRecord(20, 1, 1, 0, 0), None)
    assert events.emitted == [(20, threading.current_thread().name)]


@pytest.mark.parametrize("closing", ["flush", "close"])
def test_the_line_is_complete_and_in_order_after_flush_or_close(closing):
    """Through the whole pipeline: configure() with the swa_logline exporter, a delivery thread in
    between; after flush()/close() every sampled line has been written, in order."""
    import io

    from otel_swa.telemetry import configure

    stream = io.StringIO()
    from otel_swa.telemetry.logline import SwaLogLineExporter
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    tel = configure(exporters="none", use_global=False, set_global=False, environ={},
                    log_record_processors=[SimpleLogRecordProcessor(SwaLogLineExporter(stream))])
    reporter = tel.attach(SwaDivergenceReporter(3))
    for _ in range(300):
        reporter.step(VIEW)
    getattr(reporter, closing)()
    from otel_swa.record import find_all

    assert [record.forward_ct for record in find_all(stream.getvalue())] == list(range(3, 301, 3))
    tel.shutdown()
