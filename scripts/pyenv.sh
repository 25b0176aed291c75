# Sourced by scripts/test.sh and scripts/demo.sh: a cached virtualenv with the project's three distributions
# installed editable (the worker SDK sdk/, the product ., the dev harness dev/) and the test tools.
# Sets VENV and puts it and the component cache on PATH.
CACHE=${DYNSNAP_CACHE:-$HOME/.cache/dynamo-snapshot}
py=${PYTHON:-python3}
command -v "$py" >/dev/null || { echo "setup: $py is missing: install Python >= 3.11" >&2; exit 1; }
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "setup: Python >= 3.11 is required, found $($py --version 2>&1)" >&2; exit 1; }
# Keyed by the pyproject files so a fresh clone reuses it; the project itself is re-linked on every run.
VENV=$CACHE/venv-$(cat pyproject.toml sdk/pyproject.toml dev/pyproject.toml | sha256sum | cut -c1-12)
if [ ! -x "$VENV/bin/pytest" ]; then
  echo "[setup] creating $VENV"
  rm -rf "$VENV"
  "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e ./sdk -e ".[dev]" -e ./dev \
    || { echo "setup: pip install failed (see above)" >&2; exit 1; }
else
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e ./sdk -e . -e ./dev >/dev/null
fi
export PATH=$VENV/bin:$CACHE/bin:$PATH
