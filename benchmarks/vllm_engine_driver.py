"""One run of ``bench_vllm_engine.py``: the vLLM engine suite's driver (``tests/engines/vllm_engine/
drive_llm.py``: ``vllm.LLM(...).generate`` of its traffic, the engine core in this process) with the
CPU time of the ``generate`` calls measured, and optionally timers on otel-swa's parts.

Usage: ``python vllm_engine_driver.py CONFIG.json`` (``drive_llm.py``'s config, plus ``profile``: true
to time otel-swa's parts). Writes ``drive_llm.py``'s results with ``generate_cpu_s`` (this process's
user + system time in the ``generate`` calls: the engine core and the model runner run here),
``generated_tokens``, ``torch_threads`` and, when profiled, ``parts``: seconds of CPU time spent in

* ``store``: the wrapper of each ``do_kv_cache_update`` after the original store (provenance's
  stamps and folds at every step, the write check at sampled ones:
  ``RunnerWriteCheck.after_store``);
* ``schedule``: the instrumentor's work after each ``Scheduler.schedule()`` (the window counts every
  step, the sample at sampled ones: ``SwaVllmInstrumentor._after_schedule``);
* ``provenance_stage``: of which the provenance verification (``PagedProvenance.stage``);
* ``provenance_view``: of which the reading of the tables for it (``provenance_view``).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engines" / "vllm_engine"))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(owner, name: str, parts: dict, key: str, static: bool = False) -> None:
    original = owner.__dict__[name]
    function = original.__func__ if static else original

    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            parts[key] = parts.get(key, 0.0) + time.process_time() - start

    setattr(owner, name, staticmethod(timed) if static else timed)


def main(config_path: str) -> None:
    import drive_llm
    import vllm

    config = json.loads(Path(config_path).read_text())
    parts: dict = {}
    if config.get("profile"):
        import otel_swa.views.vllm_provenance as views
        from opentelemetry.instrumentation import swa_vllm
        from opentelemetry.instrumentation.swa_vllm import write_check
        from otel_swa.device.paged_provenance import PagedProvenance

        _timed(write_check.RunnerWriteCheck, "after_store", parts, "store")
        _timed(swa_vllm.SwaVllmInstrumentor, "_after_schedule", parts, "schedule", static=True)
        _timed(PagedProvenance, "stage", parts, "provenance_stage")
        original = views.provenance_view

        def provenance_view(*args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                parts["provenance_view"] = parts.get("provenance_view", 0.0) + time.process_time() - start

        views.provenance_view = provenance_view
    generate = vllm.LLM.generate
    spent = {"cpu": 0.0}

    def timed_generate(self, *args, **kwargs):
        start = _cpu()
        try:
            return generate(self, *args, **kwargs)
        finally:
            spent["cpu"] += _cpu() - start

    vllm.LLM.generate = timed_generate
    drive_llm.main(config_path)
    import torch

    results = json.loads(Path(config["out"]).read_text())
    results.update(generate_cpu_s=spent["cpu"], torch_threads=torch.get_num_threads(), parts=parts,
                   generated_tokens=sum(len(r["output_ids"]) for r in results["requests"]))
    Path(config["out"]).write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
