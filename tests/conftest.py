"""Shared test configuration: GPU tests are skipped when no CUDA device is present; each test starts
without otel-swa's "already warned" marker, so that warnings logged once per process tree are
seen by the test that expects them; torch runs on one intra-op thread in the test process."""

import pytest
import torch

from otel_swa import environment_variables as ev


# The tests' tensors are small: on a loaded 2-core machine torch's thread pool spent most of their
# time waking its threads (an SWA audit at every step of 30 requests: 27 s on the default threads,
# 2.5-3 s on one). Subprocesses keep their own settings (otel-swa replay uses one thread already).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_warned_marker(monkeypatch):
    monkeypatch.delenv(ev.OTEL_SWA_WARNED, raising=False)


@pytest.fixture(scope="session")
def agent_binary():
    """The ``rotel-agent`` collector binary; skipped when missing, except in CI (``CI`` set), where
    a missing collector fails."""
    from collector_support import rotel_agent

    return _binary_or_skip(rotel_agent(), "rotel-agent is required in CI (pip install rotel)",
                           "rotel-agent not installed (pip install rotel)")


@pytest.fixture(scope="session")
def prometheus_binary():
    """The ``prometheus`` server binary (Debian's ``prometheus`` package); skipped when missing,
    except in CI (``CI`` set), where a missing Prometheus fails."""
    from otel_swa.testing.prometheus import prometheus_binary as find

    return _binary_or_skip(find(), "the prometheus binary is required in CI (apt-get install prometheus)",
                           "prometheus not installed (apt-get install prometheus)")


def _binary_or_skip(path, in_ci: str, elsewhere: str):
    """``path`` (a binary found), else the test fails with ``in_ci`` in CI (``CI`` set) and is skipped
    with ``elsewhere`` otherwise."""
    import os

    if path is None:
        if os.environ.get("CI"):
            pytest.fail(in_ci)
        pytest.skip(elsewhere)
    return path
