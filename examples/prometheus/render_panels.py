"""Draw every panel of the Grafana dashboard from a Prometheus server, with matplotlib: what the
dashboard shows, before Grafana is installed.

Each row of ``examples/grafana/otel-swa-dashboard.json`` (fleet, per host, per rank) becomes one
PNG laid out on Grafana's 24-column grid; each panel draws the ``/api/v1/query_range`` result of
each of its queries, one line per series, named by the query's ``legendFormat``.

Against your own Prometheus (the last 30 minutes, every service and host)::

    python examples/prometheus/render_panels.py --prometheus http://localhost:9090 --out docs/

Or on a replay, with a Prometheus started here (the ``prometheus`` binary on PATH, Debian's
``apt-get install prometheus``; loopback only, its own data directory, stopped at the end)::

    python examples/prometheus/render_panels.py --replay --out docs/

which runs ``otel-swa replay --exporter prometheus,logline`` (the default 200 requests; more
``otel-swa replay`` options after ``--``) scraped every 250 ms, and draws the run.

What cannot work is refused first, in one line on stderr and exit status 2, before anything is
created or drawn: matplotlib missing, no ``prometheus`` binary for ``--replay``, a
``--prometheus`` URL that is not http(s) or does not answer, an ``--out`` that is a file, a
``--minutes`` that is not a positive number.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from otel_swa.testing.prometheus import (
    PrometheusAPI,
    PrometheusError,
    PrometheusServer,
    dashboard_targets,
    free_port,
    grafana_expr,
    prometheus_binary,
)

DASHBOARD = Path(__file__).resolve().parents[1] / "grafana" / "otel-swa-dashboard.json"


def _legend(template: str, labels: dict) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return " ".join(text.split()) or "{" + ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") + "}"


def _slug(title: str) -> str:
    word = title.split(":")[0].split(" (")[0]
    return re.sub(r"[^a-z0-9]+", "-", word.lower()).strip("-")


def render(prometheus, start: float, end: float, out: Path, variables: dict, rate_interval: str,
           step: float, dashboard: Path = DASHBOARD) -> list[tuple[Path, list[str]]]:
    """Draw each row of ``dashboard`` from ``prometheus`` (a :class:`~otel_swa.testing.prometheus.PrometheusAPI`)
    over ``[start, end]``; returns each PNG written (``dashboard-<row>.png``) with the titles of its
    panels that had no data.

    Raises:
        ImportError: matplotlib is missing (``pip install 'otel-swa[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, dict[str, list]] = {}
    for target in dashboard_targets(dashboard):
        if not target.is_variable:
            rows.setdefault(target.row, {}).setdefault(target.panel, []).append(target)
    written = []
    for row, panels in rows.items():
        empty: list[str] = []
        bottom = max(t.grid[1] + t.grid[3] for targets in panels.values() for t in targets)
        top = min(t.grid[1] for targets in panels.values() for t in targets)
        lines = -(-(bottom - top) // 8)  # Grafana panels here are 8 grid units high
        fig = plt.figure(figsize=(18, 3.4 * lines + 0.6))
        grid = fig.add_gridspec(lines, 24, hspace=0.55, wspace=2.5)
        for title, targets in panels.items():
            x, y, w, h = targets[0].grid
            line = (y - top) // 8
            ax = fig.add_subplot(grid[line : line + max(1, h // 8), x : x + w])
            drawn = 0
            for target in targets:
                expr = grafana_expr(target.expr, variables, rate_interval=rate_interval)
                for series in prometheus.query_range(expr, start, end, step):
                    times = [float(t) - start for t, _ in series["values"]]
                    values = [float(v) for _, v in series["values"]]
                    ax.plot(times, values, linewidth=1, label=_legend(target.legend, series["metric"]))
                    drawn += 1
            ax.set_title(title, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.set_xlabel("seconds", fontsize=7)
            if drawn:
                ax.legend(fontsize=6, loc="best")
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
                empty.append(title)
        fig.suptitle(row, fontsize=10)
        path = out / f"dashboard-{_slug(row)}.png"
        fig.savefig(path, dpi=80, bbox_inches="tight")
        plt.close(fig)
        written.append((path, empty))
    return written


class Refused(Exception):
    """What cannot work, in one line (exit status 2)."""


def _reachable(url: str) -> None:
    """Refuse a URL that is not http(s) or whose Prometheus does not answer ``/api/v1/status/buildinfo``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise Refused(f"--prometheus {url!r} is not an http(s) URL; expected e.g. http://localhost:9090")
    try:
        PrometheusAPI(url).api("status/buildinfo", timeout_s=10)
    except (OSError, ValueError, PrometheusError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise Refused(f"no Prometheus answers at --prometheus {url!r}: {why}") from None


def _check(args: argparse.Namespace) -> None:
    """Refuse, in one line, what cannot work (module docstring), before anything is created."""
    if importlib.util.find_spec("matplotlib") is None:
        raise Refused("matplotlib is not installed: pip install 'otel-swa[plot]'")
    if not args.minutes > 0 or args.minutes == float("inf"):
        raise Refused(f"--minutes {args.minutes:g} is not a positive number of minutes")
    if args.out.exists() and not args.out.is_dir():
        raise Refused(f"--out {str(args.out)!r} is a file; expected a directory (created if missing)")
    if args.replay and prometheus_binary() is None:
        raise Refused("--replay starts a Prometheus, and there is no prometheus binary on PATH "
                      "(apt-get install prometheus), or use --prometheus URL")
    if args.prometheus:
        _reachable(args.prometheus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", metavar="URL", help="a running Prometheus, e.g. http://localhost:9090")
    source.add_argument("--replay", action="store_true", help="start a Prometheus here and draw an otel-swa replay")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory of the PNGs (default: .)")
    parser.add_argument("--minutes", type=float, default=30.0, help="with --prometheus: the last N minutes (default 30)")
    parser.add_argument("--service", default=".*", help="the dashboard's $service, a regular expression (default: all)")
    parser.add_argument("--host", default=".*", help="the dashboard's $host (default: all)")
    parser.add_argument("--rate-interval", default=None, help="$__rate_interval (default 1m; with --replay 1s)")
    parser.add_argument("replay_args", nargs="*", help="with --replay: options for otel-swa replay (after --)")
    args = parser.parse_args(argv)
    try:
        _check(args)
        args.out.mkdir(parents=True, exist_ok=True)
        return _draw(args)
    except (Refused, PrometheusError, OSError) as exc:
        print(f"render_panels.py: {exc}", file=sys.stderr)
        return 2


def _draw(args: argparse.Namespace) -> int:
    variables = {"service": args.service, "host": args.host}
    if args.prometheus:
        end = time.time()
        paths = render(PrometheusAPI(args.prometheus), end - args.minutes * 60, end, args.out, variables,
                       args.rate_interval or "1m", step=max(1.0, args.minutes * 60 / 600))
    else:
        port = free_port()
        with tempfile.TemporaryDirectory() as directory, PrometheusServer(
                directory, [{"job_name": "otel-swa-replay", "targets": [f"127.0.0.1:{port}"]}],
                scrape_interval="250ms") as prom:
            env = {**os.environ, "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
                   "OTEL_SWA_PROMETHEUS_LINGER": "10", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "otel,host"}
            start = time.time()
            run = subprocess.run([sys.executable, "-m", "otel_swa.cli", "replay", "--no-progress", "--exporter",
                                  "prometheus,logline", *args.replay_args], env=env, stdout=subprocess.DEVNULL)
            if run.returncode not in (0, 1):
                return run.returncode
            end = time.time()
            paths = render(prom, start, end, args.out, variables, args.rate_interval or "1s", step=0.25)
    for path, empty in paths:
        print(path, f"(no data: {', '.join(empty)})" if empty else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
