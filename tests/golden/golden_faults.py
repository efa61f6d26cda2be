"""Engine faults and stand-ins the golden runs need that no other test module makes on the reference
engine (:mod:`otel_swa.reference.engine`): each gives the golden logs one more line kind or fault
line. Each takes the engine just built (``otel_swa.reference.replay`` builds it; the golden
scenarios wrap its constructor) and changes that engine only.

* :func:`install_freed_while_mapped`: sgl-project/sglang#27586 (a stale mapping entry frees an SWA
  page a live token still maps into): at one eviction the oldest live SWA page of the first request
  that has one is put back on the SWA free list with the pool's own release while its mapping
  entries stay. The slot audit sees stale tokens (live tokens whose page is free) until the
  allocator hands the page to another request, then shared slots (two live FULL slots map to one
  SWA slot).
* :func:`install_silent_view`: an engine whose view's host copy of ``seq_lens`` disagrees with the
  device tensor for a stretch of steps (the reporter refuses those samples: ``seq_lens_cpu_mismatch``),
  so no sample is delivered for longer than the liveness limit and the reporter gives its liveness
  warning: the class of an integration whose view is wrong at every sample (a hook on the wrong
  batch, SGLang's ``ForwardBatch`` fields read after the next step overwrote them).
* :func:`install_pipeline`: stands in for SGLang's pipeline-parallel scheduler
  (``managers/scheduler_pp_mixin.py``), which steps the model runner once per micro-batch and
  passes the micro-batch index (``mb_id``) with it: the reference engine, which has no pipeline,
  steps the reporter with ``micro_batch = forward_ct % micro_batches``.
"""

from __future__ import annotations

import dataclasses


def install_freed_while_mapped(engine, at_eviction: int) -> dict:
    """At the ``at_eviction``-th window eviction (1-based), free one live SWA page while its mapping
    stays; return what was freed (``page``, ``row``) once done."""
    pools = engine.pools
    real = pools.evict_out_of_window
    done: dict = {}
    calls = [0]

    def evict_out_of_window(reqs, window):
        freed = real(reqs, window)
        calls[0] += 1
        if calls[0] == at_eviction:
            for req in sorted(reqs, key=lambda r: r.row):
                live = [page for page in req.swa_pages if page != 0]
                if live:
                    pools._release(pools._swa_free, [live[0]])
                    done.update(page=live[0], row=req.row)
                    break
        return freed

    pools.evict_out_of_window = evict_out_of_window
    return done


def install_silent_view(engine, first: int, last: int) -> None:
    """From forward step ``first`` to ``last`` (the engine's ``forward_ct``), the view's host
    ``seq_lens_cpu`` is one more than the device ``seq_lens`` for the batch's first request."""
    real = engine.view

    def view():
        batch = real()
        if first <= engine.forward_ct <= last:
            wrong = list(batch.seq_lens_cpu)
            wrong[0] += 1
            batch = dataclasses.replace(batch, seq_lens_cpu=wrong)
        return batch

    engine.view = view


class _PipelineReporter:
    """The engine's reporter, stepped with a micro-batch index; everything else passes through."""

    def __init__(self, reporter, engine, micro_batches: int) -> None:
        self._reporter = reporter
        self._engine = engine
        self._micro_batches = micro_batches

    def step(self, view, context=None):
        self._reporter.step(view, context, micro_batch=self._engine.forward_ct % self._micro_batches)

    def __getattr__(self, name):
        return getattr(self._reporter, name)


def install_pipeline(engine, micro_batches: int = 2) -> None:
    """Step ``engine``'s reporter with ``micro_batch = forward_ct % micro_batches``."""
    if engine.reporter is not None:
        engine.reporter = _PipelineReporter(engine.reporter, engine, micro_batches)


