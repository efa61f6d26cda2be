#!/usr/bin/env bash
# The SGLang engine suite, in its own environment (about 2.5 GB, 1-3 minutes to install on 2 cores
# with torch from a local wheel cache): otel-swa's SGLang adapter against sglang 0.5.23's real
# allocator classes, and a real sglang.Engine and HTTP server (`python -m sglang.launch_server`,
# stopped five ways) on CPU with a tiny hybrid-SWA model, started by plain python (otel-swa's
# plugin, loaded by SGLang's load_plugins()) or under opentelemetry-instrument, exporting to a
# real collector. Runs `pytest tests/engines -m sglang`, then the Triton kernels' tests
# (`pytest tests/kernels`, on CPU under Triton's interpreter: 3.5 minutes on 2 busy cores); a failed
# SGLang import fails it (OTEL_SWA_REQUIRE_SGLANG=1), a missing collector too (CI=1).
#   bash .ci/sglang-tests.sh [all|build|test]   build: the environment only; test: the suite in the
#                                                environment built before; all (default): both
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${OTEL_SWA_SGLANG_VENV:-.venv-sglang}"
PHASE="${1:-all}"
case "$PHASE" in all|build|test) ;; *) echo "usage: bash .ci/sglang-tests.sh [all|build|test]" >&2; exit 2 ;; esac

# sglang's metadata asks for torch==2.14.1 and CUDA packages left out here on purpose (see
# .ci/sglang-requirements.txt), so pip's conflict report is switched off.
PIP=("$VENV/bin/pip" install -q --no-warn-conflicts -c .ci/sglang-constraints.txt)

start=$(date +%s)
if [ "$PHASE" != test ]; then
  python3 -m venv --clear "$VENV"
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" --no-deps sglang==0.5.23 triton==3.8.0
  "${PIP[@]}" -r .ci/sglang-requirements.txt
  # otel-swa itself with the test and collector extras (opentelemetry-instrument, rotel-agent);
  # torch stays the one pinned above.
  "${PIP[@]}" -e ".[test,collector]"
  # the CPU shims, for every Python process of this environment (the engine's spawned ones too)
  "$VENV/bin/python" tests/engines/shims/install.py
  echo "sglang suite environment: $(du -sh "$VENV" | cut -f1), installed in $(( $(date +%s) - start )) s"
fi
[ "$PHASE" = build ] && exit 0
installed=$(date +%s)

CI="${CI:-1}" OTEL_SWA_REQUIRE_SGLANG=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines -m sglang
engines=$(date +%s)
# the Triton kernels of the write path against the torch path, under Triton's interpreter (this
# environment has the triton that sglang ships with; otel-swa's own does not: a 240 MB wheel)
"$VENV/bin/python" -c "import triton" || { echo "sglang suite: triton does not import" >&2; exit 1; }
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/kernels
echo "sglang suite: tests $(( engines - installed )) s, Triton kernels (interpreted) $(( $(date +%s) - engines )) s, whole script $(( $(date +%s) - start )) s"
