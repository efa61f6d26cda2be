"""Forked and spawned children against a real collector (rotel): no flood, no parent numbers
exported twice, each process its own series.

Each case runs a small program in a subprocess: the parent sets up ``configure(exporters="otlp")``
(gRPC), takes 44 forward steps with a reporter at interval 4, starts a child, waits for it and
exits (the SDK's exit hooks export). What reaches the collector is compared with what each process
counted, by the ``process.pid`` on the resource.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from collector_support import RotelCollector

pytestmark = pytest.mark.collector

PARENT_STEPS = 44
CHILD_STEPS = 12

COMMON = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from otel_swa.reporter import SwaDivergenceReporter
    from otel_swa.telemetry import configure
    from otel_swa.views import SwaBatch

    EMPTY = torch.zeros(0, dtype=torch.int64)
    VIEW = SwaBatch(torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int64), EMPTY, EMPTY, ())

    def run(reporter, steps):
        for _ in range(steps):
            reporter.observe("full", 3)
            reporter.step(VIEW)

    def own_pipeline(steps):
        telemetry = configure(exporters="otlp")
        reporter = telemetry.attach(SwaDivergenceReporter(4))
        run(reporter, steps)
        reporter.close()
        telemetry.shutdown()
    """
)

FORK_CLOSING_DESCRIPTORS = COMMON + textwrap.dedent(
    f"""
    telemetry = configure(exporters="otlp")
    reporter = telemetry.attach(SwaDivergenceReporter(4))
    run(reporter, {PARENT_STEPS})
    pid = os.fork()
    if pid == 0:  # a daemon-style child: closes what it inherited, then lives a while
        os.closerange(3, 4096)
        time.sleep(1.5)  # three of the SDK's 0.5 s export intervals
        os._exit(0)
    os.waitpid(pid, 0)
    """
)

MULTIPROCESSING_FORK_COUNTING = COMMON + textwrap.dedent(
    f"""
    import multiprocessing as mp

    def child():
        run(reporter, {CHILD_STEPS})  # the inherited reporter, in the child
        time.sleep(1.0)  # the SDK's export threads run in the child meanwhile (two 0.5 s intervals)

    if __name__ == "__main__":
        telemetry = configure(exporters="otlp")
        reporter = telemetry.attach(SwaDivergenceReporter(4))
        run(reporter, {PARENT_STEPS})
        proc = mp.get_context("fork").Process(target=child)
        proc.start(); proc.join()
        assert proc.exitcode == 0
    """
)

SPAWN = COMMON + textwrap.dedent(
    f"""
    import multiprocessing as mp

    def torch_entry(rank, steps):  # torch.multiprocessing.spawn calls fn(rank, *args)
        own_pipeline(steps)

    if __name__ == "__main__":  # one child started each way, one after the other
        telemetry = configure(exporters="otlp")
        reporter = telemetry.attach(SwaDivergenceReporter(4))
        run(reporter, {PARENT_STEPS})
        proc = mp.get_context("spawn").Process(target=own_pipeline, args=({CHILD_STEPS},))
        proc.start(); proc.join()
        assert proc.exitcode == 0
        import torch.multiprocessing as tmp
        tmp.spawn(torch_entry, args=({CHILD_STEPS + 4},), nprocs=1, join=True)
    """
)


def _run(agent, tmp_path, program: str, *args: str, protocol: str = "grpc"):
    script = tmp_path / "program.py"
    script.write_text(program)
    with RotelCollector(agent, tmp_path) as collector:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update({
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint(protocol),
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_METRIC_EXPORT_INTERVAL": "500",  # the SDK's reader thread exports in the child too
        })
        run = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, collector.seen()


def _forward_steps_by_pid(seen) -> dict:
    """process.pid -> the kv_cache.swa.forward_steps values that process exported (cumulative)."""
    out: dict = {}
    for metric in seen["metrics"]:
        if metric.get("name") == "kv_cache.swa.forward_steps":
            pid = metric["resource"].get("process.pid")
            out.setdefault(pid, []).extend(p["value"] for p in metric["points"])
    return out


def test_a_forked_child_closing_its_descriptors_neither_floods_nor_exports(agent_binary, tmp_path):
    run, seen = _run(agent_binary, tmp_path, FORK_CLOSING_DESCRIPTORS)
    # gRPC's "Completion queue next failed ... Bad file descriptor": ~500,000 lines in 2.5 s (here 1.5) when
    # the child's inherited exporters talk over the parent's channel
    assert len(run.stderr.splitlines()) <= 2, run.stderr[:2000]
    by_pid = _forward_steps_by_pid(seen)
    assert len(by_pid) == 1  # the parent only
    assert set(next(iter(by_pid.values()))) == {float(PARENT_STEPS - PARENT_STEPS % 4)}


def test_a_forked_child_never_exports_the_parents_numbers_again(agent_binary, tmp_path):
    run, seen = _run(agent_binary, tmp_path, MULTIPROCESSING_FORK_COUNTING)
    by_pid = _forward_steps_by_pid(seen)
    # one series, the parent's 44 steps: the child's inherited pipeline exported nothing, neither
    # the parent's cumulative 44 again nor a total counted on top of it
    assert len(by_pid) == 1, by_pid
    assert set(next(iter(by_pid.values()))) == {float(PARENT_STEPS)}


def test_a_spawned_child_exports_its_own_series(agent_binary, tmp_path):
    # a child of multiprocessing's spawn (CHILD_STEPS steps), then one of torch.multiprocessing.spawn
    # (CHILD_STEPS + 4), in one program: each its own series beside the parent's
    run, seen = _run(agent_binary, tmp_path, SPAWN)
    by_pid = _forward_steps_by_pid(seen)
    assert len(by_pid) == 3, by_pid  # distinct process.pid on each resource
    assert sorted(max(values) for values in by_pid.values()) == [
        float(CHILD_STEPS), float(CHILD_STEPS + 4), float(PARENT_STEPS)]


FORK_BY_HAND_COUNTING = COMMON + textwrap.dedent(
    """
    import io, logging
    telemetry = configure(exporters="none")
    lines = []
    reporter = telemetry.attach(SwaDivergenceReporter(1, sinks=[lambda r, c: lines.append(r.forward_ct)]))
    run(reporter, 3)
    pid = os.fork()
    if pid == 0:
        lines.clear()
        run(reporter, 2)  # the child's own steps, on the reporter it inherited
        reporter.flush()
        print("child", lines, reporter.forward_ct, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    reporter.flush()
    print("parent", lines, reporter.forward_ct, flush=True)
    """
)


def test_a_reporter_attached_by_hand_starts_from_zero_in_a_forked_child(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(FORK_BY_HAND_COUNTING)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines())
    assert out["child"] == "[1, 2] 2"  # not the parent's 4, 5: its totals are the child's own
    assert out["parent"] == "[1, 2, 3] 3"


FORK_OVER_HTTP_CLOSING_DESCRIPTORS = COMMON + textwrap.dedent(
    f"""
    telemetry = configure(exporters="otlp")
    reporter = telemetry.attach(SwaDivergenceReporter(4))
    run(reporter, {PARENT_STEPS})
    reporter.flush()
    telemetry.force_flush()  # the exporters' connections to the collector are open now
    pid = os.fork()
    if pid == 0:  # a daemon-style child: closes what it inherited, then exits normally
        os.closerange(3, 4096)
        sys.exit(0)
    os.waitpid(pid, 0)
    """
)


def test_a_forked_child_over_http_exits_without_closing_the_parents_sockets(agent_binary, tmp_path):
    # urllib3 closes a pool's sockets when the pool is finalized: in the child, after closerange,
    # that was "OSError: [Errno 9] Bad file descriptor" twice (or a descriptor the child reopened)
    run, seen = _run(agent_binary, tmp_path, FORK_OVER_HTTP_CLOSING_DESCRIPTORS, protocol="http/protobuf")
    assert "Bad file descriptor" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
    by_pid = _forward_steps_by_pid(seen)
    assert len(by_pid) == 1 and set(next(iter(by_pid.values()))) == {float(PARENT_STEPS - PARENT_STEPS % 4)}


FORK_LINE_SINK = COMMON + textwrap.dedent(
    """
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    telemetry = configure(exporters="logline")
    reporter = telemetry.attach(SwaDivergenceReporter(1))
    run(reporter, 3)
    reporter.flush()
    pid = os.fork()
    if pid == 0:
        print("child", os.getpid(), file=sys.stderr, flush=True)
        run(reporter, 2)
        reporter.flush()
        sys.exit(0)
    os.waitpid(pid, 0)
    print("parent", os.getpid(), file=sys.stderr, flush=True)
    """
)


def test_a_forked_childs_line_sink_writes_its_own_run_start_marker(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(FORK_LINE_SINK)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    pids = dict(line.split(" ") for line in lines if line.split(" ")[0] in ("child", "parent"))
    markers = [line for line in lines if "otel_swa_run_start=" in line]
    assert markers == [f'otel_swa[verify=attention] otel_swa_run_start={{"pid":{pids["parent"]}}}',
                       f'otel_swa[verify=attention] otel_swa_run_start={{"pid":{pids["child"]}}}']
    child_marker = lines.index(markers[1])
    child_records = [i for i, line in enumerate(lines) if "kv_canary_swa_divergence=" in line][3:]
    assert len(child_records) == 2 and child_marker < child_records[0]  # its marker before its first record
    assert "went back" not in run.stderr  # the child's counts from 0 are no restart of the parent's
    from otel_swa.testing import judge
    from otel_swa.testing.runs import split_runs
    from otel_swa.logsource import logged_entries
    observation = judge(split_runs(logged_entries(run.stderr)))
    (group,) = observation.groups
    assert group.run == 2 and group.records == 2 and group.last.forward_ct == 2  # the child's run
