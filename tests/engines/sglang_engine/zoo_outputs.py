"""What the provenance faults of the SGLang zoo do to the engine's outputs, against a clean run of the
same configuration (a measurement by hand, not a test).

For each phased run of ``tests/engines/test_sglang_zoo.py`` (``PHASED``): one clean run (the same
engine arguments, traffic and KV canary, no fault) and the run with its faults, then per fault: the
step it was made, the requests it touched, how many of their outputs differ from the clean run's
(greedy decoding, ``ignore_eos``: the requests' lengths and so the batches are the same in both runs
until a token differs) and at which output token first, what SGLang's KV canary reported for that
fault's steps, and whether every request no fault touched decoded exactly as in the clean run.

Usage: ``.venv-sglang/bin/python tests/engines/sglang_engine/zoo_outputs.py OUT_DIR [RUN ...]``
(prints a markdown table; each run's directory is kept under ``OUT_DIR``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]

from collector_support import rotel_agent  # noqa: E402
from sglang_engine.harness import build_model, run_engine  # noqa: E402
from test_sglang_zoo import INTERVAL, PHASED, canary_said  # noqa: E402


def _run(out: Path, model: Path, name: str, engine: dict, env: dict):
    start = time.monotonic()
    run = run_engine(
        out / name, model, rotel_agent(), requests=16, repeat=4, engine={"kv_canary": "log", **engine},
        env={"OTEL_SWA_DIVERGENCE_INTERVAL": str(INTERVAL), "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": str(INTERVAL),
             "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false", "OTEL_SWA_TEST_SGLANG_FAULT_ALIGN": str(INTERVAL),
             **env},
    )
    print(f"{name}: {time.monotonic() - start:.0f} s, {run.forward_steps} forward steps", file=sys.stderr)
    return run


def _made(directory: Path) -> list[dict]:
    made = [json.loads(line) for pattern in ("faults-*.jsonl", "perturb-*.jsonl")
            for path in sorted((directory / "probe").glob(pattern)) for line in path.read_text().splitlines()]
    for fault in made:
        if "perturbation" in fault:
            fault["fault"] = f"perturb {fault['perturbation']}:{fault['group']}"
    return sorted(made, key=lambda f: f["step"])


def compare(out: Path, model: Path, name: str) -> list[str]:
    engine, env, _ = PHASED[name]
    clean = _run(out, model, f"{name}-clean", engine, {})
    faulty = _run(out, model, name, engine, env)
    by_rid = {r["rid"]: i for i, r in enumerate(faulty.results["requests"])}
    made = _made(out / name)
    rows, touched = [], set()
    for k, fault in enumerate(made):
        until = made[k + 1]["step"] if k + 1 < len(made) else faulty.forward_steps + 1
        differ, first = 0, []
        for rid in fault.get("requests", ()):
            touched.add(rid)
            i = by_rid[rid]
            ours, theirs = faulty.results["requests"][i]["output_ids"], clean.results["requests"][i]["output_ids"]
            if ours != theirs:
                differ += 1
                first.append(next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b))
        rows.append(f"| `{fault['fault']}` | {fault['step']} | {len(fault.get('requests', ()))} | {differ}"
                    f"{' (from output token ' + ', '.join(map(str, first)) + ')' if first else ''} | "
                    f"{canary_said(faulty.log, fault['step'], until)} |")
    others = [i for rid, i in by_rid.items() if rid not in touched]
    same = sum(faulty.results["requests"][i]["output_ids"] == clean.results["requests"][i]["output_ids"]
               for i in others)
    rows.append(f"| (every other request) | | {len(others)} | {len(others) - same} | "
                f"clean run: {canary_said(clean.log, 0, clean.forward_steps + 2)} |")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        build_model(model)
    print("| fault | made at step | requests it touched | of which outputs differ from the clean run | "
          "SGLang's KV canary |\n| --- | --- | --- | --- | --- |")
    for name in argv[2:] or list(PHASED):
        for row in compare(out, model, name):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
