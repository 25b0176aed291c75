#!/usr/bin/env bash
# Installs NVIDIA Dynamo's Python packages (ai-dynamo, ai-dynamo-runtime at $DYNAMO_VERSION, from PyPI) into
# a virtualenv of their own in the cache, $DYNSNAP_CACHE/dynamo-<version>: the tests run Dynamo's own worker
# lifecycle and its mocker engine and frontend from its site-packages (PYTHONPATH), apart from the project's
# virtualenv. Uses the Python of the project's virtualenv (scripts/pyenv.sh). Idempotent: a warm cache costs
# nothing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
CACHE=${DYNSNAP_CACHE:-$HOME/.cache/dynamo-snapshot}
dest=$CACHE/dynamo-$DYNAMO_VERSION
[ -f "$dest/.complete" ] && exit 0
python=${VENV:?source scripts/pyenv.sh first}/bin/python
t0=$SECONDS
echo "[dynamo] pip install ai-dynamo==$DYNAMO_VERSION ai-dynamo-runtime==$DYNAMO_VERSION into $dest"
rm -rf "$dest.partial"
"$python" -m venv "$dest.partial"
# ai-dynamo's own requirements (its wheel's METADATA), less aisimulate: a placeholder that fetches the real
# wheel from pypi.nvidia.com at install time (unreachable here), needed only by the mocker's offline replay.
deps=(
  "ai-dynamo-runtime==$DYNAMO_VERSION" "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33"
  "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1" "pyzmq>=26" "redis>=6.2.0,<9" "tqdm>=4" "transformers>=4.56.0"
  "typing-extensions>=4.10.0" "zstandard>=0.23.0,<1"
)
pipi() { "$dest.partial/bin/pip" install -q --disable-pip-version-check --no-warn-script-location "$@"; }
{ pipi --no-deps "ai-dynamo==$DYNAMO_VERSION" && pipi "${deps[@]}"; } \
  || { echo "dynamo-wheels: pip install failed (see above): PyPI must be reachable" >&2; exit 1; }
touch "$dest.partial/.complete"
rm -rf "$dest"
mv "$dest.partial" "$dest"
# Other versions' directories are what an older versions.env left.
for old in "$CACHE"/dynamo-[0-9]*; do
  [ "$old" = "$dest" ] || [ ! -d "$old" ] || rm -rf "$old"
done
echo "[dynamo] installed in $((SECONDS - t0)) s ($(du -sh "$dest" | cut -f1))"
