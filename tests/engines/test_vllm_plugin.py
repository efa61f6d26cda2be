"""otel-swa switched on in vLLM 0.33.0 the two ways docs/engines.md gives (marker ``vllm``):
``opentelemetry-instrument`` with the documented variables, and vLLM's own plugin loader
(``vllm.plugins.load_general_plugins()``, entry point group ``vllm.general_plugins``) with only
the interval variable set.

Each run is a process of its own running ``vllm_scheduler_script.py``: vLLM's real
``AsyncScheduler`` on the trace's first 8 requests with a leak made through the shim's variable
(``OTEL_SWA_TEST_VLLM_FAULT=leaked_tail_block@10``), sampling every forward step. The script calls
``load_general_plugins()`` first in every run (as each vLLM process does), so under
``opentelemetry-instrument`` the plugin and the instrumentor are both there: the plugin must then
stand aside.

* ``documented``: ``opentelemetry-instrument`` with docs/engines.md's variables (no collector: traces
  and metrics off, ``OTEL_LOGS_EXPORTER=swa_logline``);
* ``plugin``: plain ``python``, ``OTEL_SWA_DIVERGENCE_INTERVAL=1`` and nothing else (no ``OTEL_*``:
  the plugin writes otel-swa's lines to the process's log), and vLLM's two GPU model runner modules
  imported afterwards, as a worker imports them;
* ``switched_off``: plain ``python``, no interval variable.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_swa.cli import main as otel_swa_cli
from otel_swa.record import find_all
from vllm_support import vllm_classes  # noqa: F401

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("vllm_scheduler_script.py")
FAULT = {"OTEL_SWA_TEST_VLLM_FAULT": "leaked_tail_block@10", "HF_HUB_OFFLINE": "1"}
RUNS = {
    "documented": dict(launcher=True, options=("--plugin",),
                       env={"OTEL_SWA_DIVERGENCE_INTERVAL": "1", "OTEL_TRACES_EXPORTER": "none",
                            "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "swa_logline"}),
    "plugin": dict(launcher=False, options=("--plugin", "--runners"), env={"OTEL_SWA_DIVERGENCE_INTERVAL": "1"}),
    "switched_off": dict(launcher=False, options=("--plugin",), env={}),
}
#: the three methods of otel-swa's vLLM instrumentor (vllm_scheduler_script.INSTRUMENTED)
EVERY_METHOD = ["vllm.v1.core.sched.scheduler:Scheduler.schedule",
                "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",
                "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model"]


def check(log: Path) -> tuple[int, str]:
    """``otel-swa check LOG``: exit status and output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = otel_swa_cli(["check", str(log)])
    return status, out.getvalue()


@pytest.fixture(scope="module")
def runs(vllm_classes, tmp_path_factory):  # noqa: F811
    """``runs(name)``: ``(printed, log)`` of the run ``name`` (module docstring), made once:
    ``printed`` the script's ``key=value`` words, ``log`` its standard error."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            settings = RUNS[name]
            directory = tmp_path_factory.mktemp(name)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_", "VLLM_PLUGINS"))}
            env.update({**FAULT, **settings["env"]})
            launcher = [str(Path(sys.executable).parent / "opentelemetry-instrument")] if settings["launcher"] else []
            proc = subprocess.run([*launcher, sys.executable, str(SCRIPT), str(directory / "tiny-llama"), "async",
                                   *settings["options"]], env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            printed = dict(part.split("=", 1) for line in proc.stdout.splitlines()[-2:] for part in line.split())
            log = directory / "engine.log"
            log.write_text(proc.stderr)
            done[name] = (printed, log)
        return done[name]

    return get


def test_the_scripts_list_of_methods_is_the_instrumentors():
    sys.path.insert(0, str(SCRIPT.parent))
    import vllm_scheduler_script
    from opentelemetry.instrumentation.swa_vllm import WRAPPED

    assert vllm_scheduler_script.INSTRUMENTED == tuple(spec[:3] for spec in WRAPPED)
    assert EVERY_METHOD == [f"{m}:{c}.{f}" for m, c, f in vllm_scheduler_script.INSTRUMENTED]


def test_opentelemetry_instrument_with_the_documented_variables_gives_check_its_lines(runs, tmp_path):
    """The engine's log has one line per sample (the plugin, loaded too, stood aside: no line twice),
    and ``otel-swa check`` fails it on the leaked blocks, naming the first. A log without the
    exporter's lines has no record: ``check`` fails it too."""
    printed, log = runs("documented")
    steps, made, leaked = int(printed["scheduler_steps"]), int(printed["fault_at"]), printed["blocks"].split(",")
    status, output = check(log)
    # the exporter writes the fault lines too: check names the first leaked block
    assert status == 1 and "leaked KV blocks" in output and f"block {min(map(int, leaked))}" in output, output
    assert [r.forward_ct for r in find_all(log.read_text())] == list(range(1, steps + 1)) and made >= 10
    assert printed["otel_swa_wrapped"] == EVERY_METHOD[0]  # by the instrumentor (the runners are not imported)
    empty = tmp_path / "no-lines.log"
    empty.write_text("".join(line + "\n" for line in log.read_text().splitlines() if "otel_swa" not in line))
    assert check(empty)[0] != 0


def test_load_general_plugins_with_only_the_variable_instruments_as_opentelemetry_instrument_does(runs):
    """The Scheduler and both model runners wrapped, and the very same records, audit and fault lines
    as under ``opentelemetry-instrument`` (the line part after the log prefix), with no
    ``OTEL_*`` variable: the plugin set OpenTelemetry up with otel-swa's line exporter."""
    printed, log = runs("plugin")
    assert printed["otel_swa_wrapped"].split(",") == EVERY_METHOD
    documented = runs("documented")[1].read_text()

    def lines(text: str) -> list[str]:
        return [line[line.index("otel_swa["):] for line in text.splitlines()
                if "otel_swa[" in line and "otel_swa_run_start=" not in line]

    assert lines(log.read_text()) == lines(documented) and len(lines(documented)) >= 2 * int(printed["scheduler_steps"])
    assert check(log)[0] == 1  # the leak fails it as it fails the documented run


def test_without_the_variable_the_plugin_wraps_nothing_and_writes_nothing(runs):
    printed, log = runs("switched_off")
    assert (printed["otel_swa_wrapped"], printed["instrumentor_imported"]) == ("", "0")
    assert "otel_swa" not in log.read_text() and int(printed["scheduler_steps"]) > 10


def test_what_a_stat_logger_receives_cannot_carry_the_pool_usage_per_kv_cache_group(vllm_classes):  # noqa: F811
    """vLLM's ``vllm.stat_logger_plugins`` route: a ``StatLoggerBase`` runs in the front-end process and
    receives the engine core's ``SchedulerStats`` as vLLM sends it (``EngineCoreOutputs`` through its
    own msgpack encoder and decoder). Its one KV figure is ``kv_cache_usage``, the pool's used
    fraction of blocks over every KV cache group; anything an engine-core plugin adds to the stats,
    a field of a subclass or an attribute, is gone on the other side. So otel-swa's pool usage per
    KV cache group in tokens stays with the engine core's plugin (docs/engines.md)."""
    import dataclasses

    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    assert [f.name for f in dataclasses.fields(SchedulerStats) if "kv_cache" in f.name] == [
        "kv_cache_usage", "kv_cache_eviction_events"]

    @dataclasses.dataclass
    class WithPools(SchedulerStats):
        pool_tokens_used: dict = dataclasses.field(default_factory=dict)

    sent = WithPools(kv_cache_usage=0.615, pool_tokens_used={"full": 640, "swa": 400})
    sent.otel_swa_pools = {"full": 640, "swa": 400}
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=sent)))
    stats = received.scheduler_stats
    assert type(stats) is SchedulerStats and stats.kv_cache_usage == 0.615
    assert not hasattr(stats, "pool_tokens_used") and not hasattr(stats, "otel_swa_pools")
