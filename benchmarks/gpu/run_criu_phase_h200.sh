#!/usr/bin/env bash
# The CRIU-phase diagnostic (benchmarks/criu_phase.py: a CPU worker with a big decoupled weights file,
# restored through the agent's Executor, page cache dropped) as one device call:
#   run(command="bash benchmarks/gpu/run_criu_phase_h200.sh", carry=[".whl", ".criu-bundle"])
# Arguments go to criu_phase.py. Results land in $OUT/criu-phase-h200.json.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
. benchmarks/gpu/device_env.sh
[ $# -eq 0 ] && set -- --weights-mib 8192 --repeat 2 --variants default,idle_io,p8 --no-read-ahead-off
timeout 560 python3 benchmarks/criu_phase.py --out "$OUT/criu-phase-h200.json" "$@" > "$OUT/criu-phase.log" 2>&1
echo "rc=$?"
tail -c 3000 "$OUT/criu-phase.log"
