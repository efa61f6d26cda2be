"""An application that runs otel-swa's reference engine with no otel-swa code of its own: what
``opentelemetry-instrument`` is pointed at in the entry-point tests (four requests, window 16,
interval from ``OTEL_SWA_DIVERGENCE_INTERVAL``); it prints ``forward_ct <n>`` at the end."""

REFERENCE_APP = r"""
from types import SimpleNamespace
from otel_swa.reference.engine import EngineConfig, ReferenceEngine
engine = ReferenceEngine(EngineConfig(window=16, full_pool_size=1024, swa_pool_size=256, max_running=4,
                                      token_budget=64, max_context_len=256, step_time_s=0.0))
for c, g in ((40, 12), (25, 20), (70, 6), (33, 15)):
    engine.submit(SimpleNamespace(context_tokens=c, generated_tokens=g), arrival_s=0.0)
engine.run_until_done()
print("forward_ct", engine.forward_ct)
"""
