#!/usr/bin/env bash
# A/B of the storage formats, in one device call per size:
#   run(command="bash benchmarks/gpu/run_formats_ab_h200.sh 1g", carry=[".whl", ".criu-bundle"])
# Arguments: the size (default 1g) and the modes (default decoupled). ARMS picks the arms, run one after
# the other on the same disk: default (the agent's defaults); keep-zero-pages (--no-drop-zero-pages); drop-zero-pages
# (--drop-zero-pages);
# raw-weights (the worker's --weights-encoding raw instead of split-nibble); compressed-pages
# (--compress-pages); no-release (the worker does not drop the zero pages of the CUDA checkpoint's host
# copy itself, --no-release-zero-pages). Arms combine with "+", as raw-weights+keep-zero-pages; an arm may come more than once. Each arm checkpoints anew and restores with the page cache dropped and again warm,
# output checked; only the first arm's cold start compiles from nothing. ARM_TIMEOUT is each arm's limit
# (s). 1g decoupled, the three default arms: about 5 minutes. The compressed-pages A/B in BENCHMARKS.md:
#   ARMS="compressed-pages default" ... run_formats_ab_h200.sh 1g plain,decoupled           (8 minutes)
#   ARMS="compressed-pages default" ARM_TIMEOUT=330 ... run_formats_ab_h200.sh 8g        (6 minutes)
set -uo pipefail
size=${1:-1g}
modes=${2:-decoupled}
: "${OUT:?OUT must be set (the device tool sets it)}"
. benchmarks/gpu/device_env.sh
keep=()
n=0
for arm in ${ARMS:-default keep-zero-pages raw-weights}; do
    flags=()
    for part in ${arm//+/ }; do
        case $part in
            keep-zero-pages) flags+=(--drop-zero-pages off) ;;
            drop-zero-pages) flags+=(--drop-zero-pages on) ;;
            raw-weights) flags+=(--worker-args "--weights-encoding raw") ;;
            split-nibble-weights) flags+=(--worker-args "--weights-encoding split-nibble") ;;
            compressed-pages) flags+=(--compress-pages on) ;;
            no-release) flags+=("--worker-args=--no-release-zero-pages") ;;
            default) ;;
            *) echo "unknown arm $part" >&2; exit 2 ;;
        esac
    done
    n=$((n + 1))
    # The arm's place in the call names its files, so an arm run twice keeps both runs.
    tag="formats-$n-${arm//+/_and_}"
    timeout "${ARM_TIMEOUT:-290}" python3 benchmarks/gpu/restore_bench.py --size "$size" --modes "$modes" \
        --tag "$tag" --warm-restore --no-bad-inputs --no-diagnostics \
        --calib-gib 2 --out "$OUT" "${flags[@]}" "${keep[@]}" > "$OUT/$tag-$size.log" 2>&1
    echo "size $size $arm: rc=$?"
    keep=(--keep-compile-cache)
done
find "$OUT/criu-logs" -delete 2>/dev/null
python3 - "$OUT" "$size" <<'PY'
import json, sys
from pathlib import Path
out, size = Path(sys.argv[1]), sys.argv[2]
for f in sorted(out.glob(f"gpu-restore-{size}-formats-*.json")):
    r = json.loads(f.read_text())
    for mode, m in r["modes"].items():
        warm = (m.get("warm_restore") or {}).get("restore_s")
        print(f"{f.stem} {mode}: disk {r.get('storage_gbps')} GB/s, checkpoint {m.get('checkpoint_s')} s, "
              f"artifact {m.get('artifact_bytes')} B, restore cold {m.get('restore_s')} s, warm {warm} s, "
              f"identical {m.get('output_identical')}, error {bool(m.get('error'))}")
        phases = m.get("checkpoint_phases") or {}
        print("   checkpoint phases:", {k: round(v, 3) for k, v in phases.items()})
        print("   pages images:", m.get("pages_stats"))
        print("   zero pages released by the worker:", m.get("zero_page_bytes_released"),
              "(the worker's account:", m.get("zero_page_release_worker"), "),",
              "dropped by the agent:", m.get("zero_pages_dropped_bytes"))
PY
