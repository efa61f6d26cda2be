#!/usr/bin/env bash
# The SGLang engine suite: otel-swa's SGLang adapter against sglang 0.5.23's real allocator classes
# on CPU, in its own environment (about 1.6 GB, about 1.5 minutes to install on 2 cores with torch
# from a local wheel cache). Runs `pytest tests/engines -m sglang`; a failed SGLang import fails it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${OTEL_SWA_SGLANG_VENV:-.venv-sglang}"

start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -c .ci/sglang-constraints.txt torch==2.13.0
"$VENV/bin/pip" install -q --no-deps sglang==0.5.23
"$VENV/bin/pip" install -q -c .ci/sglang-constraints.txt -r .ci/sglang-requirements.txt
# otel-swa itself; its dependencies except torch (already pinned above).
"$VENV/bin/pip" install -q -c .ci/sglang-constraints.txt -e .
echo "sglang suite environment: $(du -sh "$VENV" | cut -f1), installed in $(( $(date +%s) - start )) s"

OTEL_SWA_REQUIRE_SGLANG=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines -m sglang
