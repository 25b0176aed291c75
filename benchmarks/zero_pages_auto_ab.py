"""The agent's zero-page rewrite on and off for a worker that keeps its zero pages (a stock engine), through
the agent's own Executor with real CRIU, on this machine: checkpoint (dump, rewrite, publish), restore with
the page cache dropped, and a second restore on the node (cache warm), arms alternating.

The worker is the agent tests' CPU worker with --state-mib of incompressible state and --zero-mib written
with zeros: by default the share of zeros in the stock GPU worker's dump on the H200 (9.6 of 11.7 GB,
BENCHMARKS.md "On the GPU: the path NVIDIA's agent takes"), at a fifth of its size. A restore ends when
the worker has checked its state (verify.json).

    .venv/bin/python benchmarks/zero_pages_auto_ab.py --out benchmarks/results/zero-pages-auto-ab-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import drop_caches, emit  # noqa: E402
from dynamo_snapshot.agent.executor import Executor  # noqa: E402
from dynamo_snapshot.agent.runtime import ProcessRuntime  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402
from tests.agent.local_node import checkpoint_worker_outcome, local_executor  # noqa: E402
from tests.helpers.polling import await_json  # noqa: E402

WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "5a5a5a5a5a5a5a5a"


async def _restore(executor: Executor, runtime: ProcessRuntime, ctl: Path, key: str) -> float:
    (ctl / "verify.json").unlink(missing_ok=True)
    started = time.monotonic()
    await executor.restore(key, HASH)
    verdict = await await_json(ctl / "verify.json", within=300)
    took = time.monotonic() - started
    await runtime.stop(key)
    if not (verdict["digest_after"] == verdict["digest_before"] and verdict["zeros_intact"]):
        raise RuntimeError(f"{key}: the restored worker's memory differs: {verdict}")
    return took


def _fresh(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


async def arm(tmp: Path, criu: Path, setting: str, env: dict[str, str]) -> dict[str, Any]:
    await asyncio.to_thread(_fresh, tmp)
    executor, runtime = local_executor(tmp, criu, drop_zero_pages=setting)
    await asyncio.to_thread(drop_caches)
    source, outcome = await checkpoint_worker_outcome(executor, runtime, WORKER, HASH, env)
    ctl = source.control_dir
    ctl.mkdir(parents=True, exist_ok=True)  # the restored worker writes its verdict there
    artifact = executor.store.open(HASH)
    out: dict[str, Any] = {
        "setting": setting,
        "checkpoint_s": round(outcome.timings.total(), 3),
        "checkpoint_phases": outcome.timings.phases,
        "artifact_bytes": sum(f.size for f in artifact.manifest.files),
        "zero_pages_dropped_bytes": int(str(artifact.manifest.extra["zeroPagesDropped"])) * 4096,
    }
    await asyncio.to_thread(drop_caches)
    out["restore_s"] = round(await _restore(executor, runtime, ctl, "cold"), 3)
    out["warm_restore_s"] = round(await _restore(executor, runtime, ctl, "warm"), 3)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-mib", type=int, default=430)
    ap.add_argument("--zero-mib", type=int, default=1960)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of arms, alternating which goes first")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    criu = Criu().binary
    env = {"WORKER_STATE_MIB": str(args.state_mib), "WORKER_ZERO_MIB": str(args.zero_mib)}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zero-ab-", dir="/var/tmp") as tmp:
        for r in range(args.rounds):
            order = ("off", "auto") if r % 2 == 0 else ("auto", "off")
            for setting in order:
                runs.append({"round": r, **await arm(Path(tmp) / setting, Path(criu), setting, env)})
                print(runs[-1], flush=True)

    def p50(setting: str, key: str) -> float:
        return round(statistics.median(x[key] for x in runs if x["setting"] == setting), 3)

    keys = ("checkpoint_s", "artifact_bytes", "restore_s", "warm_restore_s")
    summary = {s: {k: p50(s, k) for k in keys} for s in ("auto", "off")}
    emit(
        {
            "benchmark": "agent checkpoint and restores of a worker that keeps its zero pages, "
            "the rewrite auto against off",
            "state_mib": args.state_mib,
            "zero_mib": args.zero_mib,
            "cpus": os.cpu_count(),
            "p50": summary,
            "auto_over_off": {k: round(summary["auto"][k] / summary["off"][k], 3) for k in keys},
            "runs": runs,
        },
        args.out,
    )


if __name__ == "__main__":
    asyncio.run(main())
