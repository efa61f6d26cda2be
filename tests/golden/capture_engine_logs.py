"""Capture the otel-swa lines that the two real-engine suites write, to compare them across a change.

Runs the SGLang suite (``pytest -m sglang``, in the environment ``.ci/sglang-tests.sh`` builds) and
the vLLM suite (``pytest -m vllm``, ``.ci/vllm-tests.sh``'s environment), or only the test files
given, with ``--basetemp`` set so that every log file the tests write is kept (the SGLang Engine and
server runs write ``engine.log``: the engine process's stdout and stderr; the vLLM scheduler runs
``run.log`` / ``vllm.log``; the plugin runs ``engine.log``), then keeps, for each log file:

* ``OUT/<suite>/raw/<path under basetemp>``: the file as the test wrote it;
* ``OUT/<suite>/lines/<same path>``: its otel-swa lines, normalised: every line that holds
  ``kv_canary_swa_divergence=`` (otel-swa's and SGLang's own), ``otel_swa`` or ``otel-swa`` (a
  traceback's frames left out; of a collector's output, ``rotel.out``, only the log record bodies
  that hold otel-swa's tagged lines), otel-swa's tagged lines first and the others after them, each group
  in its order, with what varies from run to run replaced (:func:`normalise`: dates and times,
  process ids, the basetemp path, TCP ports, object addresses, durations in seconds, SGLang's
  request ids);
* ``OUT/<suite>/raw/detection/detection.json`` and ``lines/detection/detection.json``: the
  detection table's rows the zoos write (each fault made on purpose, where otel-swa first flagged
  it, its offender in words), whole, normalised;
* ``OUT/<suite>/pytest.txt``: the command, its exit status and the tail of pytest's output.

Compare two captures with ``tests/golden/compare_engine_logs.py BASE NEW`` (``--noise BASE2``, a
second capture of the base, marks the files that differ between two runs of the same commit: a CPU
engine's batching depends on timing, so not every engine log repeats).

What repeats (two captures of commit f358b45 on 2 shared CPU cores, normalised as above): every
vLLM file (22 logs and the detection rows) byte for byte (the raw vLLM logs too, but for the run
start line's pid); of the 39 SGLang files, 37, and all but one line of the other two: in the zoo's
``freed_while_mapped`` run (its ``engine.log`` and the collector's copy of its lines) the
``swa_shared_slots`` offender at forward_ct 40 named FULL slot 116 in one run and 120 in the other
(two FULL slots map to that SWA slot; why the one named changes was not traced: the holders' order
under the overlap scheduler, or ``scatter_`` with duplicate indices, whose winner PyTorch leaves
undefined). ``--noise`` takes care of such lines. The raw
SGLang logs do not repeat (SGLang's own lines carry throughput figures and timings), nor do the
collector's metric points and spans (which export carries which point is timing).

Usage (from the repository root; the worktree's code, not an installed copy, is what runs)::

    python3 tests/golden/capture_engine_logs.py OUT                    # both suites, the default files
    python3 tests/golden/capture_engine_logs.py OUT --suite sglang     # one suite
    python3 tests/golden/capture_engine_logs.py OUT --suite vllm --tests tests/engines/test_vllm_real.py
    python3 tests/golden/capture_engine_logs.py OUT --renormalise       # lines/ again from raw/, nothing run
    python3 tests/golden/capture_engine_logs.py OUT --repo ../other-tree   # another checkout's code and tests

Environments: ``--sglang-venv`` (default ``$OTEL_SWA_SGLANG_VENV`` or ``.venv-sglang``) and
``--vllm-venv`` (``$OTEL_SWA_VLLM_VENV`` or ``.venv-vllm``). ``PYTHONPATH`` is set to the repository
(and its ``instrumentation/``) so its code wins over the environment's editable install, and to this
tree's shim folders (``tests/engines/shims``: the fault injections of the zoo among them), which the
SGLang environment's ``.pth`` file names in the checkout it was built from. Exit
status: 0 when every suite run passed, 1 when a pytest run failed (its lines are kept all the same),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What runs by default: of the SGLang suite, the test files whose runs write otel-swa log files
#: (the real ``sglang.Engine`` runs: the fixtures traced, paged, chunked, by_hand, plain_script,
#: switched_off; and the bug zoo), about 13 minutes on 2 shared cores, where the whole suite adds
#: the HTTP server's stop paths and the adapter's unit tests; the whole vLLM suite (under a minute:
#: the real Scheduler runs, clean and faulted, and the plugin's processes).
DEFAULT_TESTS = {
    "sglang": ["tests/engines/test_sglang_engine.py", "tests/engines/test_sglang_zoo.py"],
    "vllm": ["tests/engines"],
}
MARKERS = {"sglang": "sglang", "vllm": "vllm"}
REQUIRE = {"sglang": "OTEL_SWA_REQUIRE_SGLANG", "vllm": "OTEL_SWA_REQUIRE_VLLM"}

#: A line kept in ``lines/``: it holds one of these.
KEEP = ("kv_canary_swa_divergence=", "otel_swa", "otel-swa")

_RULES = (
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d(?:[.,]\d+)?\b"), "<time>"),
    (re.compile(r'("pid"\s*:\s*)\d+'), r"\g<1><pid>"),
    (re.compile(r"\b(pid[= ])\d+"), r"\g<1><pid>"),
    (re.compile(r"\b((?:127\.0\.0\.1|localhost|0\.0\.0\.0)):\d+"), r"\g<1>:<port>"),
    (re.compile(r"\b0x[0-9a-f]{6,}\b"), "<addr>"),
    (re.compile(r"\b\d+\.\d+ ?(s|ms|seconds)\b"), r"<dur> \g<1>"),
    (re.compile(r'("\w+_s"\s*:\s*)\d+(?:\.\d+)?'), r"\g<1><dur>"),  # {"startup_s": 27.55}
    (re.compile(r'("children"\s*:\s*)\[[\d, ]*\]'), r"\g<1>[<pids>]"),
    (re.compile(r"\b[0-9a-f]{32}\b"), "<rid>"),  # SGLang's request ids (uuid4 hex)
)
#: What a collector printed (``rotel-agent --debug-log``): of it only the bodies of the log records
#: that hold otel-swa's tagged lines are kept; the attribute lines (``-> otel_swa.tp_rank: Int(0)``)
#: say nothing without the record around them, and which export request carries which metric point
#: or span is timing.
COLLECTOR_FILES = ("rotel.out",)
#: The detection table's rows that the zoos write (``$OTEL_SWA_DETECTION_DIR/detection.json``: each
#: fault made on purpose, where otel-swa first flagged it and its offender in words): kept whole.
DETECTION = "detection.json"
#: A line left out although it holds a word of KEEP: a traceback's frame (its path and line number
#: are the code's, not a line otel-swa writes).
_DROP = re.compile(r'^\s+File "')
#: otel-swa's own lines (its tag): kept first, in their order; the other kept lines follow in theirs.
#: The two are written by different threads or processes (an OpenTelemetry batch processor, SGLang's
#: logger), so how they interleave is timing, not behaviour.
_TAG = "otel_swa[verify="


def normalise(line: str, basetemp: str) -> str:
    """``line`` with what varies between two runs of the same test replaced (see the module docstring)."""
    line = line.replace(basetemp, "<basetemp>")
    for pattern, replacement in _RULES:
        line = pattern.sub(replacement, line)
    return line


def _is_log(path: Path) -> bool:
    if path.suffix == ".log":
        return True
    if path.suffix not in (".txt", ".out", ".err") or path.stat().st_size > 50 << 20:
        return False
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return any(word in text for word in KEEP)


def keep_logs(basetemp: Path, out: Path) -> int:
    """Copy every log file under ``basetemp`` to ``out/raw`` and its normalised otel-swa lines to
    ``out/lines``; return how many files."""
    count = 0
    for path in sorted(p for p in basetemp.rglob("*") if p.is_file() and not p.is_symlink()):
        if not _is_log(path):
            continue
        rel = path.relative_to(basetemp)
        raw = out / "raw" / rel
        raw.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, raw)
        _write_lines(raw, out / "lines" / rel, str(basetemp))
        count += 1
    return count


def _write_lines(raw: Path, lines: Path, basetemp: str) -> None:
    text = raw.read_text(encoding="utf-8", errors="replace")
    keep = (_TAG,) if raw.name in COLLECTOR_FILES else ("",) if raw.name == DETECTION else KEEP
    kept = [normalise(line, basetemp) for line in text.splitlines()
            if any(word in line for word in keep) and not _DROP.match(line)]
    ordered = [line for line in kept if _TAG in line] + [line for line in kept if _TAG not in line]
    lines.parent.mkdir(parents=True, exist_ok=True)
    lines.write_text("".join(line + "\n" for line in ordered), encoding="utf-8")


def renormalise(out: Path) -> int:
    """Write ``out/lines`` again from ``out/raw`` (after a change of the rules above); return how many files."""
    match = re.search(r"--basetemp=(\S+)", (out / "pytest.txt").read_text())
    basetemp = match.group(1) if match else str(out / "basetemp")
    shutil.rmtree(out / "lines", ignore_errors=True)
    raws = sorted(p for p in (out / "raw").rglob("*") if p.is_file())
    for raw in raws:
        _write_lines(raw, out / "lines" / raw.relative_to(out / "raw"), basetemp)
    return len(raws)


def _shim_paths(venv: Path, root: Path) -> "list[str]":
    """This repository's copies of the shim folders that the environment's
    ``otel_swa_sglang_cpu_shims.pth`` (``tests/engines/shims/install.py``) names, wherever that file
    points: on ``PYTHONPATH`` they come first, so the engine's processes load this tree's shims
    and fault injections, not those of the checkout the environment was built from."""
    paths = []
    for pth in venv.glob("lib/python*/site-packages/otel_swa_sglang_cpu_shims.pth"):
        for line in pth.read_text().splitlines():
            parts = Path(line.strip()).parts
            if not line.startswith("import") and parts[-4:-1] == ("tests", "engines", "shims"):
                paths.append(str(root / "tests" / "engines" / "shims" / parts[-1]))
    return paths


def run_suite(suite: str, venv: Path, tests: list, out: Path, extra: list, root: Path = ROOT) -> int:
    """Run one suite's ``tests`` of the tree ``root`` with ``--basetemp`` under ``out``; keep its logs;
    pytest's exit status."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"capture_engine_logs: no {python} (build it with .ci/{suite}-tests.sh build)", file=sys.stderr)
        return 2
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    basetemp = out / "basetemp"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "instrumentation"), *_shim_paths(venv, root)])
    env[REQUIRE[suite]] = "1"
    env.setdefault("CI", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("OTEL_SWA_DETECTION_DIR", str(out / "detection"))
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
               "-m", MARKERS[suite], *extra, *tests]
    start = time.monotonic()
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    kept = keep_logs(basetemp, out)
    detection = out / "detection" / DETECTION
    if detection.exists():
        (out / "raw" / "detection").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(detection, out / "raw" / "detection" / DETECTION)
        _write_lines(detection, out / "lines" / "detection" / DETECTION, str(basetemp))
        kept += 1
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    (out / "pytest.txt").write_text(f"command: {' '.join(command)}\nexit status: {proc.returncode}\n"
                                    f"seconds: {seconds:.0f}\nlog files kept: {kept}\n--- output (tail)\n{tail}\n")
    print(f"{suite}: pytest exit {proc.returncode} in {seconds:.0f} s, {kept} log files kept in {out}")
    shutil.rmtree(basetemp, ignore_errors=True)  # the model files and probes: the logs are kept
    return proc.returncode


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the capture to (outside the repository)")
    parser.add_argument("--suite", action="append", choices=sorted(DEFAULT_TESTS),
                        help="a suite to run (repeatable; default both)")
    parser.add_argument("--tests", nargs="+", help="test files or node ids instead of the suite's default files")
    parser.add_argument("--repo", type=Path, default=ROOT,
                        help="the tree whose code and tests run (default: this script's, %(default)s)")
    parser.add_argument("--sglang-venv", type=Path,
                        default=Path(os.environ.get("OTEL_SWA_SGLANG_VENV", ROOT / ".venv-sglang")))
    parser.add_argument("--vllm-venv", type=Path,
                        default=Path(os.environ.get("OTEL_SWA_VLLM_VENV", ROOT / ".venv-vllm")))
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                        help="more pytest arguments (last on the line)")
    parser.add_argument("--renormalise", action="store_true",
                        help="run nothing: write OUT/<suite>/lines again from OUT/<suite>/raw")
    args = parser.parse_args(argv)
    suites = args.suite or sorted(DEFAULT_TESTS)
    if args.renormalise:
        for suite in suites:
            if (args.out / suite / "raw").is_dir():
                print(f"{suite}: {renormalise(args.out / suite)} files normalised again")
        return 0
    if args.tests and len(suites) != 1:
        parser.error("--tests needs exactly one --suite")
    status = 0
    for suite in suites:
        venv = args.sglang_venv if suite == "sglang" else args.vllm_venv
        code = run_suite(suite, venv, args.tests or DEFAULT_TESTS[suite], args.out.resolve() / suite,
                         args.pytest_args, args.repo.resolve())
        status = max(status, 2 if code == 2 else (1 if code else 0))
    return status


if __name__ == "__main__":
    sys.exit(main())
