"""The library versions this instrumentation supports (checked by ``BaseInstrumentor``).

The wrapped methods (``Scheduler.schedule``, ``GPUModelRunner.execute_model``) and the
``SlidingWindowManager`` structures were read in vLLM 0.33's v1 engine source.
"""

_instruments = ("vllm >= 0.10, < 0.34",)
