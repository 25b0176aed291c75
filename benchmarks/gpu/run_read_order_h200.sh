#!/usr/bin/env bash
# The decoupled restore's read order, and a node's burst, in one device call per size:
#   run(command="bash benchmarks/gpu/run_read_order_h200.sh 8g", carry=[".whl", ".criu-bundle"])
# Arguments: the size (default 1g), the burst (default 4), the variants (see restore_bench.VARIANTS).
# One checkpoint (pages as CRIU wrote them, the agent's default), then restores of it, each with the page
# cache dropped and nothing verified: the defaults, then each variant; a second restore on the node (page
# cache warm); then one restore alone and the burst, each copy in namespaces of its own. About 5 minutes
# at 8g (most of it the first cold start, which compiles from nothing), 4 at 1g; the limit is 560 s.
# MODES: the worker modes checkpointed and restored, each with the variants (default decoupled; the burst
# is the decoupled artifact's). BENCH_ARGS: more restore_bench.py flags (--keep-compile-cache on a machine
# still warm from a call, --kv-gib).
set -uo pipefail
size=${1:-1g}
burst=${2:-4}
variants=${3:-default,weights_after,overlap,overlap_weights_after}
: "${OUT:?OUT must be set (the device tool sets it)}"
. benchmarks/gpu/device_env.sh
timeout 560 python3 benchmarks/gpu/restore_bench.py --size "$size" --modes "${MODES:=decoupled}" --compress-pages off \
    --tag read-order --warm-restore --no-bad-inputs --variants "$variants" --variants-for "$MODES" --burst "$burst" \
    --calib-gib 2 --out "$OUT" ${BENCH_ARGS:-} > "$OUT/read-order-$size.log" 2>&1
echo "size $size: rc=$?"
find "$OUT/criu-logs" -delete 2>/dev/null
python3 - "$OUT/gpu-restore-$size-read-order.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("disk", r.get("storage_gbps"), "GB/s;", r.get("host", {}).get("vda_scheduler"))
def line(name, x):
    print(f"{name}: restore {x.get('restore_s')} s, first token {x.get('first_token_s')} s "
          f"(right: {x.get('first_token_identical')}), first answer {x.get('first_answer_s')} s, "
          f"phases {x.get('restore_phases')}, identical {x.get('output_identical')}, error {bool(x.get('error'))}")
for mode, m in r["modes"].items():
    print(f"== {mode}")
    if "error" in m:
        print(m["error"][-1500:])
    print("cold start", m.get("cold_start_s"), "checkpoint", m.get("checkpoint_s"), "artifact",
          m.get("artifact_bytes"), "sol", m.get("sol_s"))
    line("restore", m)
    line("warm", m.get("warm_restore") or {})
    for name, x in (m.get("diagnostics") or {}).items():
        line(name, x)
    b = m.get("burst") or {}
    for k in ("alone", "burst"):
        g = b.get(k) or {}
        print(k, "all serving", g.get("all_serving_s"), "read MB", g.get("disk_read_mb"),
              [(c.get("restore_s"), c.get("output_identical"), bool(c.get("error"))) for c in g.get("copies", [])])
        for c in g.get("copies", []):
            if c.get("error"):
                print(c["error"][-800:])
                print("worker log:", (c.get("worker_log") or "")[-600:])
    if b:
        print("burst/alone", b.get("burst_over_alone"))
PY
