#!/usr/bin/env bash
# The project's one test command (README, .ci/run): builds/caches the real components, prepares the
# Python environment, then runs lint, types, the layer contract and the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k smoke
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
CACHE=${DYNSNAP_CACHE:-$HOME/.cache/dynamo-snapshot}

bash scripts/test-env.sh

py=${PYTHON:-python3}
command -v "$py" >/dev/null || { echo "test: $py is missing: install Python >= 3.11" >&2; exit 1; }
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "test: Python >= 3.11 is required ($($py --version))" >&2; exit 1; }
# The venv is keyed by pyproject.toml so a fresh clone reuses it; the project itself is re-linked each run.
key=$(sha256sum pyproject.toml | cut -c1-12)
venv=$CACHE/venv-$key
if [ ! -x "$venv/bin/pytest" ]; then
  echo "[test] creating $venv"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -e ".[dev]" || { echo "test: pip install failed (see above)" >&2; exit 1; }
else
  "$venv/bin/pip" install -q --no-deps -e . >/dev/null
fi
export PATH=$venv/bin:$CACHE/bin:$PATH
echo "[test] set-up took $((SECONDS - t0)) s"

echo "[test] ruff";          ruff check . && ruff format --check --quiet .
echo "[test] mypy --strict"; mypy
echo "[test] import layers"; lint-imports --no-cache
echo "[test] pytest"
set +e
pytest "$@"
rc=$?
set -e
echo "[test] total $((SECONDS - t0)) s"
exit $rc
