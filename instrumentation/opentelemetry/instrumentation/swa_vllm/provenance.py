"""KV provenance in vLLM's model runner: the stamps and checksums of each KV cache group, written at
every store (:mod:`otel_swa.device.paged_provenance`), wired with the write check
(:mod:`opentelemetry.instrumentation.swa_vllm.write_check`: same runner, same wrapped
``do_kv_cache_update``, same gate, attached to the scheduler's reporter the same way).

Wired where the runner has exactly one full-attention and one sliding-window KV cache group (a
hybrid model's two pools; ``kv_cache_config.kv_cache_groups``) whose layers all store in a layout
understood (:data:`otel_swa.views.vllm_write.SUPPORTED_IMPLS`); otherwise not, logged once. Both
pools have ``kv_cache_config.num_blocks x block_size`` slots (the spec's block size: kernel blocks
subdivide it, and the slot mapping counts the same slots).

Per ``do_kv_cache_update`` call of a wired layer, after the original store (every forward step, not
only sampled ones): at the first layer of its group in the forward (the lowest layer id: vLLM calls
the layers in order), the group's stamps at the call's slot mapping, from the runner's buffers
(V1 ``GPUModelRunner.input_ids``, ``positions``, ``input_batch.block_table[group]``, vLLM 0.32.0
``vllm/v1/worker/gpu_model_runner.py`` / ``block_table.py``; rows in the batch's order) and the
attention metadata's ``query_start_loc``; then the layer's K/V hash folded at those slots
(:meth:`~otel_swa.device.provenance.KvProvenance.after_layer`). The verification runs in the
scheduler's samples (:func:`otel_swa.views.vllm_provenance.provenance_view`).
"""

from __future__ import annotations

import logging
from typing import Any

_log = logging.getLogger("opentelemetry.instrumentation.swa_vllm")

__all__ = ["RunnerProvenance", "runner_provenance"]


class RunnerProvenance:
    """One model runner's provenance (module docstring).

    Args:
        provenance: the :class:`~otel_swa.device.paged_provenance.PagedProvenance`.
        first: per group index, the id of its first layer in a forward.
        runner: the model runner (its buffers are read at each stamp).
    """

    def __init__(self, provenance: Any, first: "dict[int, int]", runner: Any) -> None:
        self.provenance = provenance
        self.first = first
        self._runner = runner

    def before_forward(self, scheduler_output: Any) -> None:
        """The stamps' passes for the coming forward (:meth:`otel_swa.device.paged_provenance.
        PagedProvenance.stamp_group`): 2 where the step admits or resumes a request
        (``SchedulerOutput.scheduled_new_reqs``, ``scheduled_cached_reqs.resumed_req_ids``, vLLM 0.32.0
        ``vllm/v1/core/sched/output.py``: only such a request can hit the prefix cache on a block the
        step writes), 1 otherwise (every other request's previous position was written by an earlier
        step), 2 when the batch is not known (a warm-up, a capture)."""
        if scheduler_output is None:
            self.provenance.passes = 2
            return
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        admitted = bool(getattr(scheduler_output, "scheduled_new_reqs", None)) or bool(
            getattr(cached, "resumed_req_ids", None))
        self.provenance.passes = 2 if admitted else 1

    def after_store(self, write_layer: Any, store: Any, slot_mapping: Any) -> None:
        """The stamps (at the group's first layer) and the layer's fold of one store."""
        if self.first.get(write_layer.group) == write_layer.layer_id:
            self._stamp(write_layer, slot_mapping)
        self.provenance.after_layer(**store._asdict())

    def _stamp(self, write_layer: Any, slot_mapping: Any) -> None:
        from otel_swa.views.vllm_write import _query_start_loc, runner_positions

        runner = self._runner
        query_start_loc = _query_start_loc(write_layer.name)
        if query_start_loc is None:
            return  # no rows known (a backend whose metadata has none): the group's slots stay unstamped
        table = runner.input_batch.block_table[write_layer.group]
        ids = runner.input_ids
        self.provenance.stamp_group(
            swa=write_layer.swa, input_ids=getattr(ids, "gpu", ids), positions=runner_positions(runner),
            slot_mapping=slot_mapping, block_table=table.block_table.gpu, block_size=int(table.block_size),
            query_start_loc=query_start_loc)


def runner_provenance(runner: Any, kv_cache_config: Any, layers: list, gate: Any, left_out: list) -> "RunnerProvenance | None":
    """The runner's provenance (module docstring), or ``None`` where it is not wired (logged).

    Args:
        runner: the model runner, after ``initialize_kv_cache``.
        kv_cache_config: its ``KVCacheConfig``.
        layers: the write check's :class:`~otel_swa.views.vllm_write.WriteLayer` list.
        gate: the write check's :class:`~otel_swa.device.gate.SamplingGate` (shared).
        left_out: the names of layers whose store is not understood (none may be, for provenance).
    """
    from otel_swa import config
    from otel_swa.device.paged_provenance import PagedProvenance
    from otel_swa.views.vllm_write import _spec_kind

    setting = config.provenance()
    if setting is None:
        return None
    groups = list(kv_cache_config.kv_cache_groups)
    kinds = [_spec_kind(g.kv_cache_spec) for g in groups]
    if kinds.count(False) != 1 or kinds.count(True) != 1 or left_out:
        _log.info("otel-swa: vLLM's KV provenance is not wired: it needs one full-attention and one sliding-window "
                  "KV cache group whose layers all store in a known layout (groups: %s; %d layers left out)",
                  kinds, len(left_out))
        return None
    full, swa = kinds.index(False), kinds.index(True)
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    if type(num_blocks) is not int or num_blocks < 1:  # noqa: E721
        _log.info("otel-swa: vLLM's KV provenance is not wired: the KV cache config gives no number of blocks")
        return None
    slots = {}
    for index in (full, swa):
        spec = groups[index].kv_cache_spec
        spec = getattr(spec, "first_spec", None) or spec
        slots[index] = num_blocks * int(spec.block_size)
    order = {"full": tuple(sorted(w.layer_id for w in layers if w.group == full)),
             "swa": tuple(sorted(w.layer_id for w in layers if w.group == swa))}
    checksum, budget = setting
    provenance = PagedProvenance(runner.device, gate, full_slots=slots[full], swa_slots=slots[swa], checksum=checksum,
                                 budget=budget, checksum_order=order if checksum == "all" else None, write_check=False)
    first = {full: order["full"][0], swa: order["swa"][0]}
    _log.info("otel-swa: vLLM's KV provenance is wired (%d + %d slots, layers %s)", slots[full], slots[swa], order)
    return RunnerProvenance(provenance, first, runner)
