"""The library versions this instrumentation supports (checked by ``BaseInstrumentor``)."""

# The reference engine ships inside the otel-swa distribution.
_instruments = ("otel-swa >= 0.1.0",)
