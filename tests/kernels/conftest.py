"""The Triton kernels' tests (``otel_swa.device.triton_kv``): each case runs the kernel and the torch
path it replaces on the same inputs and compares every bit.

Where triton is missing (otel-swa's own test environment: its wheel is about 240 MB) they are
skipped; the SGLang suite's environment has it (``.ci/sglang-tests.sh`` runs them). On a machine
without CUDA the kernels run on CPU tensors under Triton's interpreter: the ``kernels`` fixture
sets ``TRITON_INTERPRET=1`` for the test and imports ``otel_swa.device.triton_kv`` under it (the
variable is read by ``triton.jit`` when the module is imported, so the module is imported again when
it was imported without it, and by the interpreter at each launch). The ``gpu`` cases compile them for the CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from kernel_support import import_kernels


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """``cpu`` (the kernels under Triton's interpreter) or ``cuda`` (compiled; a ``gpu`` case)."""
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the compiled kernels (the cuda cases)")
    return torch.device(request.param)


@pytest.fixture
def kernels(device, monkeypatch):
    """``otel_swa.device.triton_kv``, interpreted for ``cpu`` (``TRITON_INTERPRET=1`` for the test),
    compiled for ``cuda``."""
    interpret = device.type == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    return import_kernels(interpret)
