"""One engine process exporting through ``OTEL_METRICS_EXPORTER=prometheus``, paced so that a real
Prometheus scrapes every record it delivers. Started by ``tests/telemetry/test_prometheus.py``
(one process per rank, with the launcher's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` as torchrun
sets them).

The reference engine replays a slice of the packaged trace (rank ``r`` of ``w`` takes requests
``r, r + w, ...``) with ``configure(exporters="prometheus,logline")``: its metrics on the endpoint
``OTEL_EXPORTER_PROMETHEUS_PORT`` + ``LOCAL_RANK``, SGLang's line through Python logging into
``rank<r>.log``. After each sampled step it delivers the record (``reporter.flush()``), recounts
the pools from the engine's own tensors (FULL pages of every live token, SWA pages its mapping
points to, plus the pages the leak fault took), and waits until Prometheus holds a scrape of this
record that began after that moment: the state of that scrape is the recounted one. After the run
it does the same once more and waits for ``<out>/done``, so that the test queries every rank while
all of them hold still.

Usage: ``python prometheus_run.py OUT_DIR SERVICE REQUESTS PROMETHEUS_URL INSTANCE [LEAK_EVERY]``.
Writes ``OUT_DIR/rank<r>.json``: the pauses (``forward_ct``, ``scraped_at``: the timestamp of that
scrape, ``pools``), the delivery delays seen by a sink, the SWA KV bytes per token from the KV
tensors' sizes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

INTERVAL = 10


def scraped_at(prometheus: str, instance: str, forward_ct: int, after: float, timeout_s: float = 60.0) -> float:
    """The timestamp of the first scrape of ``instance`` that began after ``after`` and holds
    ``kv_cache_swa_forward_steps_total == forward_ct`` (raw samples of the last minute)."""
    query = urllib.parse.urlencode({"query": f'kv_cache_swa_forward_steps_total{{instance="{instance}"}}[1m]'})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{prometheus}/api/v1/query?{query}", timeout=10) as reply:
            result = json.loads(reply.read())["data"]["result"]
        for series in result:
            for t, v in series["values"]:
                if t > after and float(v) == forward_ct:
                    return t
        time.sleep(0.02)
    raise TimeoutError(f"{instance}: no scrape of forward_ct {forward_ct} after {after} within {timeout_s} s")


def recount(engine, leaked_pages: int) -> dict:
    """Slots in use per pool, from the engine's tensors: whole pages of the live tokens' FULL slots
    (``req_to_token``) and of their SWA slots (``full_to_swa_index_mapping``, 0 = none), plus the
    pages the leak fault took off the SWA free list."""
    pools = engine.pools
    ps = pools.page_size
    full_pages, swa_pages = set(), set()
    for slots in pools.requests.values():
        full = pools.req_to_token[slots.row, : slots.seq_len].long()
        full_pages.update((full // ps).tolist())
        swa = pools.full_to_swa_index_mapping[full]
        swa_pages.update((swa[swa != 0] // ps).tolist())
    return {"full": len(full_pages) * ps, "swa": (len(swa_pages) + leaked_pages) * ps}


def main() -> None:
    out, service, requests, prometheus, instance = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    leak_every = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    import torch

    torch.set_num_threads(1)
    handler = logging.FileHandler(out / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"[%(asctime)s TP{rank}] %(message)s", "%Y-%m-%d %H:%M:%S"))
    logging.getLogger("otel_swa").addHandler(handler)
    leaked = {"leaked": 0}
    if leak_every:
        import pytest

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
        import leaky_swa_pool

        leaked = leaky_swa_pool.install(pytest.MonkeyPatch(), every=leak_every)

    from otel_swa.reference.config import EngineConfig
    from otel_swa.reference.replay import replay
    from otel_swa.reference.trace import load_trace
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import configure

    telemetry = configure(exporters="prometheus,logline", default_service_name=service)
    reporter = SwaDivergenceReporter(INTERVAL, device="cpu")
    delays: list[int] = []
    reporter.add_sink(lambda record, context: delays.append(reporter.forward_ct - record.forward_ct))
    telemetry.attach(reporter)
    pools = telemetry.pools
    engines: list = []
    last: list[int] = []
    reporter.add_sink(lambda record, context: last.append(record.forward_ct))

    def on_engine(engine) -> None:
        engines.append(engine)
        pools.register(lambda e: e.pools.usage(), owner=engine)
        reporter.add_sink(pools.savings_sink(engine.kv.swa_bytes_per_token))

    pauses: list[dict] = []

    def pause() -> None:
        reporter.flush()
        state = recount(engines[0], leaked["leaked"])
        start = time.time()
        pauses.append({"forward_ct": last[-1], "pools": state, "scraped_at": scraped_at(prometheus, instance, last[-1], start)})

    def on_step(result) -> None:
        if result.forward_ct % INTERVAL == 0:
            pause()

    config = dataclasses.replace(EngineConfig(), window=64, full_pool_size=16384, swa_pool_size=2048, max_running=8,
                                 token_budget=256, max_context_len=4096)
    trace = [r for r in load_trace("conv", limit=requests)][rank::world]
    trace = [dataclasses.replace(r, context_tokens=min(r.context_tokens, 1500), generated_tokens=min(r.generated_tokens, 60))
             for r in trace]
    replay(trace, config, reporter, on_engine=on_engine, on_step=on_step)
    pause()  # the final state: every request finished
    kv = engines[0].kv
    (out / f"rank{rank}.json").write_text(json.dumps({
        "pauses": pauses, "delays": delays, "leaked_pages": leaked["leaked"],
        "swa_bytes_per_token": (kv.swa_k.nbytes + kv.swa_v.nbytes) // kv.swa_k.shape[0],
        "pool_limits": {"full": config.full_pool_size, "swa": config.swa_pool_size},
    }))
    deadline = time.monotonic() + 300
    while not (out / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    reporter.close()
    telemetry.shutdown()


if __name__ == "__main__":
    main()
