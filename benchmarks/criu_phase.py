"""Does the agent's CRIU phase outlast CRIU while a big weights file is checked beside it? (CPU, real CRIU)

A small Python worker with a decoupled weights file of --weights-mib (tests/agent/weights_worker.py) is
checkpointed and restored through the agent's Executor with the page cache dropped: with that weights
file and with a 3 MiB one, each with the agent's read-ahead (the worker's node files and CRIU's own
files, `--prefetch-node-files`) on and off, --repeat times. For each restore: the phases, how long the
weights check beside CRIU took, and the CRIU phase split at CRIU's own log (before it opened, logged
work, after its last line). On the H200 the phase ran until the weights check ended (BENCHMARKS.md);
this says what happens on this machine, and what the read-ahead changes.

    .venv/bin/python benchmarks/criu_phase.py --weights-mib 2048 --out benchmarks/results/criu-phase-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.agent_variants import VariantExecutor, agent_config  # noqa: E402
from benchmarks.gpu.host import (  # noqa: E402
    FileWatch,
    IoSampler,
    LoopLag,
    criu_log_times,
    drop_caches,
    emit,
    host_facts,
    log_gaps,
)
from dynamo_snapshot.agent.runtime import ProcessRuntime, WorkloadSpec  # noqa: E402
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash  # noqa: E402
from dynamo_snapshot.artifact import ArtifactStore  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402

WORKER = REPO / "tests" / "agent" / "weights_worker.py"


# Knobs of the weights check beside CRIU, by name (--variants).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "idle_io": {"weights_check_idle_io": True},
    "p8": {"weights_check_parallel": 8},
    "p4": {"weights_check_parallel": 4},
}


async def one(work: Path, weights_mib: int, prefetch: bool, variant: str = "default") -> dict[str, Any]:
    identity = CheckpointIdentity.model_validate(
        {"model": f"bench/criu-phase-{weights_mib}", "backendFramework": "vllm"}
    )
    ident_hash = compute_identity_hash(identity)
    criu = Criu()
    runtime = ProcessRuntime(work / "node", criu)
    settings = agent_config(node_name="bench", prefetch_node_files=prefetch)
    executor = VariantExecutor(runtime, ArtifactStore(work / "store"), criu, settings, cuda=None, gpus=None)
    for knob, value in VARIANTS[variant].items():
        setattr(executor, knob, value)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "WORKER_WEIGHTS_MIB": str(weights_mib)}
    source = await runtime.launch(WorkloadSpec("source", [sys.executable, str(WORKER)], env))
    await executor.wait_ready(source, within=120)
    await executor.checkpoint(source, ident_hash, identity)
    shutil.rmtree(source.control_dir)  # a new node
    await asyncio.to_thread(drop_caches)
    t0 = time.time()
    log = runtime.control_dir("restored") / "restore.log"
    with FileWatch(log) as watch, IoSampler(0.1) as io:
        async with LoopLag() as lag:
            restored = await executor.restore("restored", ident_hash)
    split = criu_log_times(watch, t0, restored.timings.phases)  # before stop() removes the log
    gaps = log_gaps(log)
    await runtime.stop("restored")
    return {
        "weights_mib": weights_mib,
        "read_ahead": prefetch,
        "variant": variant,
        "loop_lag": lag.to_dict(),
        "criu_log_gaps": gaps,
        "io_timeline": io.timeline(t0),
        "phases": restored.timings.phases,
        "weights_verify_s": restored.timings.overlapped.get("weights_verify"),
        "criu_phase_split": split,
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-mib", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--variants",
        default="default",
        help=f"weights-check knobs to compare, comma-separated, from {sorted(VARIANTS)}",
    )
    ap.add_argument("--no-small", dest="small", action="store_false", help="skip the 3 MiB reference")
    ap.add_argument("--no-read-ahead-off", dest="read_ahead_off", action="store_false")
    ap.add_argument("--work", type=Path, default=None, help="where artifacts go (default: the temp dir)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants: {sorted(unknown)}")
    results: list[dict[str, Any]] = []
    sizes = [args.weights_mib, 3] if args.small else [args.weights_mib]
    for _ in range(args.repeat):
        for mib in sizes:
            for prefetch in (True, False) if args.read_ahead_off else (True,):
                for variant in variants if mib == args.weights_mib else ["default"]:
                    with tempfile.TemporaryDirectory(prefix="criu-phase-", dir=args.work) as work:
                        results.append(await one(Path(work), mib, prefetch, variant))
                        print(json.dumps({k: results[-1][k] for k in ("weights_mib", "variant", "phases")}))
    results.insert(0, {"host": host_facts()})
    emit(results, args.out)


if __name__ == "__main__":
    asyncio.run(main())
