"""Test-only stand-in for ``sgl_kernel`` (SGLang's compiled kernels) on a CPU-only machine.

Stands in for: the CPU build of sgl-kernel, which is not on PyPI (the PyPI wheels are CUDA builds
and need ``libcuda``). sglang 0.5.23 imports dozens of names from it at import time
(``from sgl_kernel import ...`` in its layers, speculative decoding and memory pool modules) but,
with ``SGLANG_USE_CPU_ENGINE=1``, the torch-native attention backend and no ``torch.ops.sgl_kernel``
registered, calls exactly one of them while serving: ``assign_req_to_token_pool_cpu`` (writes the
new KV slots of a batch into ``req_to_token``, ``sglang/srt/mem_cache/allocation.py``). That one is
written here in plain torch. Every other name is a function that raises ``NotImplementedError``
naming itself when called, so an unexpected runtime use fails loudly instead of computing garbage.

Because no ``torch.ops.sgl_kernel`` ops exist, sglang's ``cpu_has_amx_support()`` is False and its
norms, activations, rotary embedding and linear layers take their torch fallbacks.
"""

from __future__ import annotations

__version__ = "0.0.0+otel-swa-test-stub"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``req_to_token[row, start:end] = out_cache_loc[k:k + end - start]`` for each request of the
    batch, ``k`` running over ``out_cache_loc`` in batch order (the CPU kernel's contract)."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + count].to(req_to_token.dtype)
            offset += count


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def not_in_stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but the test stub only provides assign_req_to_token_pool_cpu"
        )

    not_in_stub.__name__ = name
    return not_in_stub
