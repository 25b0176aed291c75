"""One table of ours / theirs from one device call: restore_bench.py's stock, plain and decoupled modes,
those it ran (this project's agent), and vs_nvidia_gpu.py (the path NVIDIA's agent takes) on the same
machine, worker and disk.

    python3 benchmarks/gpu/compare_vs_nvidia.py OUT/gpu-restore-1g-vs-nvidia.json [MORE.json ...] \
        OUT/gpu-nvidia-path-1g.json benchmarks/results/vs-nvidia-snapshot-gpu.json

restore_bench.py files before the last two: their modes together (a mode run in a second call on the same
warm machine, say), each with the disk bandwidth its own call measured.

Restores with the page cache dropped are the mode's first restore and its `default` diagnostics (each
with nothing verified); warm ones its `warm_restore` and `warm_node` diagnostics. A restore counts only
where the worker answered and its answer matched the cold worker's; any other is a failure.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

OURS = ("stock", "stock_keep_zeros", "stock_huge_advice", "plain", "decoupled")


def spread(values: list[float]) -> dict[str, float] | None:
    """How many, the median and the 95th percentile (nearest rank); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]
    return {"n": len(ordered), "p50": round(statistics.median(ordered), 3), "p95": round(p95, 3)}


def _good(rec: dict[str, Any]) -> bool:
    return "restore_s" in rec and bool(rec.get("output_identical"))


def our_restores(mode: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A mode's (cache dropped, cache warm) restore records, in the order they ran."""
    dropped = [mode]  # its first restore (a mode that failed before it counts one failure)
    warm = [mode["warm_restore"]] if mode.get("warm_restore") else []
    for label, rec in (mode.get("diagnostics") or {}).items():
        name = label.split("#")[0]
        if name == "default":
            dropped.append(rec)
        elif name == "warm_node":
            warm.append(rec)
    return dropped, warm


def summarize(restores: list[dict[str, Any]], key: str) -> dict[str, Any]:
    good = [r for r in restores if _good(r)]
    return {
        "restore_s": spread([r["restore_s"] for r in good]),
        "first_token_s": spread([r["first_token_s"] for r in good if "first_token_s" in r]),
        "cpu_all_s": spread([r[key] for r in good if key in r]),
        "failures": len(restores) - len(good),
    }


def side(
    checkpoint: dict[str, Any], dropped: list[dict[str, Any]], warm: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "cold_start_s": checkpoint.get("cold_start_s"),
        "checkpoint_s": checkpoint.get("checkpoint_s"),
        "checkpoint_cpu_all_s": checkpoint.get("checkpoint_cpu_all_s"),
        "artifact_bytes": checkpoint.get("artifact_bytes"),
        "cache_dropped": summarize(dropped, "cpu_all_s"),
        "cache_warm": summarize(warm, "cpu_all_s"),
    }


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and b:
        return round(a / b, 3)
    return None


CPU_NOTE = (
    "cpu_all_s: CRIU, cuda-checkpoint and the agent (ours runs in the benchmark's process, its samplers "
    "counted too), its helper processes, and the restored tree's own restore work (the restorer reading "
    "the pages, the CUDA restore's thread) from /proc. Runs that recorded only cpu_s missed the last two "
    "and get no CPU figures here"
)


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    keys = ("checkpoint_s", "checkpoint_cpu_all_s", "artifact_bytes")
    out: dict[str, float | None] = {k: _ratio(ours[k], theirs[k]) for k in keys}
    for cache in ("cache_dropped", "cache_warm"):
        for metric in ("restore_s", "first_token_s", "cpu_all_s"):
            for stat in ("p50", "p95"):
                a, b = ours[cache][metric], theirs[cache][metric]
                out[f"{cache}.{metric}.{stat}"] = _ratio(a and a[stat], b and b[stat])
    return out


def compare(benches: list[dict[str, Any]], nvidia: dict[str, Any]) -> dict[str, Any]:
    theirs_dropped = [r for r in nvidia.get("restores", []) if r.get("cache") != "warm"]
    theirs_warm = [r for r in nvidia.get("restores", []) if r.get("cache") == "warm"]
    theirs = side(nvidia, theirs_dropped, theirs_warm)
    first = benches[0]
    out: dict[str, Any] = {
        "size": first.get("size"),
        "kv_gib": first.get("kv_gib"),
        "host": first.get("host"),
        "theirs": {
            "path": "NVIDIA's agent's mechanism",
            "criu": nvidia.get("criu"),
            "storage_gbps": nvidia.get("storage_gbps"),
            **theirs,
        },
        "ours": {},
        "ours_over_theirs": {},
        "cpu": CPU_NOTE,
    }
    for mode in OURS:
        found = [(b, b["modes"][mode]) for b in benches if mode in b.get("modes", {})]
        if not found:
            continue
        bench, rec = found[-1]
        ours = {"storage_gbps": bench.get("storage_gbps"), **side(rec, *our_restores(rec))}
        out["ours"][mode] = ours
        out["ours_over_theirs"][mode] = ratios(ours, theirs)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    *benches, nvidia = (json.loads(Path(p).read_text()) for p in argv[:-1])
    result = compare(benches, nvidia)
    Path(argv[-1]).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"ours_over_theirs": result["ours_over_theirs"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
