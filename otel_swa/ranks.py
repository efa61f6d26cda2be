"""Which rank this process is, without configuration: the identity that goes on the resource.

Sources, later ones winning:

1. ``torch.distributed``, when this process has initialised a process group
   (``torch.distributed.is_initialized()``): ``get_rank()`` and ``get_world_size()``. The module is
   read only if the program already imported it (``sys.modules``): asking never imports torch.
2. The launcher's variables, set by ``torchrun`` / ``torch.distributed.launch`` and most launchers
   before the process group exists: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.
3. otel-swa's variables for the engine's own parallel dimensions (``OTEL_SWA_TP_RANK``,
   ``OTEL_SWA_DP_RANK``, ``OTEL_SWA_PP_RANK``; :func:`otel_swa.config.parallel_ranks`), and what an
   instrumentor learns from the engine (SGLang's tensor / pipeline / data parallel ranks).

The global rank is not a tensor-parallel rank: a deployment with TP 2 and PP 2 has ranks 0-3 and
TP ranks 0-1. Both are reported, under their own names (:data:`RANK_ATTRIBUTES`).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from otel_swa import config

__all__ = ["process_ranks", "RANK_ATTRIBUTES"]

#: Key in :func:`process_ranks`' result -> resource attribute.
RANK_ATTRIBUTES = {
    "rank": "otel_swa.rank",
    "world_size": "otel_swa.world_size",
    "local_rank": "otel_swa.local_rank",
    "tp": "otel_swa.tp_rank",
    "dp": "otel_swa.dp_rank",
    "pp": "otel_swa.pp_rank",
}

_LAUNCHER = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}


def _from_torch_distributed() -> dict[str, int]:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return {}
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        return {"rank": int(dist.get_rank()), "world_size": int(dist.get_world_size())}
    except Exception:  # a backend in a bad state is no reason to fail the telemetry set-up
        return {}


def process_ranks(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """This process's ranks: any of ``rank``, ``world_size``, ``local_rank``, ``tp``, ``dp``,
    ``pp`` that is known (module docstring), as ints.

    Raises:
        otel_swa.config.ConfigError: a launcher or otel-swa rank variable is set but is not an
            integer >= 0 (``WORLD_SIZE`` >= 1).
    """
    env = os.environ if environ is None else environ
    ranks = _from_torch_distributed()
    for key, name in _LAUNCHER.items():
        minimum = 1 if key == "world_size" else 0
        value = config.read_int(name, env.get(name), default=-1, minimum=minimum)
        if value >= minimum:
            ranks[key] = value
    ranks.update(config.parallel_ranks(env))
    return ranks
