"""The library versions this instrumentation supports (checked by ``BaseInstrumentor``).

The wrapped methods (``ModelRunner.forward``, ``CanaryManager.__init__`` and
``CanaryManager.pre_ops_maybe_inside_graph``) and the allocator layout were read in sglang 0.5.23.
"""

_instruments = ("sglang >= 0.5.23, < 0.6",)
