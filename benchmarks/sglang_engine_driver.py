"""The engine run of ``bench_sglang_engine.py``: a real ``sglang.Engine`` on CPU with the engine suite's
tiny hybrid-SWA model, 16 requests of 160 output tokens each, decoded together.

Usage: ``python sglang_engine_driver.py CONFIG.json``; the JSON object holds ``model`` (the output of
``tests/engines/sglang_engine/build_model.py``) and ``out`` (where the results go). Prompts: the
first 16 requests of the packaged Azure conversation trace as the engine suite makes them (a
16-token shared system prompt and 4-24 more tokens), each generating 160 tokens greedily
(``ignore_eos``); the pool holds them all (4,096 FULL slots, 16 running requests), so after the
prefill every forward step decodes the 16 requests over about 3,000 live tokens. One short
request first warms the engine up (not timed). Writes ``{"tokens", "generate_s", "startup_s", "cpu_s"}``,
``cpu_s`` the CPU time (user + system, psutil) each engine process spent during the timed generate, by
process name (SGLang names its scheduler ``sglang::scheduler``; this script's own process is ``main``),
and ``gc_main`` this process's garbage collections in that generate (generation -> ``[collections,
seconds]``). ``"freeze_gc": true`` in the config calls SGLang's ``Engine.freeze_gc()`` after the
warm-up (``gc.freeze()`` in every engine process, as SGLang advises for serving).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

T0 = time.monotonic()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "engines" / "sglang_engine"))

REQUESTS, OUTPUT_TOKENS = 16, 160


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    import sglang as sgl
    from drive_engine import traffic

    engine = sgl.Engine(
        model_path=config["model"], device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
        disable_cuda_graph=True, dtype="float32", max_total_tokens=4096, mem_fraction_static=0.05,
        max_running_requests=REQUESTS, chunked_prefill_size=-1, page_size=1, random_seed=0, log_level="warning",
    )
    started = time.monotonic()
    prompts, _ = traffic(REQUESTS)
    params = {"temperature": 0.0, "max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}
    engine.generate(input_ids=prompts[:1], sampling_params={**params, "max_new_tokens": 8})  # warm-up
    if config.get("freeze_gc"):
        engine.freeze_gc()  # SGLang's own call: objects made so far leave the collector's generations
    processes = _engine_processes()
    cpu_before = _cpu_times(processes)
    collections = _GcPauses()
    begin = time.monotonic()
    outputs = engine.generate(input_ids=prompts, sampling_params=[params] * REQUESTS)
    generate_s = time.monotonic() - begin
    collections.stop()
    cpu_after = _cpu_times(processes)
    cpu_s = {name: round(cpu_after[name] - cpu_before.get(name, 0.0), 4) for name in cpu_after}
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    engine.shutdown()
    with open(config["out"], "w") as f:
        json.dump({"tokens": tokens, "generate_s": generate_s, "startup_s": started - T0, "cpu_s": cpu_s,
                   "gc_main": collections.by_generation, "otel_swa": _otel_swa_source()}, f)


def _otel_swa_source() -> "str | None":
    """The folder the engine's processes import ``otel_swa`` from (they share this one's path)."""
    import importlib.util

    spec = importlib.util.find_spec("otel_swa")
    return str(Path(spec.origin).resolve().parent.parent) if spec is not None and spec.origin else None


class _GcPauses:
    """The garbage collections of this process (SGLang's ``TokenizerManager`` runs here) from now to
    :meth:`stop`: ``by_generation`` maps the generation collected to ``[collections, seconds]`` (the
    collector's own time, ``gc.callbacks``, wall clock)."""

    def __init__(self) -> None:
        self.by_generation: dict = {}
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            entry = self.by_generation.setdefault(str(info["generation"]), [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - self._started

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def _engine_processes() -> dict:
    """This process (``main``) and its descendants, by name (a second of a name gets ``#2``)."""
    import psutil

    me = psutil.Process()
    named = {"main": me}
    for child in me.children(recursive=True):
        try:
            name = child.name()
        except psutil.Error:
            continue
        key, n = name, 1
        while key in named:
            n += 1
            key = f"{name}#{n}"
        named[key] = child
    return named


def _cpu_times(processes: dict) -> dict:
    import psutil

    out = {}
    for name, process in processes.items():
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        out[name] = times.user + times.system
    return out


if __name__ == "__main__":
    main(sys.argv[1])
