"""The reference hybrid-SWA inference engine: the embedded default host of the reporter.

- :mod:`otel_swa.reference.trace`: the Azure LLM inference trace loader and the packaged 2023 files;
- :mod:`otel_swa.reference.pools`: FULL and SWA KV pools, ``req_to_token``, the full-to-SWA mapping,
  window eviction;
- :mod:`otel_swa.reference.scheduler`: continuous batching with chunked prefill and admission control;
- :mod:`otel_swa.reference.model`: a tiny full-attention + sliding-window forward over the pools;
- :mod:`otel_swa.reference.engine`: forward steps tying them together, with the reporter calls;
- :mod:`otel_swa.reference.replay`: replaying a trace, ``DEFAULT_REPLAY``.

Nothing is imported here, so that loading a trace does not import torch.
"""
