#!/usr/bin/env bash
# What benchmarks/gpu/vs_nvidia_gpu.py runs in NVIDIA's agent's place, as a bundle to carry to the GPU
# machine: upstream CRIU from its criu-dev branch (the branch NVIDIA's agent image builds; commit
# NVIDIA_PATH_CRIU_COMMIT) built here, with the shared libraries it links (glibc left to the machine),
# and NVIDIA's cuda-checkpoint utility (NVIDIA/cuda-checkpoint at CUDA_CHECKPOINT_COMMIT).
#
#   benchmarks/gpu/nvidia_path_bundle.sh CRIU_SRC CUDA_CHECKPOINT_SRC DIR [SHARED_LIBS]
#
# SHARED_LIBS (default .criu-bundle/lib, the project CRIU's bundle carried beside it): libraries found
# there byte for byte are left out of DIR/lib (the device call carries at most 64 MiB); the device script
# puts both directories on CRIU's library path.
#
# CRIU_SRC and CUDA_CHECKPOINT_SRC: checkouts (or `git archive`s) of checkpoint-restore/criu and
# NVIDIA/cuda-checkpoint at those commits, through the `fetch` tool's mirror, e.g.
#   mkdir -p SRC && git -C /work/.mirror/checkpoint-restore+criu/repo archive $NVIDIA_PATH_CRIU_COMMIT | tar -x -C SRC
# Not reachable by CI. DIR (an ignored path) gets criu, lib/, cuda-checkpoint and criu-direct.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=../../scripts/versions.env
source "$here/scripts/versions.env"
criu_src=${1:?usage: $0 CRIU_SRC CUDA_CHECKPOINT_SRC DIR}
cc_src=${2:?usage: $0 CRIU_SRC CUDA_CHECKPOINT_SRC DIR}
out=${3:?usage: $0 CRIU_SRC CUDA_CHECKPOINT_SRC DIR}
shared=${4:-$here/.criu-bundle/lib}
[ -f "$criu_src/criu/Makefile" ] || { echo "$criu_src: not a CRIU source tree" >&2; exit 1; }
cc=$cc_src/bin/x86_64_Linux/cuda-checkpoint
[ -f "$cc" ] || { echo "$cc missing: not an NVIDIA/cuda-checkpoint checkout" >&2; exit 1; }
if [ ! -x "$criu_src/criu/criu" ]; then
    make -C "$criu_src" -j"$(nproc)" criu > "$criu_src/build.log" 2>&1 \
        || { tail -20 "$criu_src/build.log" >&2; exit 1; }
fi
DYNSNAP_CRIU_BUILD=$criu_src/criu/criu bash "$here/benchmarks/gpu/criu_bundle_from_build.sh" "$out"
for lib in "$out"/lib/*; do
    if cmp -s "$lib" "$shared/$(basename "$lib")"; then rm "$lib"; fi
done
install -m 0755 "$cc" "$out/cuda-checkpoint"
echo "$NVIDIA_PATH_CRIU_COMMIT $CUDA_CHECKPOINT_COMMIT" > "$out/commits"
du -sh "$out"
