"""Reference engines whose sliding-window attention reads other KV than the mapping says, on purpose.

Each stands in for the attention kernel of the reference model (:mod:`otel_swa.reference.model`),
not for the allocator: the pools, the mapping and every bookkeeping count stay healthy, so only the
read check (:mod:`otel_swa.device.read_check`) can see them.

* :func:`install_raw_full_read`: the sliding-window layer reads its KV at the raw FULL slots of
  ``req_to_token`` instead of the SWA slots the mapping gives (sglang 0.5.23's
  ``TorchNativeAttnBackend``, which writes sliding-window layers at the translated SWA slots and
  reads them untranslated). Needs an SWA pool as large as the FULL pool (the real bug then gives
  wrong outputs without a crash, as with ``swa_full_tokens_ratio=1.0``).
* :func:`install_window_off`: the kernel's window is ``window + off`` positions while the allocator
  (and the view) keep ``window`` (sgl-project/sglang#34354: prefill and decode kernels disagreed on
  whether the window includes the current token).
"""

from __future__ import annotations

import torch


def install_raw_full_read(engine) -> None:
    """Make ``engine``'s sliding-window layer read at the raw FULL slots."""
    engine.model._key_slots = lambda sliding, pools, full: full.to(torch.int64)


def install_window_off(engine, off: int) -> None:
    """Make ``engine``'s attention kernel read ``window + off`` positions (the allocator's window
    stays ``engine.config.window``)."""
    engine.model.window = engine.config.window + off
