"""The commands and the examples refuse what cannot work in one line (exit status 2) before their
heavy imports (torch, matplotlib) and before they create anything.

Each check runs in a fresh interpreter, so modules imported by other tests do not count.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RENDER = ROOT / "examples" / "prometheus" / "render_panels.py"
ENGINE = ROOT / "examples" / "engine_by_hand.py"
#: run a script or the CLI as __main__, then say its exit status and whether torch was imported
WRAPPER = (
    "import runpy, sys\n"
    "target, sys.argv = sys.argv[1], sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(target, run_name='__main__') if target.endswith('.py') else runpy.run_module(target, "
    "run_name='__main__')\n"
    "except SystemExit as exc:\n"
    "    print('exit', exc.code)\n"
    "print('torch' in sys.modules, 'matplotlib' in sys.modules)\n"
)


def _run(target, *args, env=None):
    env = dict(os.environ if env is None else env)
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_") or k in ("OTEL_SWA_DIVERGENCE_INTERVAL",
                                                                             "OTEL_EXPORTER_PROMETHEUS_HOST")}
    proc = subprocess.run([sys.executable, "-c", WRAPPER, str(target), *args], capture_output=True, text=True,
                          timeout=120, env=env)
    lines = proc.stdout.strip().splitlines()
    return lines[-2:], proc.stderr.splitlines()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_replay_refuses_a_missing_trace_before_importing_torch(tmp_path):
    missing = tmp_path / "missing.csv"
    out, err = _run("otel_swa.cli", "replay", "--trace", str(missing))
    assert out == ["exit 2", "False False"]
    assert err == [f"otel-swa replay: trace {str(missing)!r} is not a file; expected a CSV path or one of code, conv"]


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:{port}", "[Errno 111] Connection refused"),
    ("ftp://127.0.0.1:{port}", None),
])
def test_render_panels_refuses_a_prometheus_that_cannot_answer(tmp_path, url, why):
    url = url.format(port=_closed_port())
    out_dir = tmp_path / "panels"
    out, err = _run(RENDER, "--prometheus", url, "--out", str(out_dir))
    assert out == ["exit 2", "False False"]
    if why is None:
        assert err == [f"render_panels.py: --prometheus {url!r} is not an http(s) URL; expected e.g. "
                       "http://localhost:9090"]
    else:
        assert err == [f"render_panels.py: no Prometheus answers at --prometheus {url!r}: {why}"]
    assert not out_dir.exists()  # nothing created for a run that cannot draw


def test_render_panels_replay_without_a_prometheus_binary(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    out_dir = tmp_path / "panels"
    out, err = _run(RENDER, "--replay", "--out", str(out_dir), env={**os.environ, "PATH": str(empty)})
    assert out == ["exit 2", "False False"]
    assert err == ["render_panels.py: --replay starts a Prometheus, and there is no prometheus binary on PATH "
                   "(apt-get install prometheus), or use --prometheus URL"]
    assert not out_dir.exists()


def test_render_panels_refuses_an_out_that_is_a_file(tmp_path):
    target = tmp_path / "panels.png"
    target.write_text("")
    out, err = _run(RENDER, "--prometheus", f"http://127.0.0.1:{_closed_port()}", "--out", str(target))
    assert out == ["exit 2", "False False"]
    assert err == [f"render_panels.py: --out {str(target)!r} is a file; expected a directory (created if missing)"]


@pytest.mark.parametrize("args, env, line", [
    (["--exporters", "bogus"], {}, "engine_by_hand.py: exporter 'bogus' is unknown; expected one or more of otlp, "
                                   "console, logline, prometheus, none"),
    ([], {"OTEL_SWA_DIVERGENCE_INTERVAL": "x"}, "engine_by_hand.py: OTEL_SWA_DIVERGENCE_INTERVAL='x': expected an "
                                                "integer >= 0"),
])
def test_engine_by_hand_refuses_before_importing_torch(args, env, line):
    out, err = _run(ENGINE, *args, env={**os.environ, **env})
    assert out == ["exit 2", "False False"]
    assert err == [line]


@pytest.mark.parametrize("host, what", [("no-such-host.invalid", "does not resolve"),
                                        ("192.0.2.7", "is not an address of this host")])
def test_a_prometheus_host_that_is_not_this_host_is_named_not_the_port(host, what):
    # was: "...; give each process of a host its own port (OTEL_EXPORTER_PROMETHEUS_PORT, ...)"
    out, err = _run("otel_swa.cli", "replay", "--requests", "2", "--no-model", "--no-progress", "--exporter",
                    "prometheus", env={**os.environ, "OTEL_EXPORTER_PROMETHEUS_HOST": host})
    assert out[0] == "exit 2"
    assert len(err) == 1, err
    assert err[0].startswith(f"otel-swa replay: the Prometheus endpoint cannot listen on {host}:9464: "
                             f"OTEL_EXPORTER_PROMETHEUS_HOST={host!r} {what} (")
    assert err[0].endswith("); expected an address or a name of this host (localhost, 0.0.0.0 for every interface)")
