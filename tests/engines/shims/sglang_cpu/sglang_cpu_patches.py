"""Test-only patches that let a real sglang 0.5.23 ``Engine`` with its KV canary run on a CPU-only
machine, applied to each SGLang module right after it is imported, in every process of the test
environment (SGLang's tokenizer, scheduler and detokenizer are separate processes).

Stands in for: a CUDA device. sglang 0.5.23 runs its scheduler, model runner, hybrid SWA pools and
radix cache on CPU with ``SGLANG_USE_CPU_ENGINE=1`` and ``attention_backend="torch_native"``, but
three pieces of its KV canary assume an accelerator, and one attention bug hides on CUDA backends:

1. ``sglang.srt.utils.common.create_device_stream`` builds ``torch.cpu.Stream(device=...)``, a
   TypeError in torch 2.13 (the CPU stream takes only a priority and has no ``synchronize`` /
   ``query``). Replaced, for CPU devices only, by a CPU stream that takes ``device`` and whose
   ``synchronize`` / ``query`` are trivially done (CPU work is synchronous).
2. ``sglang.srt.utils.phase_checker.SimplePhaseChecker.update`` launches a triton kernel, and
   triton has no CPU driver ("0 active drivers"). Replaced by the same check in torch: assert the
   phase when asserts are on, then set the next phase.
3. ``sglang.srt.kv_canary.runner.future_tensor`` allocates its host staging with
   ``pin_memory=True``, which a CPU-only torch cannot do. That module's ``torch`` is given a view of
   torch whose ``empty`` drops ``pin_memory`` when no CUDA device exists.
4. ``TorchNativeAttnBackend`` (``sglang/srt/layers/attention/torch_native_backend.py``) writes the
   sliding-window layers' KV at the slots translated through ``full_to_swa_index_mapping`` but
   reads them back with the untranslated FULL slots of ``req_to_token``: once the SWA allocator
   remaps (divergence >= 1, exactly what these tests need) it reads other tokens' KV, or raises
   ``IndexError`` past the SWA pool. For sliding-window layers the read path is given
   ``req_to_token`` translated through the mapping, which makes it read what it wrote.
5. HiCache's two CUDA-only calls (``pool_host/common._cuda_host_register`` and
   ``pool_host/mha.transfer_kv_direct``): :mod:`sglang_hicache_cpu`.

Installed by ``tests/engines/shims/install.py`` (a ``.pth`` file in the test environment); each
patch is applied once, right after its module is first imported, and only to that module, through
otel-swa's own post-import hooks (:mod:`otel_swa.import_hooks`: registered at interpreter start-up,
these run before an instrumentor's, which register later).
"""

from __future__ import annotations

import types

_PATCHED: list[str] = []


def _patch_create_device_stream(module: types.ModuleType) -> None:
    import torch

    original = module.create_device_stream

    class CpuStream(torch.cpu.Stream):
        def __init__(self, priority: int = 0, device=None) -> None:
            super().__init__(priority)

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

    def create_device_stream(device):
        if torch.device(device).type == "cpu":
            return CpuStream()
        return original(device)

    module.create_device_stream = create_device_stream


def _patch_phase_checker(module: types.ModuleType) -> None:
    def update(self, *, expect_phase, next_phase, caller_name: str = "") -> None:
        self._resolve_caller_tag(caller_name)
        if int(self._enable_assert_device.item()):
            phase = int(self._phase.item())
            if phase != int(expect_phase):
                raise AssertionError(
                    f"SimplePhaseChecker ({caller_name!r}): expected phase {int(expect_phase)}, found {phase}"
                )
        self._phase.fill_(int(next_phase))

    module.SimplePhaseChecker.update = update


def _patch_future_tensor(module: types.ModuleType) -> None:
    import torch

    if torch.cuda.is_available():
        return
    view = types.ModuleType("torch_without_pinned_memory")
    view.__getattr__ = lambda name: getattr(torch, name)

    def empty(*args, pin_memory: bool = False, **kwargs):
        return torch.empty(*args, **kwargs)

    view.empty = empty
    module.torch = view


def _patch_torch_native_backend(module: types.ModuleType) -> None:
    backend = module.TorchNativeAttnBackend

    class _TranslatedRows:
        """Holds ``req_to_token`` with SWA slots, for one sliding-window layer call."""

        __slots__ = ("req_to_token",)

        def __init__(self, req_to_token) -> None:
            self.req_to_token = req_to_token

    def reading_swa_slots(method):
        def wrapper(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            pool = self.token_to_kv_pool
            if not (self.use_sliding_window_kv_pool and pool.layers_mapping[layer.layer_id][1]):
                return method(self, q, k, v, layer, forward_batch, save_kv_cache)
            full_rows = self.req_to_token_pool
            swa_rows = pool.translate_loc_from_full_to_swa(full_rows.req_to_token.long())
            self.req_to_token_pool = _TranslatedRows(swa_rows)
            try:
                return method(self, q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                self.req_to_token_pool = full_rows

        wrapper.__name__ = method.__name__
        wrapper.__qualname__ = method.__qualname__
        return wrapper

    backend.forward_extend = reading_swa_slots(backend.forward_extend)
    backend.forward_decode = reading_swa_slots(backend.forward_decode)


PATCHES = {
    "sglang.srt.utils.common": _patch_create_device_stream,
    "sglang.srt.utils.phase_checker": _patch_phase_checker,
    "sglang.srt.kv_canary.runner.future_tensor": _patch_future_tensor,
    "sglang.srt.layers.attention.torch_native_backend": _patch_torch_native_backend,
}


def _hicache_patches() -> dict:
    import sglang_hicache_cpu

    return sglang_hicache_cpu.PATCHES


def _applied(patch, name: str):
    def apply(module: types.ModuleType) -> None:
        patch(module)
        _PATCHED.append(name)

    return apply


def add_patch(module_name: str, patch) -> None:
    """Run ``patch(module)`` right after ``module_name`` is imported (after the patches registered
    before it, the CPU ones first)."""
    from otel_swa import import_hooks

    import_hooks.when_imported(module_name, _applied(patch, module_name))


_installed = False


def install() -> None:
    """Register the CPU patches with otel-swa's post-import hooks (once per process); when the
    engine tests ask for it (``OTEL_SWA_TEST_SGLANG_PROBE``), also their scheduler-process probe,
    and for the engine benchmark (``OTEL_SWA_TEST_SGLANG_PROFILE``) its timers."""
    global _installed
    if _installed:
        return
    _installed = True
    import os

    fault = os.environ.get("OTEL_SWA_TEST_SGLANG_FAULT", "")
    raw_read = "torch_native_raw_read" in [part.partition("@")[0].strip() for part in fault.split(",")]
    for name, patch in PATCHES.items():
        if patch is _patch_torch_native_backend and raw_read:
            continue  # sglang 0.5.23's own read bug, left in on purpose (see sglang_faults)
        add_patch(name, patch)
    for name, patch in _hicache_patches().items():
        add_patch(name, patch)
    if os.environ.get("OTEL_SWA_TEST_SGLANG_PROFILE"):  # benchmarks/bench_sglang_engine.py
        import sglang_step_profile

        sglang_step_profile.install()
    if os.environ.get("OTEL_SWA_TEST_SGLANG_PROBE"):
        import sglang_step_probe

        sglang_step_probe.install()
        import sglang_hicache_probe

        sglang_hicache_probe.install()
        if fault:
            import sglang_faults

            sglang_faults.install(fault)
        if os.environ.get("OTEL_SWA_TEST_SGLANG_PERTURB"):
            import sglang_perturb_phases

            sglang_perturb_phases.install(os.environ["OTEL_SWA_TEST_SGLANG_PERTURB"])


def patched_modules() -> list[str]:
    """The modules patched so far in this process, in order (for the tests' own checks)."""
    return list(_PATCHED)
