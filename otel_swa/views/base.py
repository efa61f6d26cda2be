"""What the reporter reads from an engine: the SWA KV cache view protocol.

An engine exposes its hybrid KV cache to the reporter through an object with four tensor attributes
(all on the same device as the reporter):

``req_to_token``
    ``int32`` or ``int64``, shape ``[num_req_slots, max_context_len]``. Row ``r`` holds the FULL-pool
    slot of each position of the request in request slot ``r`` (SGLang's ``ReqToTokenPool``).
``full_to_swa_index_mapping``
    ``int64``, shape ``[num_full_slots]``. The SWA slot of each FULL slot; ``0`` means "none": never
    mapped, or freed because the token left the sliding window (SGLang's
    ``SWATokenToKVPoolAllocator.full_to_swa_index_mapping``).
``req_pool_indices``
    ``int32`` or ``int64``, shape ``[batch]``: the ``req_to_token`` rows of the requests in this
    forward step.
``seq_lens``
    ``int32`` or ``int64``, shape ``[batch]``: the number of live tokens (positions ``0 ..
    seq_len - 1``) of each request of the batch.

and, optionally:

``seq_lens_cpu``
    the same as ``seq_lens`` as a host tensor or a sequence of ints. With it the reporter gathers
    exactly the live tokens (``sum(seq_lens)`` of them), or, when they fill 85 % or more of
    ``[batch, max_context_len]``, the whole rows (cheaper then; see :mod:`otel_swa.device.sample`);
    without it it always gathers the whole rows, masked, which needs no host sync either. The
    sample also counts the batch entries where it differs from ``seq_lens`` (a fault: such a
    sample gives no record).
``req_pool_indices_cpu``
    the same as ``req_pool_indices`` on the host (a CPU tensor or a sequence of ints), used with
    ``seq_lens_cpu``: the rows are then checked and turned into gather offsets on the host, and the
    sample takes four device operations fewer (``req_pool_indices`` is not read).
``swa_audit``
    a :class:`SwaAuditInputs` (the SWA free list and every live holder's FULL slots): the reporter
    then also counts leaked SWA slots, stale tokens and shared SWA slots in the same device pass
    (see :mod:`otel_swa.device.audit`).
``divergence_applicable``
    ``False`` for engines without a FULL-to-SWA mapping (vLLM); default ``True``.

Engines adapt their own objects to this protocol (see ``otel_swa.views`` for the adapters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["SwaBatchView", "SwaBatch", "SwaAuditInputs", "validate_view"]


@runtime_checkable
class SwaBatchView(Protocol):
    """The tensors the reporter reads at a sampled forward step (see the module docstring)."""

    req_to_token: torch.Tensor
    full_to_swa_index_mapping: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True)
class SwaAuditInputs:
    """What the SWA slot audit reads besides the mapping (see :mod:`otel_swa.device.audit`).

    Attributes:
        swa_free_page_ids: ``int32``/``int64 [k]`` on the reporter's device: the SWA pool's free
            page ids (slot ids when ``page_size == 1``), every free list together.
        num_swa_pages: pages of the SWA pool (ids ``1 .. num_swa_pages``).
        page_size: slots per page.
        holder_full_slots: ``int32``/``int64 [n]`` on the reporter's device: the FULL slot of every
            token a live holder (running request, prefix cache) still reads, not only the batch's.
    """

    swa_free_page_ids: torch.Tensor
    num_swa_pages: int
    page_size: int
    holder_full_slots: torch.Tensor


@dataclass(frozen=True)
class SwaBatch:
    """A plain :class:`SwaBatchView`: the engine's tensors for one forward step, by reference.

    ``seq_lens_cpu`` is optional host knowledge of ``seq_lens`` (a CPU tensor or a sequence of
    ints); give it when the engine has it, so the reporter gathers only the live tokens.
    ``req_pool_indices_cpu`` is the same for ``req_pool_indices`` (read only with ``seq_lens_cpu``).
    """

    req_to_token: torch.Tensor
    full_to_swa_index_mapping: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: "torch.Tensor | Sequence[int] | None" = None
    swa_audit: SwaAuditInputs | None = None
    divergence_applicable: bool = True
    req_pool_indices_cpu: "torch.Tensor | Sequence[int] | None" = None


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name: str, value: Any, ndim: int, dtypes: tuple, device: torch.device | None) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"view.{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"view.{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"view.{name} must be {names}, got {str(value.dtype).replace('torch.', '')}")
    if device is not None and value.device != device:
        raise ValueError(f"view.{name} is on {value.device}, expected the reporter's device {device}")


def validate_view(view: Any, device: torch.device | None = None) -> None:
    """Check that ``view`` satisfies :class:`SwaBatchView`.

    Only metadata is read (dim, dtype, device, shape): no device work, no host sync.

    Raises:
        TypeError: an attribute is missing, is not a tensor, or has the wrong dtype.
        ValueError: a tensor has the wrong number of dimensions or is on another device, or
            ``req_pool_indices``, ``seq_lens``, ``seq_lens_cpu`` and ``req_pool_indices_cpu`` differ
            in length.
    """
    for name in ("req_to_token", "full_to_swa_index_mapping", "req_pool_indices", "seq_lens"):
        if not hasattr(view, name):
            raise TypeError(f"view {type(view).__name__} has no attribute {name!r} (see SwaBatchView)")
    _check_tensor("req_to_token", view.req_to_token, 2, _INDEX_DTYPES, device)
    _check_tensor("full_to_swa_index_mapping", view.full_to_swa_index_mapping, 1, (torch.int64, torch.int32), device)
    _check_tensor("req_pool_indices", view.req_pool_indices, 1, _INDEX_DTYPES, device)
    _check_tensor("seq_lens", view.seq_lens, 1, _INDEX_DTYPES, device)
    host_lens = getattr(view, "seq_lens_cpu", None)
    if host_lens is not None:
        if isinstance(host_lens, torch.Tensor) and host_lens.dim() != 1:
            raise ValueError(f"view.seq_lens_cpu must have 1 dimension, got shape {tuple(host_lens.shape)}")
        if len(host_lens) != view.req_pool_indices.shape[0]:
            raise ValueError(
                f"view.seq_lens_cpu has {len(host_lens)} entries but view.req_pool_indices has "
                f"{view.req_pool_indices.shape[0]}; they must describe the same batch"
            )
    host_rows = getattr(view, "req_pool_indices_cpu", None)
    if host_rows is not None:
        if isinstance(host_rows, torch.Tensor) and (host_rows.dim() != 1 or host_rows.device.type != "cpu"):
            raise ValueError(
                f"view.req_pool_indices_cpu must be a 1-dimensional host tensor or a sequence, got shape "
                f"{tuple(host_rows.shape)} on {host_rows.device}"
            )
        if len(host_rows) != view.req_pool_indices.shape[0]:
            raise ValueError(
                f"view.req_pool_indices_cpu has {len(host_rows)} entries but view.req_pool_indices has "
                f"{view.req_pool_indices.shape[0]}; they must describe the same batch"
            )
    audit = getattr(view, "swa_audit", None)
    if audit is not None:
        if not isinstance(audit, SwaAuditInputs):
            raise TypeError(f"view.swa_audit must be a SwaAuditInputs or None, got {type(audit).__name__}")
        _check_tensor("swa_audit.swa_free_page_ids", audit.swa_free_page_ids, 1, _INDEX_DTYPES, device)
        _check_tensor("swa_audit.holder_full_slots", audit.holder_full_slots, 1, _INDEX_DTYPES, device)
        for name in ("num_swa_pages", "page_size"):
            value = getattr(audit, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"view.swa_audit.{name} must be an int >= 1, got {value!r}")
    if view.req_pool_indices.shape[0] != view.seq_lens.shape[0]:
        raise ValueError(
            f"view.req_pool_indices has {view.req_pool_indices.shape[0]} entries but view.seq_lens has "
            f"{view.seq_lens.shape[0]}; they must describe the same batch"
        )
