"""The package version (one place; read by pyproject.toml and the OpenTelemetry meter/tracer)."""

__version__ = "0.1.0"
