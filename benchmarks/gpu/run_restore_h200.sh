#!/usr/bin/env bash
# The restore benchmark as one device call (see BENCHMARKS.md, "Restore of the reference worker"):
#   run(command="bash benchmarks/gpu/run_restore_h200.sh 1g", carry=[".whl", ".criu-bundle"])
# Arguments: sizes (default 1g), then extra restore_bench.py flags after "--". Results land in $OUT.
# One call stays under the device's 10-minute limit for one size with all modes; give 8g its own call.
set -uo pipefail
sizes=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do sizes+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#sizes[@]} -eq 0 ] && sizes=(1g)
: "${OUT:?OUT must be set (the device tool sets it)}"
. benchmarks/gpu/device_env.sh
for size in "${sizes[@]}"; do
    extra=("$@")
    [ "$size" != 1g ] && extra+=(--no-bad-inputs)
    timeout 580 python3 benchmarks/gpu/restore_bench.py --size "$size" --out "$OUT" "${extra[@]}" \
        > "$OUT/bench-$size.log" 2>&1
    echo "size $size: rc=$?"
    rm -rf "/tmp/restore-bench/models/$size" "/tmp/restore-bench/inductor-$size"  # disk for the next size
done
# Only the decoupled modes' CRIU logs come back (the device returns a limited number of files).
find "$OUT/criu-logs" -name '*plain*' -delete -o -name '*-kv-*' -delete 2>/dev/null
tail -c 400 "$OUT"/bench-*.log
