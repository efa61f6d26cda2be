#!/usr/bin/env bash
# The GPU check: the tests marked gpu (the Triton kernels' among them, tests/kernels), then the
# sample / hot-path / capture figures on CUDA, printed as one table (benchmarks/gpu_figures.py), and
# the write path per decode step on the torch path and on the Triton kernels
# (benchmarks/bench_write_kernels.py, which also fails when the two leave different tables). About
# 3 minutes on one H200; every step has a time bound so that the whole stays under 10 minutes.
#
#   bash benchmarks/gpu.sh            on a CUDA machine (exit 1 if a GPU test fails, 2 without CUDA)
#   bash benchmarks/gpu.sh --dry-run  anywhere (CI, on CPU): the GPU tests are collected (they import
#                                     and are marked), the figures are taken on the CPU with small
#                                     shapes, and the table is printed; exit 0 when all of that runs
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu.sh [--dry-run]" >&2; exit 2 ;;
esac
start=$(date +%s)

if [ "$DRY" = 1 ]; then
  collected=$(timeout 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only -m gpu tests 2>&1 | tail -n 1)
  case "$collected" in
    *" tests collected"*|*" test collected"*|*"selected"*) ;;
    *) echo "gpu.sh --dry-run: the GPU tests were not collected: $collected" >&2; exit 1 ;;
  esac
  timeout 300 "$PY" benchmarks/gpu_figures.py --device cpu --quick --gpu-tests "dry run: $collected"
  timeout 120 "$PY" benchmarks/bench_write_kernels.py --device cpu --quick
  echo "gpu.sh --dry-run: done in $(( $(date +%s) - start )) s"
  exit 0
fi

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu.sh: no CUDA device (torch.cuda.is_available() is False); use --dry-run on a CPU machine" >&2
  exit 2
fi
"$PY" -c "import torch; print('CUDA device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
"$PY" -c "import triton; print('triton', triton.__version__)" 2>/dev/null \
  || echo "gpu.sh: triton does not import: the torch write path runs and the Triton kernels' tests are skipped"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests > "$log" 2>&1
tests_rc=$?
set -e
summary=$(tail -n 1 "$log")
[ "$tests_rc" = 0 ] || tail -n 40 "$log"
timeout 240 "$PY" benchmarks/gpu_figures.py --device cuda --gpu-tests "$summary"
set +e
timeout 120 "$PY" benchmarks/bench_write_kernels.py --device cuda --rounds 5
bench_rc=$?
set -e
[ "$bench_rc" = 0 ] || { echo "gpu.sh: bench_write_kernels.py failed ($bench_rc)"; [ "$tests_rc" != 0 ] || tests_rc=1; }
echo "gpu.sh: done in $(( $(date +%s) - start )) s"
exit "$tests_rc"
