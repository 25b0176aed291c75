#!/usr/bin/env bash
# The main job on one machine (README): build/cache the components, then run `dynamo-snapshot-demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/test-env.sh
source scripts/pyenv.sh
exec dynamo-snapshot-demo "$@"
