#!/usr/bin/env bash
# The vLLM engine suite: otel-swa's vLLM adapter, swa_vllm instrumentor and plugin (loaded by vLLM's
# load_general_plugins()) against vLLM 0.33.0's real KVCacheManager and Scheduler on CPU, in an environment of its own built from scratch (about
# 2 GB). Runs `pytest tests/engines -m vllm`; a failed vLLM import fails it (OTEL_SWA_REQUIRE_VLLM=1).
# The rows of its faults made on purpose go to $OTEL_SWA_DETECTION_DIR/detection.json (default out/detection).
# The vLLM wheel (336 MB) is downloaded once into $OTEL_SWA_WHEEL_DIR (default .whl/).
# vllm 0.33.0's metadata asks for torch==2.14.0 and packages left out here on purpose (see
# .ci/vllm-constraints.txt and .ci/vllm-requirements.txt), so pip's conflict report is switched off.
#   bash .ci/vllm-tests.sh [all|build|test]   build: the environment only; test: the suite in the
#                                              environment built before; all (default): both
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1  # the tests write their model config locally; nothing is fetched
VENV="${OTEL_SWA_VLLM_VENV:-.venv-vllm}"
PHASE="${1:-all}"
case "$PHASE" in all|build|test) ;; *) echo "usage: bash .ci/vllm-tests.sh [all|build|test]" >&2; exit 2 ;; esac
WHEELS="${OTEL_SWA_WHEEL_DIR:-.whl}"
CONSTRAINTS=.ci/vllm-constraints.txt
PIP=("$VENV/bin/pip" install -q --no-warn-conflicts -c "$CONSTRAINTS")

start=$(date +%s)
if [ "$PHASE" != test ]; then
  python3 -m venv --clear "$VENV"
  "${PIP[@]}" torch==2.13.0
  "$VENV/bin/pip" download -q --no-deps -c "$CONSTRAINTS" -d "$WHEELS" vllm==0.33.0
  "${PIP[@]}" --no-deps "$WHEELS"/vllm-0.33.0-*.whl
  "${PIP[@]}" -r .ci/vllm-requirements.txt
  "${PIP[@]}" --no-deps xgrammar==0.2.8
  "${PIP[@]}" -e ".[test]"
  echo "vllm suite environment: $(du -sh "$VENV" | cut -f1), installed in $(( $(date +%s) - start )) s"
fi
[ "$PHASE" = build ] && exit 0
installed=$(date +%s)

# the detection table's rows of the vLLM faults made on purpose (docs/engines.md is compared with them)
export OTEL_SWA_DETECTION_DIR="${OTEL_SWA_DETECTION_DIR:-out/detection}"
OTEL_SWA_REQUIRE_VLLM=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines -m vllm
echo "vllm suite: detection rows in $OTEL_SWA_DETECTION_DIR/detection.json"
echo "vllm suite: tests $(( $(date +%s) - installed )) s, whole script $(( $(date +%s) - start )) s"
