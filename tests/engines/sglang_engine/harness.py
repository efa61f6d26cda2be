"""Run a real ``sglang.Engine`` (``drive_engine.py``) the way a user does and collect what it left:
the engine log, the scheduler-process probe's recount, the driver's results and what a real
collector received.

``run_engine(...)`` starts ``drive_engine.py`` under ``opentelemetry-instrument`` (the process that
command starts is not the one that runs the forward: otel-swa's instrumentor must load in SGLang's
spawned scheduler process through the ``opentelemetry_instrumentor`` entry point), or with plain
``python`` (``launcher=False``: otel-swa's SGLang plugin, entry point group ``sglang.srt.plugins``,
loads in every process through SGLang's own ``load_plugins()``), with the standard ``OTEL_*``
variables pointing at a ``rotel-agent`` collector, or without any (``collector=False``: nothing
but the variables the test gives, as a user's plain script).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from collector_support import RotelCollector

from otel_swa.record import SwaDivergenceRecord, find_all

HERE = Path(__file__).resolve().parent


@dataclass
class EngineRun:
    """What one engine run left behind."""

    log: str
    results: dict
    probe: list[dict]
    seen: dict
    seconds: float
    ours: list[SwaDivergenceRecord] = field(default_factory=list)
    sglangs: list[SwaDivergenceRecord] = field(default_factory=list)
    #: what the probe found in each scheduler process at its first forward step (``process-*.json``:
    #: otel-swa's wrappers, its instrumentor imported or not, the reporters alive)
    processes: list = field(default_factory=list)

    def __post_init__(self) -> None:
        records = find_all(self.log)
        self.ours = [r for r in records if r.verify_source is not None]
        self.sglangs = [r for r in records if r.verify_source is None]

    @property
    def forward_steps(self) -> int:
        """Forward steps of the target model, as the probe in the scheduler counted them."""
        return max(line["step"] for line in self.probe)

    def recount(self, step: int) -> dict:
        return next(line for line in self.probe if line["step"] == step)

    def spans(self, name: str) -> list[dict]:
        return [s for s in self.seen["spans"] if s.get("name") == name]

    def events(self) -> list[dict]:
        return [l for l in self.seen["logs"] if l.get("event_name") == "kv_cache.swa.divergence_sample"]

    def points(self, metric: str) -> list[dict]:
        return [p for m in self.seen["metrics"] if m.get("name") == metric for p in m["points"]]


def build_model(out: Path, python: str = sys.executable) -> Path:
    run = subprocess.run([python, str(HERE / "build_model.py"), str(out)], capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{run.stderr[-3000:]}")
    return out


def prepare_run(directory: Path, launcher: bool = True) -> "tuple[Path, list[str]]":
    """Make a run's ``directory`` and its ``probe`` folder; the probe folder and the command that
    starts a Python program: ``opentelemetry-instrument`` beside this Python and this Python
    (``RuntimeError`` when it is not installed), or this Python alone (``launcher=False``)."""
    directory.mkdir(parents=True, exist_ok=True)
    probe_dir = directory / "probe"
    probe_dir.mkdir(exist_ok=True)
    if not launcher:
        return probe_dir, [sys.executable]
    path = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    if path is None:
        raise RuntimeError("opentelemetry-instrument is not installed beside this Python (pip install opentelemetry-distro)")
    return probe_dir, [path, sys.executable]


def read_probe(probe_dir: Path, kind: str) -> list:
    """The probe's JSON lines of ``kind`` (``probe``, ``pools``) or objects (``process``), every process's."""
    if kind == "process":
        return [json.loads(path.read_text()) for path in sorted(probe_dir.glob("process-*.json"))]
    return [json.loads(line) for path in sorted(probe_dir.glob(f"{kind}-*.jsonl")) for line in path.read_text().splitlines()]


def run_engine(
    directory: Path,
    model: Path,
    agent: "str | None",
    *,
    engine: dict,
    env: dict,
    requests: int = 16,
    repeat: int = 4,
    timeout_s: int = 600,
    driver: dict | None = None,
    launcher: bool = True,
    collector: bool = True,
) -> EngineRun:
    """Run the engine once; ``engine``: extra ``sglang.Engine`` arguments, ``env``: variables on top
    of a clean environment (no inherited ``OTEL_*`` / ``SGLANG_*``). ``{otlp_grpc}`` in a value of
    ``engine`` is replaced by the collector's gRPC address (``host:port``); ``driver``: more keys of
    ``drive_engine.py``'s configuration (``sigkill_children``); ``launcher``: under
    ``opentelemetry-instrument`` (default) or plain ``python``; ``collector``: a ``rotel-agent``
    (``agent``) and the ``OTEL_*`` variables pointing at it (default), or neither."""
    probe_dir, command = prepare_run(directory, launcher)
    with (RotelCollector(agent, directory, settle_s=1.0) if collector else contextlib.nullcontext()) as sink:
        grpc = f"127.0.0.1:{sink.grpc_port}" if collector else ""
        config = {
            "model": str(model), "out": str(directory / "results.json"), "requests": requests, "repeat": repeat,
            "engine": {k: (v.replace("{otlp_grpc}", grpc) if isinstance(v, str) else v) for k, v in engine.items()},
            **(driver or {}),
        }
        (directory / "config.json").write_text(json.dumps(config))
        run_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
        run_env.update({
            "SGLANG_USE_CPU_ENGINE": "1",
            # admit as if each request needed at most 8 more tokens: decoding then outgrows the
            # 160-token pool and the scheduler retracts (see drive_engine.py)
            "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "8",
            "HF_HUB_OFFLINE": "1",
            "OTEL_SWA_TEST_SGLANG_PROBE": str(probe_dir),
        })
        if collector:
            run_env.update({
                "OTEL_SERVICE_NAME": "sglang-engine-test",
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_LOGS_EXPORTER": "otlp,swa_logline",
                "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint("grpc"),
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_INSECURE": "true",
                # one periodic export would come after the run: every metric point the collector gets
                # was exported by the flush at the engine's shutdown
                "OTEL_METRIC_EXPORT_INTERVAL": "600000",
                "OTEL_SWA_METRIC_EXPORT_INTERVAL": "0",  # nor otel-swa's schedule (test_sglang_server.py runs it)
            })
        run_env.update(env)
        (directory / "command.json").write_text(json.dumps({"launcher": command[:-1], "env": {
            k: v for k, v in run_env.items() if k.startswith(("OTEL_", "SGLANG_"))}}, indent=1))
        start = time.monotonic()
        proc = subprocess.run(
            [*command, str(HERE / "drive_engine.py"), str(directory / "config.json")],
            env=run_env, capture_output=True, text=True, timeout=timeout_s,
        )
        seconds = time.monotonic() - start
        log = proc.stdout + proc.stderr
        (directory / "engine.log").write_text(log)
        if proc.returncode != 0 or "drive_engine done" not in log:
            tail = "\n".join(line[:400] for line in log.splitlines()[-60:])
            raise RuntimeError(f"the engine run failed (exit {proc.returncode}) in {directory}:\n{tail}")
    results = json.loads((directory / "results.json").read_text())
    seen = sink.seen() if collector else {"spans": [], "logs": [], "metrics": []}
    return EngineRun(log=log, results=results, probe=read_probe(probe_dir, "probe"), seen=seen, seconds=seconds,
                     processes=read_probe(probe_dir, "process"))
