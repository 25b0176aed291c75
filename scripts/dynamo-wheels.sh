#!/usr/bin/env bash
# Installs NVIDIA Dynamo's Python packages (ai-dynamo, ai-dynamo-runtime at $DYNAMO_VERSION, from PyPI) into
# a directory of their own in the cache, $DYNSNAP_CACHE/dynamo-<version>: the tests run Dynamo's own worker
# lifecycle and its mocker engine and frontend from there (PYTHONPATH), apart from the project's virtualenv.
# Needs the project's virtualenv (scripts/pyenv.sh) for pip. Idempotent: a warm cache costs nothing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
CACHE=${DYNSNAP_CACHE:-$HOME/.cache/dynamo-snapshot}
dest=$CACHE/dynamo-$DYNAMO_VERSION
[ -f "$dest/.complete" ] && exit 0
pip=${VENV:?source scripts/pyenv.sh first}/bin/pip
t0=$SECONDS
echo "[dynamo] pip install ai-dynamo==$DYNAMO_VERSION ai-dynamo-runtime==$DYNAMO_VERSION into $dest"
rm -rf "$dest.partial"
"$pip" install -q --disable-pip-version-check --no-warn-script-location --target "$dest.partial" \
  "ai-dynamo==$DYNAMO_VERSION" "ai-dynamo-runtime==$DYNAMO_VERSION" \
  || { echo "dynamo-wheels: pip install failed (see above): PyPI must be reachable" >&2; exit 1; }
touch "$dest.partial/.complete"
rm -rf "$dest"
mv "$dest.partial" "$dest"
# Other versions' directories are what an older versions.env left.
for old in "$CACHE"/dynamo-[0-9]*; do
  [ "$old" = "$dest" ] || [ ! -d "$old" ] || rm -rf "$old"
done
echo "[dynamo] installed in $((SECONDS - t0)) s ($(du -sh "$dest" | cut -f1))"
