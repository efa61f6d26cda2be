"""A real Prometheus for tests and scripts, its HTTP API, and the queries of a Grafana dashboard.

:class:`PrometheusServer` starts the ``prometheus`` binary (Debian's ``prometheus`` package, or any
Prometheus 2.x on ``PATH``) on a loopback port with a scrape configuration and a data directory of
its own, and stops it by its process id; nothing else on the machine is touched. Its methods are
the HTTP API (``/api/v1/query``, ``/api/v1/query_range``, ``/api/v1/label/<name>/values``;
https://prometheus.io/docs/prometheus/latest/querying/api/), with the standard library only.

:func:`dashboard_targets` reads the queries of a Grafana dashboard JSON (every panel's
``targets[].expr`` and the template variables' ``label_values(...)``) and :func:`grafana_expr`
replaces Grafana's variables (``$service``, ``$host``, ``$__rate_interval``) the way Grafana does
for one selected value or "All" (``.*``).

Example::

    with PrometheusServer(tmp_path, jobs=[{"job_name": "engine", "targets": ["127.0.0.1:9464"]}]) as prom:
        prom.wait_for_series("kv_cache_swa_forward_steps_total", timeout_s=30)
        print(prom.query("max(kv_cache_swa_tokens_out_of_window)"))
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "prometheus_binary",
    "free_port",
    "PrometheusAPI",
    "PrometheusServer",
    "PrometheusError",
    "PanelTarget",
    "dashboard_targets",
    "grafana_expr",
    "label_values_query",
    "value",
]


class PrometheusError(RuntimeError):
    """Prometheus did not start, or its API answered an error (the message has its reply)."""


def prometheus_binary() -> str | None:
    """The ``prometheus`` executable on ``PATH`` (``apt-get install prometheus``), or ``None``."""
    return shutil.which("prometheus")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str, timeout_s: float) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # a bad query: 400 with Prometheus's error in the body
        body = exc.read().decode("utf-8", "replace")
        raise PrometheusError(f"{url}: HTTP {exc.code}: {body}") from None


class PrometheusAPI:
    """The HTTP API of a Prometheus server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def api(self, path: str, params: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), timeout_s: float = 30.0) -> Any:
        """``GET /api/v1/<path>?params``: the ``data`` of a successful reply.

        Raises:
            PrometheusError: an error reply (a bad query...), naming the URL and Prometheus's error.
        """
        items = params.items() if isinstance(params, Mapping) else params
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode([(k, v) for k, v in items if v is not None])
        reply = _http_json(url, timeout_s)
        if reply.get("status") != "success":
            raise PrometheusError(f"{url}: {reply.get('errorType')}: {reply.get('error')}")
        return reply["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query (``/api/v1/query``) at time ``at`` (Unix seconds; default now): the
        result's series, ``[{"metric": {labels}, "value": [t, "text"]}, ...]`` for a vector,
        ``"values"`` for a range vector selector (its raw samples)."""
        data = self.api("query", {"query": expr, "time": None if at is None else f"{at:.3f}"})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """``/api/v1/query_range``: ``[{"metric": {labels}, "values": [[t, "text"], ...]}, ...]``."""
        data = self.api("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                        "step": f"{step:g}"})
        return data["result"]

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        """``/api/v1/label/<label>/values`` (what Grafana's ``label_values(metric, label)`` asks)."""
        return self.api(f"label/{label}/values", [("match[]", match)] if match else [])

    def alerts(self) -> list[dict]:
        """``/api/v1/alerts``: the alerts pending or firing now, ``[{"labels", "annotations",
        "state", "activeAt", "value"}, ...]``."""
        return self.api("alerts")["alerts"]

    def wait_for(self, expr: str, predicate: Any = bool, timeout_s: float = 30.0, poll_s: float = 0.05) -> list[dict]:
        """Query ``expr`` until ``predicate(result)`` holds; return that result.

        Raises:
            TimeoutError: not within ``timeout_s`` (the message has the last result).
        """
        deadline = time.monotonic() + timeout_s
        result: list[dict] = []
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr}: not as expected within {timeout_s:g} s; last result {result}")
            time.sleep(poll_s)


class PrometheusServer(PrometheusAPI):
    """``with PrometheusServer(directory, jobs) as prom:`` a running Prometheus on 127.0.0.1.

    Args:
        directory: where its configuration (``prometheus.yml``), data (``data/``) and output
            (``prometheus.out``) go.
        jobs: scrape jobs: ``{"job_name": str, "targets": ["host:port", ...], "labels": {...}}``
            (``labels`` optional; ``metrics_path`` and ``scheme`` the defaults).
        scrape_interval: Prometheus duration (``"250ms"``, ``"1s"``), the same for every job.
        binary: the executable (default :func:`prometheus_binary`).
        port: where its HTTP API listens (default: a free port).
        extra_args: more command-line flags (``--enable-feature=extra-scrape-metrics``...).
        rule_files: alerting and recording rule files to load (paths).
        evaluation_interval: Prometheus duration between two evaluations of the rules.

    Raises (on entering):
        PrometheusError: no binary, or it did not become ready within ``ready_timeout_s`` (the
            message ends with its output).
    """

    def __init__(self, directory: "str | os.PathLike", jobs: Sequence[Mapping[str, Any]], *,
                 scrape_interval: str = "250ms", binary: str | None = None, port: int | None = None,
                 extra_args: Sequence[str] = (), ready_timeout_s: float = 30.0,
                 rule_files: Sequence["str | os.PathLike"] = (), evaluation_interval: str = "1m") -> None:
        self.directory = Path(directory)
        self.binary = binary or prometheus_binary()
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.scrape_interval = scrape_interval
        self.jobs = [dict(job) for job in jobs]
        self.extra_args = list(extra_args)
        self.ready_timeout_s = ready_timeout_s
        self.rule_files = [os.fspath(path) for path in rule_files]
        self.evaluation_interval = evaluation_interval
        self.config_path = self.directory / "prometheus.yml"
        self.out_path = self.directory / "prometheus.out"
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None

    def config(self) -> dict:
        """The configuration written (JSON is YAML, so Prometheus reads it as is)."""
        interval = self.scrape_interval
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": self.evaluation_interval},
            "rule_files": list(self.rule_files),
            "scrape_configs": [
                {"job_name": job["job_name"], "static_configs": [{"targets": list(job["targets"]),
                                                                  "labels": dict(job.get("labels", {}))}]}
                for job in self.jobs
            ],
        }

    def __enter__(self) -> "PrometheusServer":
        if self.binary is None:
            raise PrometheusError("no prometheus binary on PATH (apt-get install prometheus)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.config(), indent=1))
        self._out = open(self.out_path, "w")
        self._proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d", *self.extra_args],
            stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self.pid = self._proc.pid
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self._proc.returncode}: {self.output()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise PrometheusError(f"prometheus was not ready within {self.ready_timeout_s:g} s: {self.output()[-2000:]}")

    def __exit__(self, *exc_info: Any) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()  # SIGTERM to this process only: a clean TSDB close
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            self._out.close()

    def output(self) -> str:
        """What the server printed so far (its log)."""
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""


def value(series: Mapping[str, Any]) -> float:
    """The number of one instant-vector series (``"NaN"``, ``"+Inf"`` included)."""
    text = series["value"][1]
    return float(text) if text not in ("NaN",) else math.nan


@dataclass(frozen=True)
class PanelTarget:
    """One query of a dashboard.

    Attributes:
        row: title of the row the panel is in (``""`` before the first row; ``"variables"`` for a
            template variable).
        panel: the panel's title (the variable's name for a template variable).
        ref_id: the target's ``refId`` (``""`` for a variable).
        expr: the PromQL, Grafana variables unreplaced (``label_values(...)`` for a variable).
        legend: its ``legendFormat``.
        grid: the panel's ``gridPos`` (``x``, ``y``, ``w``, ``h``).
    """

    row: str
    panel: str
    ref_id: str
    expr: str
    legend: str = ""
    grid: tuple = (0, 0, 24, 8)

    @property
    def is_variable(self) -> bool:
        return self.row == "variables"


def dashboard_targets(path: "str | os.PathLike") -> list[PanelTarget]:
    """Every query of the Grafana dashboard JSON at ``path``: the template variables' queries
    first, then each panel's targets in panel order (rows as Grafana lays them out, top to bottom).

    Raises:
        ValueError: the file is not a dashboard (no ``panels`` list).
    """
    dashboard = json.loads(Path(path).read_text())
    if not isinstance(dashboard.get("panels"), list):
        raise ValueError(f"{path}: not a Grafana dashboard (no 'panels' list)")
    found = []
    for variable in dashboard.get("templating", {}).get("list", ()):
        query = variable.get("query")
        if isinstance(query, dict) and "query" in query:
            found.append(PanelTarget("variables", variable["name"], "", query["query"]))
    row = ""
    for panel in sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel.get("type") == "row":
            row = panel["title"]
            continue
        pos = panel["gridPos"]
        for target in panel.get("targets", ()):
            found.append(PanelTarget(row, panel["title"], target.get("refId", ""), target["expr"],
                                     target.get("legendFormat", ""), (pos["x"], pos["y"], pos["w"], pos["h"])))
    return found


def grafana_expr(expr: str, variables: Mapping[str, str] | None = None, rate_interval: str = "1m") -> str:
    """``expr`` with Grafana's variables replaced: ``$__rate_interval`` by ``rate_interval``, each
    ``$name`` / ``${name}`` of ``variables`` by its value (a regular expression: ``.*`` is "All").

    Raises:
        ValueError: a variable of ``expr`` is not in ``variables`` (the message names it).
    """
    variables = dict(variables or {})
    text = expr.replace("$__rate_interval", rate_interval)

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise ValueError(f"{expr!r}: no value for the dashboard variable ${name}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", substitute, text)


def label_values_query(expr: str) -> tuple[str, str]:
    """``label_values(metric, label)`` -> ``(metric, label)``.

    Raises:
        ValueError: another form.
    """
    match = re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*(\w+)\s*\)\s*", expr)
    if not match:
        raise ValueError(f"{expr!r} is not label_values(metric, label)")
    return match.group(1), match.group(2)
