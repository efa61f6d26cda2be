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

Number of device-to-host slots in the pinned host ring (integer >= 1, default 4). When all are in
flight, the reporter waits for the oldest; samples are never dropped.
"""
