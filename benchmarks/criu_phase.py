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
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import FileWatch, criu_log_times, drop_caches  # noqa: E402
from dynamo_snapshot.agent.executor import Executor  # noqa: E402
from dynamo_snapshot.agent.runtime import ProcessRuntime, WorkloadSpec  # noqa: E402
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash  # noqa: E402
from dynamo_snapshot.artifact import ArtifactStore  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402

WORKER = REPO / "tests" / "agent" / "weights_worker.py"


async def one(work: Path, weights_mib: int, prefetch: bool) -> dict[str, Any]:
    identity = CheckpointIdentity.model_validate(
        {"model": f"bench/criu-phase-{weights_mib}", "backendFramework": "vllm"}
    )
    ident_hash = compute_identity_hash(identity)
    criu = Criu()
    runtime = ProcessRuntime(work / "node", criu)
    executor = Executor(
        runtime,
        ArtifactStore(work / "store"),
        criu,
        node_name="bench",
        cuda=None,
        gpus=None,
        prefetch_node_files=prefetch,
    )
    env = {"PYTHONPATH": str(REPO), "WORKER_WEIGHTS_MIB": str(weights_mib)}
    source = await runtime.launch(WorkloadSpec("source", [sys.executable, str(WORKER)], env))
    await executor.wait_ready(source, within=120)
    await executor.checkpoint(source, ident_hash, identity)
    shutil.rmtree(source.control_dir)  # a new node
    await asyncio.to_thread(drop_caches)
    t0 = time.time()
    with FileWatch(runtime.control_dir("restored") / "restore.log") as watch:
        restored = await executor.restore("restored", ident_hash)
    split = criu_log_times(watch, t0, restored.timings.phases)  # before stop() removes the log
    await runtime.stop("restored")
    return {
        "weights_mib": weights_mib,
        "read_ahead": prefetch,
        "phases": restored.timings.phases,
        "weights_verify_s": restored.timings.overlapped.get("weights_verify"),
        "criu_phase_split": split,
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-mib", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    for _ in range(args.repeat):
        for mib in (args.weights_mib, 3):
            for prefetch in (True, False):
                with tempfile.TemporaryDirectory(prefix="criu-phase-") as work:
                    results.append(await one(Path(work), mib, prefetch))
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())
