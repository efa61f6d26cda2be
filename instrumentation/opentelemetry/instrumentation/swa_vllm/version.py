"""Version of the swa_vllm instrumentation (that of the otel-swa distribution it ships in)."""

from otel_swa.version import __version__

__all__ = ["__version__"]
