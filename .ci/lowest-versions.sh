#!/usr/bin/env bash
# The README's test command with the lowest versions pyproject.toml declares
# (.ci/lowest-constraints.txt), in an environment of its own built from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${OTEL_SWA_LOWEST_VENV:-.venv-lowest}"
start=$(date +%s)
python3 -m venv --clear "$VENV"
"$VENV/bin/pip" install -q -c .ci/lowest-constraints.txt torch==2.13.0 -e ".[test,plot,collector]"
"$VENV/bin/pip" list 2>/dev/null | grep -E "^(opentelemetry-(api|sdk|instrumentation) |numpy |pytest |matplotlib )" || true
"$VENV/bin/python" -m pytest -q -p no:cacheprovider
echo "lowest versions: $(( $(date +%s) - start )) s"
