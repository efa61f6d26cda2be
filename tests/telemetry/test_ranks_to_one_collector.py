"""2 processes under ``torch.distributed`` (gloo, loopback) into one collector (rotel).

Each rank runs the reference engine (no model math) on its share of a slice of the packaged trace
(requests ``rank, rank + world, ...``) with a reporter at interval 10, ``configure()`` exporting
OTLP and writing the SGLang line through Python logging into ONE file shared by every rank, with
SGLang's log prefix (``[time TP<rank>]``). Nothing tells ``configure()`` the rank: it comes from
the initialised process group. Expected values: each rank's own engine counts (its forward steps
and the last record it delivered, printed by that rank) and its lines in the shared file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from collector_support import RotelCollector, free_port, int_value

from otel_swa.record import find_all

pytestmark = pytest.mark.collector

PROGRAM = textwrap.dedent(
    """
    import json, logging, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, world, port, log_path, out_dir):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        handler = logging.FileHandler(log_path)  # every rank appends to the same file
        handler.setFormatter(logging.Formatter(f"[%(asctime)s TP{rank}] %(message)s", "%Y-%m-%d %H:%M:%S"))
        logging.getLogger("otel_swa").addHandler(handler)
        from otel_swa.reference.engine import EngineConfig, ReferenceEngine
        from otel_swa.reference.trace import load_trace
        from otel_swa.reporter import SwaDivergenceReporter
        from otel_swa.telemetry import configure

        telemetry = configure(exporters="otlp,logline")
        records = []
        reporter = telemetry.attach(SwaDivergenceReporter(10, sinks=[lambda r, c: records.append(r.to_dict())]))
        engine = ReferenceEngine(EngineConfig(window=64, full_pool_size=65536, swa_pool_size=2048, max_running=16,
                                              token_budget=512, max_context_len=16384, step_time_s=0.0,
                                              run_model=False), reporter=reporter)
        for request in load_trace("conv", limit=24)[rank::world]:
            engine.submit(request, arrival_s=0.0)
        engine.run_until_done()
        dist.barrier()
        reporter.close()
        resource = dict(telemetry.resource.attributes)
        telemetry.shutdown()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"forward_ct": reporter.forward_ct, "last": records[-1], "records": len(records),
                       "resource": {k: v for k, v in resource.items() if k.startswith(("otel_swa.", "process."))}}, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        world, port, log_path, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
        mp.spawn(rank_main, args=(world, port, log_path, out_dir), nprocs=world, join=True)
    """
)


# 2 ranks: 4 checked the same things (one series per rank with its exact totals, its lines under its
# own prefix in the one shared file) at two more process starts, each importing torch (on 2 cores
# the 4 ranks took twice the time of 2)
@pytest.mark.parametrize("world", [2])
def test_every_rank_is_its_own_series_with_its_exact_totals(agent_binary, tmp_path, world):
    script = tmp_path / "ranks.py"
    script.write_text(PROGRAM)
    log_path = tmp_path / "all-ranks.log"
    with RotelCollector(agent_binary, tmp_path) as collector:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint("grpc"), "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                    "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_METRIC_EXPORT_INTERVAL": "600000"})
        run = subprocess.run([sys.executable, str(script), str(world), str(free_port()), str(log_path), str(tmp_path)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}
    for r, info in ranks.items():
        assert info["resource"]["otel_swa.rank"] == r and info["resource"]["otel_swa.world_size"] == world

    # at the collector: one kv_cache.swa.forward_steps / entries.verified series per rank, equal to
    # that rank's last delivered record
    seen = collector.seen()
    by_rank: dict[int, dict[str, float]] = {}
    for metric in seen["metrics"]:
        rank = metric["resource"].get("otel_swa.rank")
        if rank is None or metric.get("name") not in ("kv_cache.swa.forward_steps", "kv_cache.swa.entries.verified"):
            continue
        for point in metric["points"]:
            key = metric["name"] + ("/" + point["attributes"]["pool"] if "pool" in point["attributes"] else "")
            by_rank.setdefault(int_value(rank), {})[key] = point["value"]
    assert sorted(by_rank) == list(range(world))
    for r, info in ranks.items():
        last = info["last"]
        assert by_rank[r] == {
            "kv_cache.swa.forward_steps": last["forward_ct"],
            "kv_cache.swa.entries.verified/Str(full)": last["verify_full"],
            "kv_cache.swa.entries.verified/Str(swa)": last["verify_swa"],
        }, r
    # ranks really did different work
    assert len({info["last"]["verify_full"] for info in ranks.values()}) == world

    # the shared log file: each rank's lines under its own prefix, in its own order
    text = log_path.read_text()
    for r, info in ranks.items():
        lines = [line for line in text.splitlines() if f" TP{r}] " in line]
        records = find_all("\n".join(lines))
        assert len(records) == info["records"] and records[-1].to_dict() == info["last"]
        assert [rec.forward_ct for rec in records] == list(range(10, 10 * len(records) + 1, 10))
    # and otel-swa check judges every rank of the one file on its own
    check = subprocess.run([sys.executable, "-m", "otel_swa.cli", "check", str(log_path)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "judged each rank on its own" in check.stdout
    for r, info in ranks.items():
        assert f"TP{r}: ok, {info['records']} record(s)" in check.stdout
