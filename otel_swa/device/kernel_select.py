"""Which kernels run provenance's device work: the one place that chooses.

A KV cache on a CUDA device, with triton importable: the Triton kernels of
:mod:`otel_swa.device.triton_kv` (every step: 1 kernel for the stamps and the folds' reset, 1 per
layer for its hash and folds; a sample: 2 per pool for its verification). Anywhere else (the CPU,
triton missing): ``None``, and the torch path (:mod:`otel_swa.device.stamps`,
:mod:`otel_swa.device.kv_folds`, :mod:`otel_swa.device.provenance`) runs, unchanged. Both give the
same bits (``tests/kernels``).
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["write_kernels"]


def write_kernels(device: "torch.device | str") -> "ModuleType | None":
    """The kernel module for a KV cache on ``device`` (:mod:`otel_swa.device.triton_kv`), or
    ``None`` for the torch path (module docstring). Imports triton only for a CUDA device."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from otel_swa.device import triton_kv
    except ImportError:  # no triton (or one without what the kernels use): the torch path
        return None
    return triton_kv
