"""The attributes the SGLang instrumentor sets on SGLang's objects (each holds otel-swa's wiring of
that object; ``None``: looked at and not observed)."""

#: Attribute of an instrumented ``ModelRunner`` holding its wiring (``None``: not observed).
RUNNER_ATTRIBUTE = "_otel_swa_telemetry"
#: Attribute of an instrumented ``Scheduler`` holding its pool usage registration.
POOLS_ATTRIBUTE = "_otel_swa_pools"
#: Attribute of an instrumented ``CanaryManager`` holding the reporter of its model runner.
CANARY_ATTRIBUTE = "_otel_swa_reporter"
#: Attribute of each attention layer (``RadixAttention``) of an observed model runner holding its
#: provenance wiring: the layer finds it also while SGLang captures a CUDA graph (the capture calls
#: the model, not ``ModelRunner.forward``).
PROVENANCE_ATTRIBUTE = "_otel_swa_provenance"
