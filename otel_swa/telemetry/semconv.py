"""Names otel-swa gives its telemetry: the metric namespace, event name, span names, attribute keys.

Namespace: every metric, event and record attribute starts with ``kv_cache.swa.``, but the pool
usage gauges, ``kv_cache.pool.*`` (:mod:`otel_swa.telemetry.pools`: they cover the FULL pool too). The names
describe the thing observed (the sliding-window-attention pool of the KV cache), not the package
that observes it, in the way OpenTelemetry's semantic conventions name ``system.memory.*`` or
``gen_ai.*``; the reporter's own health sits below ``kv_cache.swa.reporter.``. Names are dotted and
lowercase, units are UCUM with curly-brace annotations, and units never appear in names
(OpenTelemetry metric naming guidelines).

Attributes on metrics are bounded: ``pool`` (``full`` | ``swa``), ``kv_cache.swa.verify_source``
(``attention`` | ``kv_canary``) and nothing per request. The rank
of the engine process (tensor/data/pipeline parallel) is a *resource* attribute (see
:mod:`otel_swa.telemetry.setup`).
"""

from __future__ import annotations

from otel_swa.ranks import RANK_ATTRIBUTES
from otel_swa.record import AUDIT_FIELDS, FIELDS, OFFENDER_KEYS, PROVENANCE_FIELDS

#: Prefix of every metric name, event name and record attribute key.
NAMESPACE = "kv_cache.swa."

#: Name of the event emitted for every delivered sample (Logs API event and span event).
EVENT_NAME = NAMESPACE + "divergence_sample"

#: Name of the event of a reporter that is on and delivers no sample (Logs API event, severity
#: WARN; its body is otel-swa's ``otel_swa_liveness=`` line).
LIVENESS_EVENT_NAME = NAMESPACE + "reporter.liveness"

#: Event attribute key of each field of a liveness warning, e.g. ``kv_cache.swa.liveness.steps``.
LIVENESS_ATTRIBUTES = {name: NAMESPACE + "liveness." + name for name in (
    "cause", "forward_ct", "steps", "samples_delivered", "samples_taken", "invalid_samples", "skipped_captures",
    "hook")}

#: Name of the span the engine wraps around one forward step.
FORWARD_SPAN_NAME = "forward step"

#: Name of the short child span of the forward step that carries a late sample's span event.
SAMPLE_SPAN_NAME = "swa divergence sample"

#: Name of the span of one request (``otel-swa replay`` and the request-span helper).
REQUEST_SPAN_NAME = "request"

#: Metric attribute: which KV pool a value belongs to.
ATTR_POOL = "pool"
POOL_FULL = "full"
POOL_SWA = "swa"

#: Event attribute key of each record field, e.g. ``kv_cache.swa.forward_ct``.
RECORD_ATTRIBUTES = {name: NAMESPACE + name for name in FIELDS}

#: Event attribute key of each SWA slot audit field (present only when the sample was audited).
AUDIT_ATTRIBUTES = {name: NAMESPACE + name for name in AUDIT_FIELDS}

#: Event attribute key of each provenance field (present only when the engine checks the KV held in
#: the slots: the write check, the provenance stamps, the content checksum, vLLM's block hashes).
PROVENANCE_ATTRIBUTES = {name: NAMESPACE + name for name in PROVENANCE_FIELDS}

#: Event attribute set to ``False`` when the engine has no FULL-to-SWA mapping (vLLM): the
#: divergence attribute is then a placeholder 0, kept for the SGLang line.
ATTR_DIVERGENCE_APPLICABLE = NAMESPACE + "divergence_applicable"

#: Event and metric attribute: what ``verify_full`` / ``verify_swa`` count (``attention``: KV entries
#: attention read; ``kv_canary``: entries SGLang's KV canary verified); see
#: :data:`otel_swa.record.VERIFY_SOURCES`. On ``kv_cache.swa.entries.verified`` beside ``pool``.
ATTR_VERIFY_SOURCE = NAMESPACE + "verify_source"

#: Event and metric attribute: under pipeline parallelism, the micro-batch the sampled forward step
#: ran (``record.micro_batch``, SGLang's ``mb_id``; bounded by the pipeline's micro-batches). On the
#: per-sample gauges (not the cumulative counters: their totals span every micro-batch), so that a
#: dashboard takes the max over micro-batches instead of one that a sample happened to catch idle.
ATTR_MICRO_BATCH = NAMESPACE + "micro_batch"

#: Metric attribute of ``kv_cache.swa.reporter.view_faults``: which fault a bad view showed.
ATTR_FAULT = NAMESPACE + "fault"

#: Values of a check's outcome attribute (a :class:`otel_swa.checks.MetricRow` with ``outcomes``:
#: ``kv_cache.swa.read_check.outcome``, ``kv_cache.swa.write_check.outcome``,
#: ``kv_cache.swa.provenance.outcome``): ``agree``; ``disagree`` (the check found a fault);
#: ``unchecked`` (what the check could not compare).
READ_AGREE = "agree"
READ_DISAGREE = "disagree"
READ_UNCHECKED = "unchecked"

#: Name of the event emitted for each first offender of a sample (Logs API event and span event):
#: where the fault was first seen (:class:`otel_swa.record.Offender`).
FAULT_EVENT_NAME = NAMESPACE + "fault"
#: Event attribute of that event: which fault (a field of :data:`otel_swa.record.FAULT_FIELDS`).
ATTR_FAULT_KIND = NAMESPACE + "fault.kind"
#: Event attribute key of each location of an offender, e.g. ``kv_cache.swa.fault.position``.
OFFENDER_ATTRIBUTES = {name: NAMESPACE + "fault." + name for name in OFFENDER_KEYS}
#: Attribute of the sample event: its first offenders, one compact JSON object each (``{"fault":
#: ..., <location>: ...}``, the fault line's keys after ``forward_ct``), so the event gives the
#: record back whole (the ``swa_logline`` exporter writes its fault lines from it).
ATTR_OFFENDERS = NAMESPACE + "offenders"

# Attributes of the forward-step span (all bounded: counts, never request ids).
ATTR_FORWARD_CT = "forward_step.forward_ct"
ATTR_BATCH_SIZE = "forward_step.batch_size"
ATTR_NUM_PREFILL = "forward_step.num_prefill"
ATTR_NUM_DECODE = "forward_step.num_decode"
#: Request links not added to the forward-step span (over the link limit).
ATTR_LINKS_DROPPED = "forward_step.links.dropped"
#: Requests of the batch without a usable W3C ``traceparent`` (none known, or unparsable); 0 when no
#: traceparent lookup is configured (no request is looked up then).
ATTR_LINKS_MISSING = "forward_step.links.missing"

# Resource attributes for the rank of the engine process (named in otel_swa.ranks).
ATTR_RANK = RANK_ATTRIBUTES["rank"]
ATTR_WORLD_SIZE = RANK_ATTRIBUTES["world_size"]
ATTR_LOCAL_RANK = RANK_ATTRIBUTES["local_rank"]
ATTR_TP_RANK = RANK_ATTRIBUTES["tp"]
ATTR_DP_RANK = RANK_ATTRIBUTES["dp"]
ATTR_PP_RANK = RANK_ATTRIBUTES["pp"]

#: Schema URL given to the meter, tracer and logger (the semantic-conventions version the
#: resource and span attributes follow).
SCHEMA_URL = "https://opentelemetry.io/schemas/1.26.0"

#: Instrumentation scope name (the meter, tracer and logger are named after the package).
SCOPE_NAME = "otel_swa"
