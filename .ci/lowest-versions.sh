#!/usr/bin/env bash
# The tests that depend on the versions of otel-swa's dependencies, with the lowest versions
# pyproject.toml declares (.ci/lowest-constraints.txt), in an environment of its own built from scratch.
#   bash .ci/lowest-versions.sh [all|build|test]   build: the environment only; test: the tests in the
#                                                   environment built before; all (default): both
#
# torch is the same pin in both environments; what changes is OpenTelemetry (api, sdk, OTLP
# exporters, instrumentation, distro, test utils, the Prometheus exporter), prometheus-client,
# numpy, tqdm, pytest, hypothesis and matplotlib. The tests run here are every test that uses one of
# them beyond what the README's test command already proves with the newest versions:
#   tests/telemetry, tests/engines   OpenTelemetry, the instrumentors, the distro, the Prometheus
#                                    endpoint, opentelemetry-instrument (the engine tests marked
#                                    sglang / vllm skip here: they have their own environments)
#   tests/core                       the device code (numpy through torch's .numpy()), the reporter
#                                    and its sinks, the hypothesis properties
#   tests/reference                  the reference engine on the device code, hypothesis invariants
#   the pytest plugin and capture    tests/testing/test_plugin_pytester.py (pytester, the plugin's
#                                    hooks), test_capture_reporter.py, test_verdicts_third_round.py
#                                    (liveness through OpenTelemetry)
#   matplotlib, tqdm                 tests/cli/test_plot_*.py, test_replay_plot.py, test_ops_commands.py,
#                                    test_progress.py
# Left out: the log reading and judging (tests/testing otherwise: the standard library only) and
# the command tests that run the replay and its output paths (tests/cli otherwise: the same code
# paths as tests/core and tests/reference, through argparse and the standard library).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${OTEL_SWA_LOWEST_VENV:-.venv-lowest}"
PHASE="${1:-all}"
case "$PHASE" in all|build|test) ;; *) echo "usage: bash .ci/lowest-versions.sh [all|build|test]" >&2; exit 2 ;; esac
start=$(date +%s)
if [ "$PHASE" != test ]; then
  python3 -m venv --clear "$VENV"
  "$VENV/bin/pip" install -q -c .ci/lowest-constraints.txt torch==2.13.0 -e ".[test,plot,collector]"
  echo "lowest versions environment: installed in $(( $(date +%s) - start )) s"
fi
[ "$PHASE" = build ] && exit 0
installed=$(date +%s)
"$VENV/bin/pip" list 2>/dev/null | grep -E "^(opentelemetry-(api|sdk|instrumentation) |numpy |pytest |matplotlib )" || true
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/telemetry tests/engines tests/core tests/reference \
  tests/testing/test_plugin_pytester.py tests/testing/test_capture_reporter.py tests/testing/test_verdicts_third_round.py \
  tests/cli/test_plot_output.py tests/cli/test_plot_ranks.py tests/cli/test_plot_data.py tests/cli/test_replay_plot.py \
  tests/cli/test_ops_commands.py tests/cli/test_progress.py
echo "lowest versions: tests $(( $(date +%s) - installed )) s, whole script $(( $(date +%s) - start )) s"
