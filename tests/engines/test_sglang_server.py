"""otel-swa under SGLang's HTTP server, started as docs/engines.md says and stopped every way a user or a
supervisor stops it (markers ``sglang``, ``sglang_engine``).

Each run (``sglang_engine/server.py``) starts ``opentelemetry-instrument python -m sglang.launch_server``,
or plain ``python -m sglang.launch_server`` (the ``sigterm`` and ``sigint_main`` runs: otel-swa's
SGLang plugin, loaded by SGLang's ``load_plugins()`` in every process), with the variables of the
docs' block, on CPU with the suite's tiny hybrid-SWA model (an 8-token
window, a 160-token pool), against a real collector (``rotel-agent``); sends 12 requests of the
Azure trace, half to ``/generate`` and half to ``/v1/completions``, every other one with a W3C
``traceparent``, then 4 of them again; and stops the server one way of the issue's table:

* ``sigterm``: ``kill -TERM`` (SGLang drains, its schedulers exit on their own);
* ``sigint_group``: Ctrl-C, SIGINT to the whole process group (the schedulers end on
  KeyboardInterrupt and flush at their exit);
* ``sigint_main``: ``kill -INT`` to the main process only (uvicorn stops, ``launch_server``'s
  ``finally`` SIGKILLs the schedulers with ``kill_process_tree``);
* ``sigint_children_ignore``: Ctrl-C to the group of a server a script started in the background
  (SIGINT ignored from the start; the main process's HTTP server handles it, the schedulers keep
  ignoring it and are SIGKILLed), with the docs' plain settings and nothing else: interval 20, the
  default forward spans, the SDK's and otel-swa's default export schedules;
* ``kill_process_tree``: SGLang's ``kill_process_tree(<server pid>)`` from a supervisor, SIGKILL of
  every process, 3 s after the last answer; nothing can flush there, so the export schedules
  (1 s here) are what must have sent everything.

The other runs sample every 5 forward steps with a span at every forward step, SGLang's request
tracing on (``--enable-trace``), and otel-swa's metric schedule off (``OTEL_SWA_METRIC_EXPORT_INTERVAL=0``:
no metric point leaves before the stop unless the SDK's own 60 s schedule comes first). Every run
is judged against the forward steps the scheduler ran (the probe's recount,
``shims/sglang_cpu/sglang_step_probe.py``): every sample up to the stop is a line in the server log
and an event at the collector, every forward step has its span there, the last metric points equal
the last sample, and no process of the server outlives the stop.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_engine]

SUITE_ENV = {"OTEL_SWA_DIVERGENCE_INTERVAL": "5", "OTEL_SWA_FORWARD_SPANS": "all", "OTEL_SWA_METRIC_EXPORT_INTERVAL": "0"}
TRACED = ("--enable-trace", "--otlp-traces-endpoint", "{otlp_grpc}")

RUNS = {
    "sigterm": dict(env=SUITE_ENV, args=TRACED, launcher=False),  # the plugin: the schedulers exit on their own
    "sigint_group": dict(env=SUITE_ENV, args=TRACED),
    "sigint_main": dict(env=SUITE_ENV, args=TRACED, launcher=False),  # the plugin: flushed before SGLang kills
    "sigint_children_ignore": dict(env={}, args=()),  # docs/engines.md's block as it is
    "kill_process_tree": dict(env={**SUITE_ENV, "OTEL_SWA_METRIC_EXPORT_INTERVAL": "1000", "OTEL_BSP_SCHEDULE_DELAY": "1000"},
                              args=TRACED, idle_before_stop_s=3.0),
}
#: the runs whose main process SIGKILLs live schedulers: otel-swa's flush must come first
KILLED_BY_SGLANG = ("sigint_main", "sigint_children_ignore")


def _int(text: str) -> int:
    match = re.fullmatch(r"Int\((-?\d+)\)", text)
    assert match, text
    return int(match.group(1))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from test_sglang_engine import _require as require

    require()
    from sglang_engine.harness import build_model

    return build_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model, agent_binary):
    """``runs(name)``: the server run stopped ``name``'s way, started once for all the tests."""
    from sglang_engine.server import run_server

    done: dict = {}

    def get(name: str):
        if name not in done:
            settings = dict(RUNS[name])
            done[name] = run_server(tmp_path_factory.mktemp(name), model, agent_binary, stop=name,
                                    env=settings.pop("env"), args=settings.pop("args"), **settings)
        return done[name]

    return get


@pytest.fixture(params=list(RUNS))
def run(request, runs):
    """Each run in turn."""
    return runs(request.param)


def _interval(run) -> int:
    return int(RUNS[run.stop]["env"].get("OTEL_SWA_DIVERGENCE_INTERVAL", "20"))


def _last_points(run, name: str) -> list[dict]:
    """The newest point of each attribute set of metric ``name``."""
    newest: dict = {}
    for point in run.points(name):
        key = tuple(sorted(point["attributes"].items()))
        if key not in newest or point.get("time_unix_nano", 0) >= newest[key].get("time_unix_nano", 0):
            newest[key] = point
    return list(newest.values())


def _last_value(run, name: str, **attributes) -> float:
    points = [p for p in _last_points(run, name) if all(p["attributes"].get(k) == v for k, v in attributes.items())]
    assert len(points) == 1, (name, attributes, points)
    return points[0]["value"]


# ------------------------------------------------------------------ the server itself
def test_the_server_answers_every_request_on_both_endpoints(run):
    sent = run.sent()
    assert len(sent) == 16 and {r["endpoint"] for r in sent} == {"/generate", "/v1/completions"}
    for request in sent:
        assert request["status"] == 200, request
        assert request["completion_tokens"] == request["max_new_tokens"], request


def test_no_process_of_the_server_outlives_the_stop(run):
    assert run.leftover == []
    assert "did not confirm otel-swa's flush" not in run.log
    assert "Traceback" not in "\n".join(line for line in run.log.splitlines() if "otel_swa" in line or "otel-swa" in line)


# ------------------------------------------------------------------ nothing lost up to the stop
def test_every_sample_up_to_the_stop_is_a_line_in_the_log_and_an_event_at_the_collector(run):
    interval = _interval(run)
    expected = list(range(interval, run.forward_steps + 1, interval))
    assert expected, run.forward_steps
    assert [r.forward_ct for r in run.ours] == expected
    assert [_int(e["attributes"]["kv_cache.swa.forward_ct"]) for e in run.events()] == expected
    for record in run.ours:  # and each is the scheduler's own state at that step
        recount = run.recount(record.forward_ct)
        assert (record.swa_full_idx_divergence, record.swa_out_of_window_tokens) == (
            recount["divergence"], recount["out_of_window"]), record


def test_every_forward_step_span_up_to_the_stop_reached_the_collector(run):
    steps = sorted(_int(s["attributes"]["forward_step.forward_ct"]) for s in run.spans("forward step"))
    if RUNS[run.stop]["env"].get("OTEL_SWA_FORWARD_SPANS") == "all":
        assert steps == list(range(1, run.forward_steps + 1))
    else:  # the default: the sampled steps
        assert steps == list(range(_interval(run), run.forward_steps + 1, _interval(run)))


def test_the_last_metric_points_at_the_collector_equal_the_last_sample(run):
    last = run.ours[-1]
    assert _last_value(run, "kv_cache.swa.forward_steps") == last.forward_ct
    assert _last_value(run, "kv_cache.swa.entries.verified", pool="Str(full)") == last.verify_full
    assert _last_value(run, "kv_cache.swa.entries.verified", pool="Str(swa)") == last.verify_swa
    assert _last_value(run, "kv_cache.swa.tokens.out_of_window") == last.swa_out_of_window_tokens
    assert _last_value(run, "kv_cache.swa.tokens.divergent") == last.swa_full_idx_divergence
    assert _last_value(run, "kv_cache.swa.reporter.samples.taken") == len(run.ours)
    assert _last_value(run, "kv_cache.swa.reporter.samples.delivered") == len(run.ours)


def test_the_pool_gauges_at_the_collector_are_sglangs_idle_pools(run):
    # every request was answered before the stop: SGLang's pools hold nothing in use, its radix cache
    # keeps prefixes as evictable; the limits are SGLang's capacities (probe, after every batch)
    capacity = {pool: figures[3] for line in run.pools if line.get("at") == "run_batch"
                for pool, figures in line["sglang"].items()}
    assert capacity == {"full": 160, "swa": 128}
    flush = [line for line in run.pools if line.get("at") == "flush"]
    for pool in ("full", "swa"):
        attributes = {"pool": f"Str({pool})"}
        assert _last_value(run, "kv_cache.pool.tokens.limit", **attributes) == capacity[pool]
        assert _last_value(run, "kv_cache.pool.tokens.used", **attributes) == 0
        assert _last_value(run, "kv_cache.pool.tokens.evictable", **attributes) > 0
        if flush:  # collected inside otel-swa's flush: SGLang's own figures just before it
            figures = flush[-1]["sglang"][pool]
            for index, figure in enumerate(("used", "available", "evictable", "limit")):
                assert _last_value(run, f"kv_cache.pool.tokens.{figure}", **attributes) == figures[index], (pool, figure)


# ------------------------------------------------------------------ how each stop got there
def test_the_flush_comes_before_sglang_kills_live_schedulers_and_only_then(run):
    flush_at = run.log.find("handle_rpc_request: otel_swa_flush")
    kill_at = run.log.find("kill_process_tree called")
    if run.stop in KILLED_BY_SGLANG:
        assert 0 <= flush_at < kill_at
        assert len(run.pools) and [line["at"] for line in run.pools].count("flush") == 1
    elif run.stop == "sigint_group" and flush_at != -1:
        # Ctrl-C reaches every process of the group at once: a scheduler usually ends on its
        # KeyboardInterrupt first, but on a busy machine the main process can reach
        # launch_server's kill_process_tree while one still runs; it is then flushed, once,
        # before the kill (which of the two comes first is the OS's scheduling, not a fault)
        assert kill_at == -1 or flush_at < kill_at
        assert [line["at"] for line in run.pools].count("flush") <= 1
    else:  # the schedulers exited on their own (SIGTERM, Ctrl-C) or were killed from outside
        assert flush_at == -1


def test_after_a_supervisors_kill_the_schedule_had_exported_every_metric_point(runs):
    run = runs("kill_process_tree")
    stop_ns = int(run.results["stop_time"] * 1e9)
    times = sorted({p["time_unix_nano"] for m in run.seen["metrics"] for p in m["points"]
                    if m.get("name", "").startswith("kv_cache.")})
    # more than one collection, all before the kill, none of them a shutdown's (nothing ran one)
    assert len(times) >= 2 and times[-1] < stop_ns


@pytest.mark.parametrize("name", [name for name, settings in RUNS.items() if "--enable-trace" in settings["args"]])
def test_client_traceparents_are_the_parents_of_sglangs_request_spans_and_forward_steps_link_to_them(runs, name):
    run = runs(name)
    clients = {r["traceparent"].split("-")[1]: r["traceparent"].split("-")[2] for r in run.sent() if r["traceparent"]}
    assert len(clients) == 8
    requests = [s for s in run.seen["spans"] if re.fullmatch(r"\s*Req [0-9a-f]{1,8}", s.get("name", ""))]
    by_trace = {}
    for span in requests:
        by_trace.setdefault(span["trace_id"], []).append(span)
    for trace_id, parent in clients.items():
        assert [s.get("parent_id") for s in by_trace.get(trace_id, [])] == [parent], trace_id
    linked = {link["Trace ID"] for span in run.spans("forward step") for link in span["links"]}
    assert set(clients) <= linked


def test_the_plugin_runs_instrument_the_scheduler_as_opentelemetry_instrument_does(run):
    # the same wrappers (SGLang's HookRegistry carries those of the modules imported before its
    # load_plugins()), one reporter per scheduler, whichever way the server was started
    from test_sglang_engine import SCHEDULER_UNDER_THE_INSTRUMENTOR, SCHEDULER_UNDER_THE_PLUGIN

    (scheduler,) = [p for p in run.processes if p["role"] == "scheduler"]
    plugin = RUNS[run.stop].get("launcher", True) is False
    assert scheduler["wrappers"] == (SCHEDULER_UNDER_THE_PLUGIN if plugin else SCHEDULER_UNDER_THE_INSTRUMENTOR)
    assert scheduler["reporters"] == 1
