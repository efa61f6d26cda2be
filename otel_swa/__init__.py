"""otel-swa: OpenTelemetry instrumentation for the sliding-window-attention KV cache.

See the README for the data path (observe -> step -> device sample -> device-to-host ring ->
record -> sinks) and the OpenTelemetry mapping.
"""

from otel_swa.record import LINE_PREFIX, SwaDivergenceRecord, find_all, find_last
from otel_swa.version import __version__

__all__ = ["LINE_PREFIX", "SwaDivergenceRecord", "find_all", "find_last", "__version__"]
