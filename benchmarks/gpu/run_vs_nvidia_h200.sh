#!/usr/bin/env bash
# This project's agent and the path NVIDIA's snapshot agent takes, restoring the same GPU worker on the
# same machine and disk:
#   bash benchmarks/gpu/nvidia_path_bundle.sh CRIU_SRC CUDA_CHECKPOINT_SRC .nv-bundle    # here, once
#   run(command="bash benchmarks/gpu/run_vs_nvidia_h200.sh 1g", carry=[".whl", ".criu-bundle", ".nv-bundle"])
#   run(command="MODES=decoupled NVIDIA=0 BENCH_ARGS=--keep-compile-cache bash benchmarks/gpu/run_vs_nvidia_h200.sh 1g",
#       carry=[".whl", ".criu-bundle", ".nv-bundle"])    # at once, on the machine the first call left warm
# Arguments: the size (default 1g), the restores with the page cache dropped per side (default 5; two
# more with it warm). restore_bench.py in the MODES given (default stock: the worker NVIDIA's path is set
# against; this project's CRIU build and defaults), then, unless NVIDIA=0, vs_nvidia_gpu.py (criu-dev and
# cuda-checkpoint from .nv-bundle) with the model and compile cache the first left. At 1g the first call
# takes about 9 minutes (the stock worker's cold start compiles from an empty cache), the second 2; the
# two modes do not fit one call. compare_vs_nvidia.py then folds the calls' files (BENCHMARKS.md).
# BENCH_ARGS: more restore_bench.py flags; BENCH_TIMEOUT: its limit in seconds (default 360).
set -uo pipefail
size=${1:-1g}
restores=${2:-5}
modes=${MODES:-stock}
: "${OUT:?OUT must be set (the device tool sets it)}"
. benchmarks/gpu/device_env.sh
variants=$(python3 -c "import sys; n = int(sys.argv[1]); print(','.join(['default'] * (n - 1) + ['warm_node']))" "$restores")
tag=vs-nvidia-${modes//,/-}
timeout "${BENCH_TIMEOUT:-360}" python3 benchmarks/gpu/restore_bench.py --size "$size" --modes "$modes" --tag "$tag" \
    --warm-restore --no-bad-inputs --variants "$variants" --variants-for "$modes" --calib-gib 2 \
    --out "$OUT" ${BENCH_ARGS:-} > "$OUT/ours-$tag-$size.log" 2>&1
echo "ours ($modes): rc=$?"
find "$OUT/criu-logs" -delete 2>/dev/null
[ "${NVIDIA:-1}" = 1 ] || exit 0
nv=$PWD/.nv-bundle
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib:%s/.criu-bundle/lib exec %s/criu "$@"\n' "$nv" "$PWD" "$nv" \
    > "$nv/criu-direct.sh"
chmod +x "$nv/criu-direct.sh" "$nv/cuda-checkpoint"
echo "nvidia path: CRIU $("$nv/criu-direct.sh" --version | head -1), commits $(cat "$nv/commits")"
timeout 200 python3 benchmarks/gpu/vs_nvidia_gpu.py --size "$size" --criu "$nv/criu-direct.sh" \
    --cuda-checkpoint "$nv/cuda-checkpoint" --restores "$restores" --warm 2 --calib-gib 2 \
    --out "$OUT" > "$OUT/nvidia-path-$size.log" 2>&1
echo "nvidia path: rc=$?"
tail -c 1500 "$OUT/nvidia-path-$size.log"
python3 benchmarks/gpu/compare_vs_nvidia.py "$OUT/gpu-restore-$size-$tag.json" \
    "$OUT/gpu-nvidia-path-$size.json" "$OUT/vs-nvidia-snapshot-gpu-$size.json"
