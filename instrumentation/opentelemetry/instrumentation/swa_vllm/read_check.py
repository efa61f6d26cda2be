"""The read check on vLLM's sliding-window layers: where it is hooked in the model runner, and how it
reaches the scheduler's reporter.

It rides on the runner's write check (:mod:`.write_check`, wired after ``initialize_kv_cache``):
where that is wired and ``OTEL_SWA_READ_CHECK`` is not ``off``, the runner's
:class:`~.write_check.RunnerWriteCheck` also gets a :class:`~otel_swa.device.read_check.ReadCheck`
on its device, under the same sampling gate (``OTEL_SWA_READ_CHECK`` ``rotate``: one
sliding-window layer per sampled step, in turn; ``all``; ``OTEL_SWA_READ_CHECK_QUERIES`` queries a
layer, 8 by default), each layer of a sliding-window KV cache group whose implementation the check
reads (:data:`otel_swa.views.vllm_read.READ_IMPLS`) carries it, and those implementation classes'
``forward`` is wrapped (restored by ``uninstrument()``): vLLM's attention first, then, at a sampled
step, for the layer whose turn it is, a few of the batch's last tokens recomputed from the KV cache
through the block table and compared with the output the layer wrote
(:func:`otel_swa.views.vllm_read.read_args`). A call the check cannot read is counted unchecked,
and the reason logged once; an exception in otel-swa's part is logged once per runner and never
reaches the forward.

The check is attached to the scheduler's reporter with the write check (the registry's pairing,
:meth:`~otel_swa.reporter.SwaDivergenceReporter.attach_read_check`): its offender names the request
(the runner's batch of the checked step), position, slot of the layer's KV cache group, layer and
group. As with the write check, the record of forward step ``N`` carries the check of step
``N - 1`` (vLLM schedules, and so samples, before the model runs). Cost: nothing at a step that is
not sampled (one attribute read and one flag test per layer call); at a sampled one the read
check's device work for one layer (:mod:`otel_swa.device.read_check`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

_log = logging.getLogger("opentelemetry.instrumentation.swa_vllm")

__all__ = ["LAYER_ATTRIBUTE", "wire_read_check"]

#: Attribute of an ``Attention`` module holding ``(RunnerWriteCheck, WriteLayer)`` for the read check.
LAYER_ATTRIBUTE = "_otel_swa_read_layer"

_LOGGED: "set[str]" = set()


def _wrap_forward(original: Callable) -> Callable:
    """The wrapper of an implementation's ``forward`` (module docstring)."""

    @functools.wraps(original)
    def forward(impl, layer, query, key, value, kv_cache, attn_metadata, output=None, *args, **kwargs):
        result = original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        carried = getattr(layer, "__dict__", {}).get(LAYER_ATTRIBUTE)
        if carried is not None and attn_metadata is not None:
            wired, write_layer = carried
            try:
                check = wired.read
                if check is not None and wired.gate.wanted() and check.wants(write_layer.layer_id):
                    _check_call(check, write_layer, impl, query, output if output is not None else result,
                                kv_cache, attn_metadata)
            except Exception:  # otel-swa's part never breaks the forward
                wired.failed(f"the read check failed at layer {write_layer.name}")
        return result

    forward._otel_swa_read = True
    return forward


def _check_call(check: Any, write_layer: Any, impl: Any, query: Any, output: Any, kv_cache: Any, metadata: Any) -> None:
    from otel_swa.views.vllm_read import read_args

    args = read_args(write_layer, impl, query, output, kv_cache, metadata)
    if isinstance(args, str):
        seq_lens = getattr(metadata, "seq_lens", None)
        check.unchecked(min(check.max_queries, int(seq_lens.shape[0])) if seq_lens is not None else check.max_queries)
        if args not in _LOGGED:
            _LOGGED.add(args)
            _log.info("otel-swa: vLLM's read check counts layer %s unchecked: %s", write_layer.name, args)
        return
    check.check_layer(**args)


def wire_read_check(wired: Any, originals: dict) -> int:
    """Give the runner's check ``wired`` (a :class:`~.write_check.RunnerWriteCheck`) its read check
    over the sliding-window layers it holds (module docstring), wrap their implementation classes'
    ``forward`` once (``originals``: what ``uninstrument()`` restores); returns the number of
    layers that carry it (0: none, and ``wired.read`` stays ``None``)."""
    from otel_swa import config
    from otel_swa.device.read_check import ReadCheck
    from otel_swa.views.vllm_read import READ_IMPLS

    from .write_check import wrap_once

    wired.read = None
    setting = config.read_check()
    if setting is None:
        return 0
    layers = [w for w in wired.layers if w.swa and type(w.layer.impl).__name__ in READ_IMPLS
              and callable(getattr(type(w.layer.impl), "forward", None))]
    if not layers:
        return 0
    mode, queries = setting
    wired.read = ReadCheck(wired.gate.device, max_queries=queries, layers=mode, gate=wired.gate)
    for write_layer in layers:
        write_layer.layer.__dict__[LAYER_ATTRIBUTE] = (wired, write_layer)
        wrap_once(type(write_layer.layer.impl), "forward", _wrap_forward, "_otel_swa_read", originals)
    return len(layers)
