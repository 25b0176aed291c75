#!/usr/bin/env bash
# A/B of the compressed-pages storage format (the agent's --compress-pages, on by default) in one device call:
#   run(command="bash benchmarks/gpu/run_pages_ab_h200.sh 1g", carry=[".whl", ".criu-bundle"])
# Arguments: the size (default 1g) and the modes (default plain,decoupled). Both arms on the same disk, one
# after the other: checkpoint time, restore time with the page cache dropped and again warm, output checked.
# The second arm keeps the compile cache the first left, so only the first plain cold start compiles.
# 1g fits one call (about 8 minutes). 8g: the decoupled mode alone, ARM_TIMEOUT=360 (each arm's limit, s).
set -uo pipefail
size=${1:-1g}
modes=${2:-plain,decoupled}
: "${OUT:?OUT must be set (the device tool sets it)}"
. benchmarks/gpu/device_env.sh
keep=()
for pages in ${ARMS:-on off}; do
    timeout "${ARM_TIMEOUT:-290}" python3 benchmarks/gpu/restore_bench.py --size "$size" --modes "$modes" \
        --compress-pages "$pages" --tag "pages-$pages" --warm-restore --no-bad-inputs --no-diagnostics \
        --calib-gib 2 --out "$OUT" "${keep[@]}" > "$OUT/ab-$size-pages-$pages.log" 2>&1
    echo "size $size pages $pages: rc=$?"
    keep=(--keep-compile-cache)
done
find "$OUT/criu-logs" -delete 2>/dev/null
python3 - "$OUT" "$size" <<'PY'
import json, sys
from pathlib import Path
out, size = Path(sys.argv[1]), sys.argv[2]
for arm in ("on", "off"):
    f = out / f"gpu-restore-{size}-pages-{arm}.json"
    if not f.exists():
        print(f"pages {arm}: no result"); continue
    r = json.loads(f.read_text())
    for mode, m in r["modes"].items():
        warm = (m.get("warm_restore") or {}).get("restore_s")
        print(f"pages {arm} {mode}: checkpoint {m.get('checkpoint_s')} s, artifact {m.get('artifact_bytes')} B, "
              f"restore cold {m.get('restore_s')} s, warm {warm} s, identical {m.get('output_identical')}, "
              f"error {bool(m.get('error'))}")
PY
