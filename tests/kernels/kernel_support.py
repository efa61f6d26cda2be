"""The kernels' module for the tests, interpreted or compiled, and the compilation of a kernel for a
CUDA target on a machine without a GPU (Triton's front end, LLVM and the ptxas its wheel carries)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest


def import_kernels(interpret: bool):
    """The kernels' module, its ``triton.jit`` functions interpreted or compiled as asked (the
    caller has set ``TRITON_INTERPRET`` accordingly: the interpreter reads it at every launch too)."""
    pytest.importorskip("triton")
    name = "otel_swa.device.triton_kv"
    module = sys.modules.get(name) or importlib.import_module(name)
    if (type(module._fold_kernel).__name__ == "InterpretedFunction") != interpret:
        module = importlib.reload(module)
    return module



def compile_for_sm90(jobs: "dict[str, tuple[str, dict, dict]]", cache_dir) -> dict:
    """Compile kernels for sm_90 in a fresh process (Triton's interpreter, once run in a process,
    leaves its language patched there): ``jobs`` maps a label to ``(kernel name, pointer argument
    types, constexprs)``, every other argument an int32. Returns label -> ``{"stages": [...], "ptx":
    text}`` or ``{"error": text}``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, __file__], input=json.dumps(jobs), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from otel_swa.device import triton_kv

    out = {}
    for label, (name, pointers, constexprs) in json.load(sys.stdin).items():
        fn = getattr(triton_kv, name)
        signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "i32") for arg in fn.arg_names}
        try:
            asm = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32)).asm
            out[label] = {"stages": sorted(asm), "ptx": asm["ptx"]}
        except Exception as exc:  # reported to the test, which names it
            out[label] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))


if __name__ == "__main__":
    _compile_all()
