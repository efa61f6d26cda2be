"""Where the scheduler's CPU goes, to the function and the torch operation: the whole-thread
``cProfile`` the engine benchmark's profile shim writes (``OTEL_SWA_TEST_SGLANG_PYPROFILE``; its
clock the thread's CPU time) read into per-step rows, otel-swa's against the engine's.

A function is otel-swa's when its file is under ``otel_swa/`` or the instrumentation packages; a
builtin (a torch operation, ``numpy``'s reductions, ``getattr``) is charged to the function that
called it, so that an operation otel-swa calls is otel-swa's row and the same operation the model
calls is the engine's. The profile shim's own functions are a row of their own. Tensor operators
(``x ^= y``, ``x >> 16``) are not calls the profiler sees: their time is in the calling function's
own time.
"""

from __future__ import annotations

import collections
import pstats
from pathlib import Path

#: Steps the profiler skips at the start (the shim enables it at the 10th forward step).
PROFILE_FROM_STEP = 10
#: The SGLang instrumentor's wrappers of the engine's own methods (``RadixAttention.forward``,
#: ``ModelRunner.forward``, ``Scheduler.run_batch``, the canary's pre-ops): their own time is
#: otel-swa's, what they call through to the engine is the engine's.
WRAPPERS = {("attention.py", "forward"), ("model_runner.py", "forward"), ("scheduler.py", "run_batch"),
            ("canary.py", "pre_ops_maybe_inside_graph")}


def _ours(filename: str) -> bool:
    return "/otel_swa/" in filename or "/instrumentation/opentelemetry/instrumentation/swa" in filename


def _shim(filename: str) -> bool:
    return "/tests/engines/shims/" in filename


def _short(filename: str) -> str:
    return filename.rsplit("/", 1)[-1]


def read(path: Path, steps: int) -> dict:
    """One profile, per step: ``engine``, ``shim``, ``ours`` seconds and otel-swa's rows
    (``python``: function -> own seconds; ``ops``: ``operation <- caller`` -> seconds;
    ``called``: the engine's, numpy's or torch's Python functions otel-swa calls, function ->
    seconds), each divided by the ``steps - PROFILE_FROM_STEP`` forward steps the profile covers.

    A function that is not otel-swa's is charged to otel-swa in the share of its own time spent
    in calls that came from otel-swa (directly, or through such functions: the shares are carried
    down the callers' graph), so that SGLang's ``get_key_buffer`` or numpy's ``sum`` called by the
    instrumentation are otel-swa's cost, and the same functions called by the engine are not."""
    stats = pstats.Stats(str(path)).stats
    per = 1.0 / max(1, steps - PROFILE_FROM_STEP)

    def kind(filename: str) -> str:
        return "ours" if _ours(filename) else "shim" if _shim(filename) else "other"

    # the share of each function's own time that otel-swa's calls (or the shim's) account for
    share = {func: {"ours": 1.0 * (kind(func[0]) == "ours" and (_short(func[0]), func[2]) not in WRAPPERS),
                    "shim": 1.0 * (kind(func[0]) == "shim")} for func in stats}
    for _ in range(12):  # down the callers' graph (cycles converge)
        for func, (_, _, own, _, callers) in stats.items():
            if kind(func[0]) != "other" or not callers:
                continue
            spent = sum(c[2] for c in callers.values()) or 1e-12
            for what in ("ours", "shim"):
                share[func][what] = sum(c[2] * share.get(caller, {}).get(what, 0.0)
                                        for caller, c in callers.items()) / spent
    engine = shim = 0.0
    python: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    called: collections.Counter = collections.Counter()
    for func, (_, _, own, _, callers) in stats.items():
        filename, _, name = func
        if kind(filename) == "ours":
            python[f"{_short(filename)}:{name}"] += own * per
            continue
        if kind(filename) == "shim":
            shim += own * per
            continue
        for caller, c in (callers.items() if filename == "~" else [(None, (0, 0, own, 0))]):
            ours_part = (share.get(caller, {}).get("ours", 0.0) if caller else share[func]["ours"]) * c[2]
            shim_part = (share.get(caller, {}).get("shim", 0.0) if caller else share[func]["shim"]) * c[2]
            if ours_part:
                if filename == "~" and _ours(caller[0]):
                    ops[f"{name[:48]} <- {_short(caller[0])}:{caller[2]}"] += ours_part * per
                else:
                    called[f"{name[:48]} ({_short(caller[0] if filename == '~' else filename)})"] += ours_part * per
            shim += shim_part * per
            engine += (c[2] - ours_part - shim_part) * per
    return {"engine": engine, "shim": shim, "python": python, "ops": ops, "called": called,
            "ours": sum(python.values()) + sum(ops.values()) + sum(called.values()), "steps": steps - PROFILE_FROM_STEP}


def rows(off: dict, on: dict, top: int = 12) -> "list[tuple[str, str]]":
    """The table of one variant against off, us per forward step (the profiler's overhead in
    every row)."""
    out = [("the engine's own functions and operations, off", f"{off['engine'] * 1e6:.0f}"),
           ("the engine's own functions and operations, on (the difference: the engine slowed by otel-swa)",
            f"{on['engine'] * 1e6:.0f} ({(on['engine'] - off['engine']) * 1e6:+.0f})"),
           ("otel-swa, all (its Python + the operations it calls)", f"{on['ours'] * 1e6:.0f}"),
           ("otel-swa's Python (own time of its functions, tensor operators included)",
            f"{sum(on['python'].values()) * 1e6:.0f}")]
    out += [(f"    {name}", f"{spent * 1e6:.1f}") for name, spent in on["python"].most_common(top)]
    out.append(("otel-swa's torch / numpy calls", f"{sum(on['ops'].values()) * 1e6:.0f}"))
    out += [(f"    {name}", f"{spent * 1e6:.1f}") for name, spent in on["ops"].most_common(top)]
    out.append(("the engine's, torch's and numpy's code otel-swa calls (and what that calls)",
                f"{sum(on['called'].values()) * 1e6:.0f}"))
    out += [(f"    {name}", f"{spent * 1e6:.1f}") for name, spent in on["called"].most_common(top // 2)]
    return out
