#!/usr/bin/env bash
# Builds NVIDIA's snapshot node agent and operator (github.com/ai-dynamo/snapshot at $NVIDIA_SNAPSHOT_COMMIT)
# for benchmarks/vs_nvidia_snapshot.py: `agent` and `nsrestore` (agent/), `manager` and `crdinstaller`
# (operator/, as their operator Dockerfile builds them) (Go, CGO_ENABLED=0 -ldflags "-w -s",
# GOTOOLCHAIN=local, dependencies from the Go module proxy) and `ns-bind-mount` (gcc) into
# ${NV_BIN:-~/.cache/nvidia-snapshot-peer/bin}. Skips the build when that directory's stamp says it was built
# for the same commit. cuda-checkpoint-helper is not built (needs cuda.h and libcuda; the agent skips CUDA
# for a process with no CUDA context).
#
#   scripts/nvidia-snapshot-peer.sh DIR     # DIR: a checkout (or `git archive`) of ai-dynamo/snapshot
#
# The source is NOT reachable by CI: it comes from the `fetch` tool's mirror of the repository, e.g.
#   mkdir -p DIR && git -C /work/.mirror/ai-dynamo+snapshot/repo archive b7e707c | tar -x -C DIR
# DIR's commit is `git -C DIR rev-parse HEAD` for a checkout; an archive is taken to be $NVIDIA_SNAPSHOT_COMMIT.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
src=${1:?usage: $0 DIR (a checkout of github.com/ai-dynamo/snapshot)}
src=$(cd "$src" && pwd)
[ -f "$src/agent/go.mod" ] || { echo "nvidia-snapshot-peer: $src/agent/go.mod missing: not an ai-dynamo/snapshot checkout" >&2; exit 1; }
commit=$NVIDIA_SNAPSHOT_COMMIT
if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  commit=$(git -C "$src" rev-parse HEAD)
fi
bin=${NV_BIN:-$HOME/.cache/nvidia-snapshot-peer/bin}
stamp=$bin/.built-commit
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$commit" ] \
  && [ -x "$bin/agent" ] && [ -x "$bin/nsrestore" ] && [ -x "$bin/ns-bind-mount" ] \
  && [ -x "$bin/manager" ] && [ -x "$bin/crdinstaller" ]; then
  echo "[nvidia-snapshot-peer] $bin already built for $commit"
  exit 0
fi
mkdir -p "$bin"
rm -f "$stamp"
t0=$SECONDS
echo "[nvidia-snapshot-peer] building agent, nsrestore, manager, crdinstaller ($commit) into $bin"
(cd "$src/agent" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false \
  go build -ldflags "-w -s" -o "$bin/" ./cmd/agent ./cmd/nsrestore)
(cd "$src/operator" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false \
  go build -ldflags "-w -s" -o "$bin/" ./cmd/manager ./cmd/crdinstaller)
gcc -O2 -Wall -Wextra -o "$bin/ns-bind-mount" "$src/agent/cmd/ns-bind-mount/main.c"
echo "$commit" >"$stamp"
echo "[nvidia-snapshot-peer] built in $((SECONDS - t0)) s: $(cd "$bin" && ls -s agent nsrestore ns-bind-mount manager crdinstaller | tr '\n' ' ')"
