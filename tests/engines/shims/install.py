"""Install the SGLang CPU shims into the running Python environment (test environments only).

Writes ``otel_swa_sglang_cpu_shims.pth`` into this interpreter's ``site-packages``, so that EVERY
Python process of the environment (pytest, and the tokenizer, scheduler and detokenizer processes a
real ``sglang.Engine`` spawns, also under ``opentelemetry-instrument``, whose own
``sitecustomize`` would shadow one of ours) finds:

* ``sgl_kernel_stub/``: a stand-in for the CPU build of ``sgl_kernel`` (not on PyPI);
* ``torchvision_stub/``: a stand-in for ``torchvision`` (its PyPI wheel needs a newer torch), only
  when no real torchvision is installed;
* ``sglang_cpu/sglang_cpu_patches.py``: post-import patches for SGLang's KV canary on CPU and the
  torch-native backend's SWA read (see that module).

Usage: ``<venv>/bin/python tests/engines/shims/install.py`` (``.ci/sglang-tests.sh`` runs it).
``--uninstall`` removes the file. Prints the path written.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "otel_swa_sglang_cpu_shims.pth"
SHIMS = Path(__file__).resolve().parent


def pth_lines() -> list[str]:
    lines = [str(SHIMS / "sgl_kernel_stub")]
    spec = importlib.util.find_spec("torchvision")
    # our own stand-in, found through a .pth written before, is not a real torchvision: an install
    # run again keeps it
    if spec is None or SHIMS in Path(spec.origin or "").resolve().parents:
        lines.append(str(SHIMS / "torchvision_stub"))
    lines.append(str(SHIMS / "sglang_cpu"))
    lines.append("import sglang_cpu_patches; sglang_cpu_patches.install()")
    return lines


def main(argv: list[str]) -> int:
    target = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if argv[1:] == ["--uninstall"]:
        target.unlink(missing_ok=True)
        print(f"removed {target}")
        return 0
    if argv[1:]:
        print(f"usage: {argv[0]} [--uninstall]", file=sys.stderr)
        return 2
    target.write_text("\n".join(pth_lines()) + "\n")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
