"""Run a real ``vllm.LLM`` (``drive_llm.py``) the way a user does and collect what it left: the
process's log (vLLM's and otel-swa's lines), the driver's results, and otel-swa's records.

``run_llm(...)`` starts ``drive_llm.py`` with plain ``python`` (otel-swa's vLLM plugin, entry point
group ``vllm.general_plugins``, loaded by vLLM's ``load_general_plugins()``) or under
``opentelemetry-instrument`` (``launcher=True``: the ``opentelemetry_instrumentor`` entry point),
with the variables docs/engines.md gives (``OTEL_SWA_DIVERGENCE_INTERVAL``,
``OTEL_LOGS_EXPORTER=swa_logline``, traces and metrics off: no collector here) or none
(``interval=None``: otel-swa switched off).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from otel_swa.record import FAULT_FIELDS, SwaDivergenceRecord, find_all

HERE = Path(__file__).resolve().parent


@dataclass
class LlmRun:
    """What one ``drive_llm.py`` run left behind."""

    name: str
    log: Path
    results: dict
    seconds: float
    records: list[SwaDivergenceRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.records = find_all(self.log.read_text())

    def outputs(self) -> list[list[int]]:
        """The generated token ids of every request, in the order sent (both waves)."""
        return [r["output_ids"] for r in self.results["requests"]]

    def faults(self) -> dict[str, int]:
        """Per fault field of :data:`otel_swa.record.FAULT_FIELDS`, its largest value in any record
        (0 where no record carries it)."""
        return {f: max([getattr(r, f) or 0 for r in self.records], default=0) for f in FAULT_FIELDS}

    def check(self) -> tuple[int, str]:
        """``otel-swa check LOG``: exit status and what it printed."""
        from otel_swa.cli import main as otel_swa_cli

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = otel_swa_cli(["check", str(self.log)])
        return status, out.getvalue()


def build_model(out: Path, python: str = sys.executable) -> Path:
    """``build_model.py`` in a process of its own (transformers' model classes stay out of the
    test process); returns the model folder."""
    subprocess.run([python, str(HERE / "build_model.py"), str(out)], check=True, capture_output=True, timeout=300)
    return out


def run_llm(directory: Path, model: Path, name: str, llm: "dict | None" = None, *, interval: "int | None" = 1,
            launcher: bool = False, env: "dict | None" = None, requests: int = 20, repeat: int = 6,
            fault: "str | None" = None, fault_at: int = 10, timeout_s: float = 300.0) -> LlmRun:
    """Run ``drive_llm.py`` once in ``directory / name`` (module docstring); raises ``AssertionError``
    with the log's tail when it fails."""
    where = directory / name
    where.mkdir(parents=True, exist_ok=True)
    config = {"model": str(model), "out": str(where / "results.json"), "llm": llm or {}, "requests": requests,
              "repeat": repeat, "fault": fault, "fault_at": fault_at}
    (where / "config.json").write_text(json.dumps(config))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
    # one OpenMP thread, unbound (vLLM's CPU worker binds one per core otherwise, which on a small
    # machine shared with other work spins: generate took 30 - 90 s instead of 1 - 2 s)
    clean.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                  "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    if interval is not None:  # docs/engines.md's variables, no collector
        clean.update({"OTEL_SWA_DIVERGENCE_INTERVAL": str(interval), "OTEL_LOGS_EXPORTER": "swa_logline",
                      "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    clean.update(env or {})
    command = [sys.executable, str(HERE / "drive_llm.py"), str(where / "config.json")]
    if launcher:
        command.insert(0, str(Path(sys.executable).parent / "opentelemetry-instrument"))
    start = time.monotonic()
    with open(where / "engine.log", "w") as log:
        proc = subprocess.run(command, env=clean, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    seconds = time.monotonic() - start
    text = (where / "engine.log").read_text()
    assert proc.returncode == 0, f"drive_llm.py {name} exited {proc.returncode}:\n{text[-4000:]}"
    results = json.loads((where / "results.json").read_text())
    return LlmRun(name, where / "engine.log", results, seconds)
