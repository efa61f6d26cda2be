"""The event of a delivered sample, tied to the forward step where the sample was taken.

For every record two events of the same name, :data:`~otel_swa.telemetry.semconv.EVENT_NAME`
(``kv_cache.swa.divergence_sample``), carry the five record fields as attributes
(``kv_cache.swa.forward_ct`` ... ``kv_cache.swa.swa_out_of_window_tokens``, Python ints):

* a Logs API event (``Logger.emit(event_name=..., context=...)``, OTEP 4430, the form OpenTelemetry
  is moving span events to). Its trace and span ids are those of the ``context`` handed to the
  sink, the forward step where the sample was taken, not the step where the copy finished. Its
  timestamp is the time of emission (``time.time_ns()``, ns since the Unix epoch, when the record
  is delivered), so backends order the events; the forward step's span gives the sampling time.
  Its body is otel-swa's line (``record.line()``: the SGLang line body after the
  ``otel_swa[verify=...]`` tag), so any log backend shows the familiar text. The API record
  emitted is a :class:`SampleLogRecord`, which also carries the record itself for otel-swa's line
  exporter (no other exporter sees a difference);
* a span event. The copy to the host lands one or more steps later, when the forward-step span
  has normally ended and can no longer take events. The event then goes on a short child span of
  the forward step, named ``swa divergence sample`` (kind INTERNAL, attribute
  ``kv_cache.swa.forward_ct``), so a trace backend shows the sample under the right forward step.
  When the forward-step span is still recording, the event is added to it directly.
  When the context holds no valid span there is no trace to attach to and no span event is made.

A record whose sample shows faults also carries their first offenders (:class:`otel_swa.record.Offender`):
as the sample event's attribute ``kv_cache.swa.offenders`` (one compact JSON object each, so the
event gives the record back whole), and as one more event per offender, of the same two forms, named
:data:`~otel_swa.telemetry.semconv.FAULT_EVENT_NAME` (``kv_cache.swa.fault``), with attributes
``kv_cache.swa.forward_ct``, ``kv_cache.swa.fault.kind`` (the fault field) and
``kv_cache.swa.fault.<location>`` for each location known (request, row, position, FULL and SWA
slot, page, layer, block...; a provenance fault's pool, ``expected_token``, ``expected_position``,
``found_token``, ``found_position`` and ``other_request``), severity WARN, body the fault line.
The sample event also carries every check field present (``kv_cache.swa.<field>``),
so the ``swa_logline`` exporter writes the record's provenance line from it.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry._logs import LogRecord, Logger, SeverityNumber
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer

from otel_swa.record import FIELDS, LivenessWarning, Offender, SwaDivergenceRecord
from otel_swa.telemetry import semconv as sc
from otel_swa.telemetry.spans import use_system_random_ids

__all__ = ["record_attributes", "record_from_attributes", "offender_attributes", "liveness_attributes",
           "liveness_from_attributes", "SampleEvents", "SampleLogRecord"]


def record_attributes(record: SwaDivergenceRecord) -> dict[str, int | bool | str]:
    """The event attributes of ``record``: ``{"kv_cache.swa.<field>": value}`` in SGLang's order,
    then the SWA slot audit fields and the provenance fields when present,
    ``kv_cache.swa.divergence_applicable=False``
    for engines without a FULL-to-SWA mapping, ``kv_cache.swa.verify_source`` and
    ``kv_cache.swa.micro_batch`` when known."""
    attributes: dict[str, int | bool] = {sc.RECORD_ATTRIBUTES[name]: getattr(record, name) for name in FIELDS}
    for name, value in record.audit_dict().items():
        attributes[sc.AUDIT_ATTRIBUTES[name]] = value
    for name, value in record.provenance_dict().items():
        attributes[sc.PROVENANCE_ATTRIBUTES[name]] = value
    if not record.divergence_applicable:
        attributes[sc.ATTR_DIVERGENCE_APPLICABLE] = False
    if record.verify_source is not None:
        attributes[sc.ATTR_VERIFY_SOURCE] = record.verify_source
    if record.micro_batch is not None:
        attributes[sc.ATTR_MICRO_BATCH] = record.micro_batch
    if record.offenders:
        attributes[sc.ATTR_OFFENDERS] = tuple(
            json.dumps({"fault": o.fault, **o.location()}, separators=(",", ":")) for o in record.offenders)
    return attributes


def offender_attributes(record: SwaDivergenceRecord, offender: Offender) -> dict[str, int | str]:
    """The attributes of the ``kv_cache.swa.fault`` event of ``offender`` (a first offender of
    ``record``): ``kv_cache.swa.forward_ct``, ``kv_cache.swa.fault.kind`` and each location known."""
    attributes: dict[str, int | str] = {sc.RECORD_ATTRIBUTES["forward_ct"]: record.forward_ct,
                                        sc.ATTR_FAULT_KIND: offender.fault}
    for name, value in offender.location().items():
        attributes[sc.OFFENDER_ATTRIBUTES[name]] = value
    if record.verify_source is not None:
        attributes[sc.ATTR_VERIFY_SOURCE] = record.verify_source
    return attributes


def record_from_attributes(attributes) -> SwaDivergenceRecord:
    """Rebuild the record from an event's attributes (inverse of :func:`record_attributes`).

    Raises:
        KeyError: an attribute ``kv_cache.swa.<field>`` is missing.
        TypeError, ValueError: a value is not a non-negative int (as the record's constructor).
    """
    values = {}
    for name in FIELDS:
        key = sc.RECORD_ATTRIBUTES[name]
        if key not in attributes:
            raise KeyError(f"event attribute {key!r} is missing")
        values[name] = attributes[key]
    extras = {name: attributes[key] for names in (sc.AUDIT_ATTRIBUTES, sc.PROVENANCE_ATTRIBUTES)
              for name, key in names.items() if key in attributes}
    applicable = attributes.get(sc.ATTR_DIVERGENCE_APPLICABLE, True)
    source = attributes.get(sc.ATTR_VERIFY_SOURCE)
    micro_batch = attributes.get(sc.ATTR_MICRO_BATCH)
    offenders = []
    for text in attributes.get(sc.ATTR_OFFENDERS) or ():
        try:
            where = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"event attribute {sc.ATTR_OFFENDERS!r} holds {text!r}, not a JSON object: {exc}") from None
        if not isinstance(where, dict):
            raise ValueError(f"event attribute {sc.ATTR_OFFENDERS!r} holds {text!r}, not a JSON object")
        offenders.append(Offender(**where))
    return SwaDivergenceRecord(
        **values, **extras, divergence_applicable=applicable, verify_source=source, micro_batch=micro_batch,
        offenders=tuple(offenders),
    )


def liveness_attributes(warning: LivenessWarning) -> dict[str, int | str]:
    """The event attributes of a liveness warning: ``kv_cache.swa.liveness.<field>`` for its
    cause, counts and hook (when known), and ``kv_cache.swa.verify_source``."""
    fields = warning.to_dict()
    attributes = {key: fields[name] for name, key in sc.LIVENESS_ATTRIBUTES.items() if name in fields}
    if warning.verify_source is not None:
        attributes[sc.ATTR_VERIFY_SOURCE] = warning.verify_source
    return attributes


def liveness_from_attributes(attributes) -> LivenessWarning:
    """Rebuild the warning from an event's attributes (inverse of :func:`liveness_attributes`).

    Raises:
        KeyError: the cause attribute is missing; TypeError, ValueError: as the warning's constructor.
    """
    values = {name: attributes[key] for name, key in sc.LIVENESS_ATTRIBUTES.items() if key in attributes}
    return LivenessWarning(values.pop("cause"), **values, verify_source=attributes.get(sc.ATTR_VERIFY_SOURCE))


class SampleLogRecord(LogRecord):
    """The Logs API record of a sample event, carrying the record it was made from.

    The SDK hands the API record it was given to its processors (a ``SimpleLogRecordProcessor``
    passes the same object to its exporter; a ``BatchLogRecordProcessor`` a shallow copy), so
    otel-swa's own exporter (:class:`otel_swa.telemetry.logline.SwaLogLineExporter`) takes the
    lines from :attr:`sample` instead of rebuilding the record from the event's attributes. Every
    other exporter sees a plain ``LogRecord``: the same fields, attributes and body as before.

    Attributes:
        sample: the :class:`~otel_swa.record.SwaDivergenceRecord` or
            :class:`~otel_swa.record.LivenessWarning` the event describes.
    """

    def __init__(self, sample: "SwaDivergenceRecord | LivenessWarning", **fields: Any) -> None:
        super().__init__(**fields)
        self.sample = sample


class SampleEvents:
    """Emits the Logs API event and the span event of each record.

    Args:
        logger: an OpenTelemetry Logs API ``Logger`` (``None``: no Logs API event).
        tracer: the ``Tracer`` used for the child span of a late sample (``None``: no span event).
    """

    def __init__(self, logger: Logger | None, tracer: Tracer | None) -> None:
        self._logger = logger
        self._tracer = tracer
        if tracer is not None:
            use_system_random_ids(tracer)

    def emit(self, record: SwaDivergenceRecord, context: Context | None, extra: Mapping[str, Any] | None = None) -> None:
        """Emit both events of ``record`` with the forward-step ``context`` it was sampled in;
        ``extra``: attributes added to both (the reporter's process ranks)."""
        attributes = record_attributes(record)
        if extra:
            attributes.update(extra)
        self._emit(sc.EVENT_NAME, record.line(), attributes, SeverityNumber.INFO, context, record)
        faults = []
        for offender, line in zip(record.offenders, record.fault_lines()):
            fault = offender_attributes(record, offender)
            if extra:
                fault.update(extra)
            faults.append(fault)
            self._emit(sc.FAULT_EVENT_NAME, line, fault, SeverityNumber.WARN, context)
        if self._tracer is not None and context is not None:
            self._span_event(record, attributes, context, faults)

    def emit_liveness(self, warning: LivenessWarning, extra: Mapping[str, Any] | None = None) -> None:
        """Emit the Logs API event of a liveness warning (:data:`~otel_swa.telemetry.semconv.LIVENESS_EVENT_NAME`,
        severity WARN, body its line); ``extra``: attributes added (the reporter's process ranks).
        No span event: no forward step holds it."""
        attributes = liveness_attributes(warning)
        if extra:
            attributes.update(extra)
        self._emit(sc.LIVENESS_EVENT_NAME, warning.line(), attributes, SeverityNumber.WARN, None, warning)

    def _emit(self, name: str, body: str, attributes: dict, severity: SeverityNumber, context: Context | None,
              sample: Any = None) -> None:
        """One Logs API event, timestamped now (nothing without a logger); ``sample``: the record or
        warning it describes, carried by the event's :class:`SampleLogRecord`."""
        if self._logger is None:
            return
        now = time.time_ns()
        fields = dict(timestamp=now, observed_timestamp=now, event_name=name, body=body, attributes=attributes,
                      severity_number=severity, severity_text=severity.name, context=context)
        self._logger.emit(SampleLogRecord(sample, **fields) if sample is not None else LogRecord(**fields))

    def _span_event(self, record: SwaDivergenceRecord, attributes: dict[str, int], context: Context,
                    faults: "list[dict]" = ()) -> None:
        span = trace.get_current_span(context)
        if span.is_recording():
            span.add_event(sc.EVENT_NAME, attributes)
            for fault in faults:
                span.add_event(sc.FAULT_EVENT_NAME, fault)
            return
        if not span.get_span_context().is_valid:
            return
        child = self._tracer.start_span(
            sc.SAMPLE_SPAN_NAME,
            context=context,
            kind=SpanKind.INTERNAL,
            attributes={sc.RECORD_ATTRIBUTES["forward_ct"]: record.forward_ct},
        )
        try:
            child.add_event(sc.EVENT_NAME, attributes)
            for fault in faults:
                child.add_event(sc.FAULT_EVENT_NAME, fault)
        finally:
            child.end()
