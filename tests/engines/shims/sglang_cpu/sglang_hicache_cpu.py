"""CPU stand-ins for the two CUDA-only calls of sglang 0.5.23's hierarchical cache (HiCache), so that
``enable_hierarchical_cache=True`` runs inside a CPU ``sglang.Engine`` (test environments only).

With ``hicache_io_backend="direct"`` and ``hicache_mem_layout="layer_first"`` (the one backend and
layout whose copies are plain per-layer index copies; the default ``"kernel"`` backend needs
``sgl_kernel.kvcacheio.transfer_kv_all_layer_lf_pf``, which has no torch fallback), HiCache needs
exactly two calls that do not exist without CUDA:

* :func:`host_register`, for ``sglang.srt.mem_cache.pool_host.common._cuda_host_register``: it pins
  the host pool's buffer with ``torch.cuda.cudart().cudaHostRegister`` (page-locked memory for
  asynchronous DMA). Without a CUDA device there is nothing to pin: the buffer is used as allocated.
* :func:`transfer_kv_direct`, for ``sgl_kernel.kvcacheio.transfer_kv_direct``, which
  ``sglang.srt.mem_cache.pool_host.mha`` imports only on CUDA/HIP/XPU (on CPU the name is undefined
  and the first backup raises ``NameError``): for each layer pair, ``dst[dst_indices] =
  src[src_indices]`` over the token rows, the copy the kernel makes page by page.

Both are applied by :mod:`sglang_cpu_patches` right after their module is imported, only when no
CUDA device exists.
"""

from __future__ import annotations

import types


def host_register(buffer, registration_granularity_bytes=None) -> None:
    """Stands in for ``_cuda_host_register(buffer, registration_granularity_bytes)``: nothing to pin
    on a CPU-only machine (``buffer``: the host pool's ``torch.Tensor``, left as it is)."""


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """Stands in for ``sgl_kernel.kvcacheio.transfer_kv_direct``: copies the token rows
    ``src_indices`` of each tensor of ``src_layers`` to the rows ``dst_indices`` of the tensor of
    ``dst_layers`` at the same place (``[slots, ...]`` each, rows of one layer's K or V; the indices
    ``int [n]``, whole pages of ``page_size`` tokens, which a row copy does not need).

    Raises:
        ValueError: the lists or the index counts differ in length.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers for {len(dst_layers)} destination layers")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{src_indices.numel()} source rows for {dst_indices.numel()} destination rows")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        src_rows = src_indices.to(src.device, non_blocking=False).long()
        dst_rows = dst_indices.to(dst.device, non_blocking=False).long()
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.device))


def patch_common(module: types.ModuleType) -> None:
    """``sglang.srt.mem_cache.pool_host.common``: :func:`host_register` for ``_cuda_host_register``."""
    import torch

    if not torch.cuda.is_available():
        module._cuda_host_register = host_register


def patch_mha(module: types.ModuleType) -> None:
    """``sglang.srt.mem_cache.pool_host.mha``: :func:`transfer_kv_direct` where the module has none."""
    if not hasattr(module, "transfer_kv_direct"):
        module.transfer_kv_direct = transfer_kv_direct


#: module -> its patch (:mod:`sglang_cpu_patches` registers them)
PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": patch_common,
    "sglang.srt.mem_cache.pool_host.mha": patch_mha,
}
