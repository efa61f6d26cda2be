"""Names of the environment variables otel-swa reads (values are read and validated in ``config``).

Our own variables start with ``OTEL_SWA_``; SGLang's gate variable is honoured as a fallback so that
an engine configured for SGLang's KV canary switches the reporter on unchanged.
"""

OTEL_SWA_DIVERGENCE_INTERVAL = "OTEL_SWA_DIVERGENCE_INTERVAL"
"""
.. envvar:: OTEL_SWA_DIVERGENCE_INTERVAL

Sample the SWA KV cache every N forward steps (integer >= 0; 0, the default, switches the reporter
off). A sample is taken at forward counts that are non-zero multiples of N.
"""

SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL = "SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL"
"""
.. envvar:: SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL

SGLang's gate for the same reporter; used when ``OTEL_SWA_DIVERGENCE_INTERVAL`` is unset.
"""

OTEL_SWA_RING_SIZE = "OTEL_SWA_RING_SIZE"
"""
.. envvar:: OTEL_SWA_RING_SIZE

Number of device-to-host slots in the pinned host ring (integer from 1 to 1024, default 4). When all are in
flight, the reporter waits for the oldest; samples are never dropped.
"""

OTEL_SWA_TP_RANK = "OTEL_SWA_TP_RANK"
"""
.. envvar:: OTEL_SWA_TP_RANK

Tensor-parallel rank of the engine process (integer >= 0), put on the OpenTelemetry resource as
``otel_swa.tp_rank``. Unset: no attribute.
"""

OTEL_SWA_DP_RANK = "OTEL_SWA_DP_RANK"
"""
.. envvar:: OTEL_SWA_DP_RANK

Data-parallel rank of the engine process (integer >= 0), resource attribute ``otel_swa.dp_rank``.
"""

OTEL_SWA_PP_RANK = "OTEL_SWA_PP_RANK"
"""
.. envvar:: OTEL_SWA_PP_RANK

Pipeline-parallel rank of the engine process (integer >= 0), resource attribute ``otel_swa.pp_rank``.
"""

OTEL_SWA_REQUIRE_SGLANG = "OTEL_SWA_REQUIRE_SGLANG"
"""
.. envvar:: OTEL_SWA_REQUIRE_SGLANG

Test suite only: ``1`` makes the SGLang engine tests fail, instead of skip, when SGLang cannot be
imported (set by ``.ci/sglang-tests.sh``).
"""

OTEL_SWA_REQUIRE_VLLM = "OTEL_SWA_REQUIRE_VLLM"
"""
.. envvar:: OTEL_SWA_REQUIRE_VLLM

Test suite only: ``1`` makes the vLLM tests fail, instead of skip, when vLLM cannot be imported
(set by ``.ci/vllm-tests.sh``).
"""

OTEL_SWA_SIGTERM_FLUSH = "OTEL_SWA_SIGTERM_FLUSH"
"""
.. envvar:: OTEL_SWA_SIGTERM_FLUSH

``1`` (default): when SIGTERM still has its default action, otel-swa delivers and exports what it
holds before SIGTERM ends the process (see :mod:`otel_swa.lifecycle`). ``0``: SIGTERM is left alone.
"""

OTEL_SWA_METRIC_EXPORT_INTERVAL = "OTEL_SWA_METRIC_EXPORT_INTERVAL"
"""
.. envvar:: OTEL_SWA_METRIC_EXPORT_INTERVAL

Milliseconds (integer >= 0, default ``5000``) between two metric exports while an engine
instrumentor's reporter lives: the SDK's periodic metric readers whose own interval
(``OTEL_METRIC_EXPORT_INTERVAL``, 60 s by default) is longer are also collected and exported on this
schedule, so that a process killed from outside (SIGKILL, an OOM kill) loses at most this much of
its metric points. ``0``: only the SDK's own schedule. See ``otel_swa.telemetry.export_schedule``.
"""

OTEL_SWA_MICRO_BATCHES = "OTEL_SWA_MICRO_BATCHES"
"""
.. envvar:: OTEL_SWA_MICRO_BATCHES

Under pipeline parallelism, which micro-batches a sampling step samples: ``one`` (default) the
micro-batch whose forward step hit the interval, as SGLang's reporter does; ``every``: that one and
each other micro-batch of the pipeline's round, at their own forward steps (the engine passes the
micro-batch index to ``reporter.step``). Without micro-batch indices both are the same.
"""

OTEL_SWA_LIVENESS_STEPS = "OTEL_SWA_LIVENESS_STEPS"
"""
.. envvar:: OTEL_SWA_LIVENESS_STEPS

Forward steps without a delivered sample after which the reporter warns that it is on and not
working (the liveness warning: a line ``otel_swa_liveness=``, an event, the health counter
``kv_cache.swa.reporter.liveness.warnings``): an integer >= 0, default 10 sampling intervals, 0
switches the warning off. Checked at the sampling steps.
"""

OTEL_SWA_FORWARD_SPANS = "OTEL_SWA_FORWARD_SPANS"
"""
.. envvar:: OTEL_SWA_FORWARD_SPANS

Which forward steps get a ``forward step`` span (with its links to the batch's request spans):
``sampled`` (default: only the steps where the reporter takes a sample, so every sample's events
and exemplars still point at a span linked to its requests, at 1 / interval of the cost), ``all``
(every forward step) or ``off`` (none). See ``otel_swa.telemetry.spans.ForwardSpans``.
"""

OTEL_SWA_READ_CHECK = "OTEL_SWA_READ_CHECK"
"""
.. envvar:: OTEL_SWA_READ_CHECK

The read check (``otel_swa.device.read_check``): at each sampled forward step, recompute the
attention output of a few queries of the sliding-window layers from the KV pool through the
FULL-to-SWA mapping and compare it with the engine's. ``rotate`` (default): one sliding-window layer
per sampled step, in turn; ``all``: every sliding-window layer; ``off``: no check (the engine's
attention layers are not wrapped).
"""

OTEL_SWA_READ_CHECK_QUERIES = "OTEL_SWA_READ_CHECK_QUERIES"
"""
.. envvar:: OTEL_SWA_READ_CHECK_QUERIES

Queries the read check recomputes per checked layer (integer from 1 to 256, default 8): the last
token of that many requests of the batch, the batch's requests in turn across sampled steps.
"""

OTEL_SWA_PROVENANCE = "OTEL_SWA_PROVENANCE"
"""
.. envvar:: OTEL_SWA_PROVENANCE

Provenance (``otel_swa.device.provenance``): stamp every KV slot with the token, position and prefix
chain of the KV written there and hash its bytes at every forward step, check the writes and verify
the live slots at each sampled step. ``all`` (default): the checksum covers every byte of every
attention layer's K and V rows (folded into 16 bytes per slot and pool; a corrupt slot names the
layer changed); ``prefix``: cheaper, it covers only the first 64 bytes of each K and V row of one
layer per pool (the first of its kind) and misses a change anywhere else; ``off``: no provenance
(nothing written, nothing wrapped for it).
"""

OTEL_SWA_PROVENANCE_BUDGET = "OTEL_SWA_PROVENANCE_BUDGET"
"""
.. envvar:: OTEL_SWA_PROVENANCE_BUDGET

Live KV slots provenance verifies per pool and sampled step (integer from 1 to 1048576, default
4096); the rest are verified at later samples, in turn.
"""

OTEL_SWA_GRAPH_CHECKS = "OTEL_SWA_GRAPH_CHECKS"
"""
.. envvar:: OTEL_SWA_GRAPH_CHECKS

How the in-forward checks a CUDA graph holds (the read check, the write check) take the sampling
flag at each replay (``otel_swa.device.gate``): ``masked`` (default: they run at every replay, their
counts multiplied by the flag) or ``conditional`` (captured into a conditional node that runs them
only at sampled replays; CUDA 12.4 or later).
"""

OTEL_SWA_WARNED = "OTEL_SWA_WARNED"
"""
.. envvar:: OTEL_SWA_WARNED

Set by otel-swa itself, not by users: the instrumentors that already logged their "engine not
instrumented" warning in this process tree (comma-separated names). Child processes inherit it,
so a multi-process engine logs each such warning once, not once per process.
"""

OTEL_SWA_PROMETHEUS_PORT_OFFSET = "OTEL_SWA_PROMETHEUS_PORT_OFFSET"
"""
.. envvar:: OTEL_SWA_PROMETHEUS_PORT_OFFSET

With ``OTEL_METRICS_EXPORTER=prometheus``: what is added to ``OTEL_EXPORTER_PROMETHEUS_PORT``
(default 9464) to get this process's port, so that the ranks of one host, started with the same
environment, listen on ports of their own. ``rank`` (the default): the launcher's ``LOCAL_RANK``
when set, else the global rank (``torch.distributed`` or ``RANK``), else 0; an integer >= 0: that
offset (``0``: the port as it is).
"""

OTEL_SWA_PROMETHEUS_LINGER = "OTEL_SWA_PROMETHEUS_LINGER"
"""
.. envvar:: OTEL_SWA_PROMETHEUS_LINGER

With ``OTEL_METRICS_EXPORTER=prometheus``: at shutdown, keep the endpoint up until it has been
scraped once more (so the last values reach Prometheus), at most this many seconds (a number
from 0 to 600; default 0: close at once). For short runs such as ``otel-swa replay``.
"""
