"""Side by side with other revisions of otel-swa: each revision's ``otel_swa`` unpacked from git into a
temporary folder (``git archive``), and a child process per revision that imports it from there.

A benchmark that compares revisions runs its own measuring code (the current file) in each child,
with ``PYTHONPATH`` set to the revision's folder, so the child's ``import otel_swa`` is that
revision's; the measuring code uses only what every compared revision has (the public API).
``WORKTREE`` names the working tree itself (uncommitted changes included) and is the default "yours".
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["WORKTREE", "ISSUE_REVISIONS", "unpacked", "run_child", "label"]

REPO = Path(__file__).resolve().parent.parent
#: The working tree as it is (not a commit).
WORKTREE = "worktree"
#: The revisions of the performance issue's table: the commit it was filed against ("before"),
#: main when it was filed ("now"), and this working tree.
ISSUE_REVISIONS = ("8e6be61", "9d98197", WORKTREE)


def label(rev: str) -> str:
    """How a revision is named in a table (the commit's short hash, or ``worktree``)."""
    if rev == WORKTREE:
        return WORKTREE
    try:
        return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return rev


@contextlib.contextmanager
def unpacked(revisions: Sequence[str]) -> Iterator[dict[str, str]]:
    """``{revision: folder}``: each revision's ``otel_swa`` package in a temporary folder to put on
    ``PYTHONPATH`` (the working tree's own root for :data:`WORKTREE`). Removed on exit."""
    with tempfile.TemporaryDirectory(prefix="otel-swa-revisions-") as tmp:
        roots = {}
        for rev in revisions:
            if rev == WORKTREE:
                roots[rev] = str(REPO)
                continue
            root = os.path.join(tmp, rev.replace("/", "_"))
            os.makedirs(root)
            archive = subprocess.run(["git", "archive", rev, "otel_swa"], cwd=REPO, check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
            roots[rev] = root
        yield roots


def run_child(root: str, argv: Sequence[str], env: "dict[str, str] | None" = None, timeout_s: float = 3600) -> object:
    """Run ``python argv...`` with ``root`` first on ``PYTHONPATH`` and torch on one thread; return
    the JSON value its last line of output holds.

    Raises:
        RuntimeError: the child failed (its output's tail in the message).
    """
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    child_env.setdefault("OMP_NUM_THREADS", "1")
    run = subprocess.run([sys.executable, *argv], env=child_env, capture_output=True, text=True, timeout=timeout_s)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} with {root} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])
