"""The engine run of ``bench_plugin_startup.py``: start a real ``sglang.Engine`` on CPU with the engine
suite's tiny hybrid-SWA model, answer one request of 24 tokens (with otel-swa on at interval 20, one
sample), shut it down, and say how long the start took.

Usage: ``python sglang_startup_driver.py CONFIG.json``; the JSON object holds ``model`` (the output of
``tests/engines/sglang_engine/build_model.py``) and ``out`` (where the results go). Writes
``{"startup_s", "import_s", "engine_s", "tokens", "plugin_loaded"}``: seconds from this script's
first line to the ``Engine`` being ready, of which the ``import sglang`` and the ``Engine(...)``
call, the tokens answered, and whether otel-swa's plugin module was loaded in this process.

With ``OTEL_SWA_BENCH_HIDE_PLUGINS=1`` the entry points of otel-swa's engine plugins (groups
``sglang.srt.plugins`` and ``vllm.general_plugins``) are left out of what
``importlib.metadata.entry_points`` returns, in this process and in every process SGLang spawns
(a spawned process runs this module's top level as ``__mp_main__`` before it imports any of
SGLang): SGLang then starts as it would without otel-swa installed. The filter is in place in every
run, hiding or not, so that both variants pay for it alike.
"""

from __future__ import annotations

import time

T0 = time.monotonic()

import importlib.metadata as _metadata  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

_PLUGIN_GROUPS = ("sglang.srt.plugins", "vllm.general_plugins")
_OUR_MODULE = "opentelemetry.instrumentation.swa_plugins"
_HIDE = os.environ.get("OTEL_SWA_BENCH_HIDE_PLUGINS") == "1"
_entry_points = _metadata.entry_points


def _entry_points_seen(**params):
    found = _entry_points(**params)
    if params.get("group") in _PLUGIN_GROUPS and _HIDE:
        return _metadata.EntryPoints(ep for ep in found if ep.value.split(":")[0] != _OUR_MODULE)
    return found


_metadata.entry_points = _entry_points_seen


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    import sglang as sgl

    imported = time.monotonic()
    engine = sgl.Engine(
        model_path=config["model"], device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
        disable_cuda_graph=True, dtype="float32", max_total_tokens=160, mem_fraction_static=0.05,
        max_running_requests=4, chunked_prefill_size=-1, page_size=1, random_seed=0, log_level="warning",
    )
    ready = time.monotonic()
    output = engine.generate(input_ids=[[5, 6, 7, 8, 9, 10, 11, 12]],
                             sampling_params={"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True})
    engine.shutdown()
    results = {"startup_s": ready - T0, "import_s": imported - T0, "engine_s": ready - imported,
               "tokens": output[0]["meta_info"]["completion_tokens"], "plugin_loaded": _OUR_MODULE in sys.modules}
    with open(config["out"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
