"""Fold the restore benchmark's raw runs (benchmarks/results/gpu-restore/*.json, as restore_bench.py wrote
them on the H200) into benchmarks/results/gpu-restore.json: one record per (size, mode), each naming the
run and the commit its numbers come from.

    python3 benchmarks/gpu/summarize_restore.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
GIB = 2**30
# The reference worker with the Qwen3 model depths, runs 4-13, each by the commit it measured (RUNS). Run 4:
# no node-file prefetch (its diagnostics tried the weights check before CRIU and with 4 threads); runs 5
# and 6: with it; run 6 (decoupled only, plus CRIU's own files read ahead) met a slower disk (1.35 and
# 1.61 GB/s). Runs 1-3 (benchmarks/results/gpu-restore/run{1,2,3}-*.json) are of the shallower 8/10-layer
# presets, a different worker, reported apart in BENCHMARKS.md. Run 7 (1g) hashes in a helper process and
# signals a waiting worker before the weights check ends; run 8 adds the zero-page drop. Runs 10-13 store
# the weights split-nibble (expanded on the GPU) and the CRIU pages packed (unpacked beside the check): run
# 10 (8g), run 11 (1g, all modes), run 12 (8g, weights check at idle I/O priority by default), run 13 (8g,
# that check started beside the process-file check). Run 9 (8g) stored the weights split-deflate (inflated
# on the CPU, since replaced) on a tree with uncommitted work: BENCHMARKS.md reports it apart and it is
# not a sample here.
RUNS = {
    "run4-1g": "fd112b3",
    "run5-1g": "7aa6fa4",
    "run6-1g": "fac0af6",
    "run5-8g": "7aa6fa4",
    "run6-8g": "fac0af6",
    "run7-1g": "1d644b4",
    "run8-1g": "6f414f9",
    "run8-8g": "6f414f9",
    "run10-8g": "9185c85",
    "run11-1g": "8eb6d0c",
    "run12-8g": "8eb6d0c",
    "run13-8g": "8185e25",
}
PICK = {
    ("1g", "plain"): "run11-1g",
    ("1g", "kv"): "run11-1g",
    ("1g", "decoupled"): "run11-1g",
    # 8g plain and kv have no run with the packed pages and split-nibble weights: their records are run 8's.
    ("8g", "plain"): "run8-8g",
    ("8g", "kv"): "run8-8g",
    ("8g", "decoupled"): "run13-8g",
}


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((RESULTS / "gpu-restore" / f"{name}.json").read_text()))


def main() -> None:
    records = []
    for (size, mode), run_name in PICK.items():
        run = load(run_name)
        rec = run["modes"][mode]
        # Baselines of the same size: an empty compile cache is the first worker of a run; a warm one
        # is every later worker of the runs of that size.
        same_size = [load(n) for n in RUNS if n.endswith(size)]
        empty = [r["modes"][next(iter(r["modes"]))]["cold_start_s"] for r in same_size]
        warm = [m["cold_start_s"] for r in same_size for m in list(r["modes"].values())[1:]]
        cold_start = statistics.mean(empty)
        warm_start = statistics.mean(warm)
        records.append(
            {
                "weights_gib": round(run["model_bytes"] / GIB, 3),
                "mode": mode,
                "cold_start_s": round(cold_start, 2),
                "cold_start_warm_cache_s": round(warm_start, 2),
                "restore_s": rec["restore_s"],
                "sol_s": rec["sol_s"],
                "artifact_gib": round(rec["artifact_bytes"] / GIB, 3),
                "output_identical": rec["output_identical"],
                "restore_over_sol": rec["restore_over_sol"],
                "speedup_vs_cold": round(cold_start / rec["restore_s"], 2),
                "speedup_vs_warm_cache": round(warm_start / rec["restore_s"], 2),
                "checkpoint_s": rec["checkpoint_s"],
                "restore_phases": rec["restore_phases"],
                "restore_overlapped": rec["restore_overlapped"],
                "storage_gbps": run["storage_gbps"],
                "kv_gib": run["kv_gib"],
                "run": run_name,
                "commit": RUNS[run_name],
                "cold_start_samples": {"empty_cache": empty, "warm_cache": warm},
                "disk_read_gb": round(rec["disk_read_mb"] / 1e3, 2),
                "prefetch_bytes": (rec.get("prefetch") or {}).get("bytes"),
                "restore_samples": [
                    r["modes"][mode]["restore_s"]
                    for r in same_size
                    if "restore_s" in r["modes"].get(mode, {})
                ],
            }
        )
    out = RESULTS / "gpu-restore.json"
    out.write_text(json.dumps(records, indent=1) + "\n")
    for r in records:
        print(
            f"{r['weights_gib']:6.2f} GiB {r['mode']:9s} cold {r['cold_start_s']:6.1f} warm "
            f"{r['cold_start_warm_cache_s']:5.1f} restore {r['restore_s']:6.2f} SOL {r['sol_s']:5.2f} "
            f"x{r['speedup_vs_cold']:5.1f}/x{r['speedup_vs_warm_cache']:4.1f} "
            f"artifact {r['artifact_gib']:6.2f} identical {r['output_identical']}"
        )


if __name__ == "__main__":
    main()
