#!/usr/bin/env bash
# The project's one test command (README, .ci/run): builds/caches the real components, prepares the
# Python environment, then runs lint, types, the layer contract and the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k smoke
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
bash scripts/test-env.sh
source scripts/pyenv.sh
VENV=$VENV bash scripts/dynamo-wheels.sh
echo "[test] set-up took $((SECONDS - t0)) s"

echo "[test] ruff";          ruff check . && ruff format --check --quiet .
echo "[test] mypy --strict"; mypy
echo "[test] import layers"; lint-imports --no-cache
echo "[test] pytest"
rc=0
pytest "$@" || rc=$?
echo "[test] total $((SECONDS - t0)) s"
exit $rc
