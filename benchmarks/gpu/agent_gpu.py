"""Agent checkpoint/restore of a real torch worker on a GPU, through the project's own code path
(ProcessRuntime + Executor: CUDA driver checkpoint API, CRIU, artifact store). Runs on the H200 device.

    python3 benchmarks/gpu/agent_gpu.py --weights-gib 8 --out $OUT/agent-gpu.json

Prints and writes {weights_gib, cuda_checkpoint_s, criu_dump_s, artifact_gib, criu_restore_s,
cuda_restore_s, restore_total_s, cold_start_s} plus details. Page cache is dropped before the cold start
and before the restore, so both read from disk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import drop_caches, wait_json  # noqa: E402
from dynamo_snapshot.agent.config import AgentConfig  # noqa: E402
from dynamo_snapshot.agent.executor import Executor  # noqa: E402
from dynamo_snapshot.agent.runtime import ProcessRuntime, WorkloadSpec  # noqa: E402
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash  # noqa: E402
from dynamo_snapshot.artifact import ArtifactStore  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402

WORKER = REPO / "tests" / "gpu" / "torch_worker.py"


def make_weights(work: Path, gib: float) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    weights = work / "weights.bin"
    blocks = int(gib * 16)
    subprocess.run(
        [
            "dd",
            "if=/dev/urandom",
            f"of={weights}",
            "bs=64M",
            f"count={blocks}",
            "iflag=fullblock",
            "status=none",
        ],
        check=True,
    )
    return weights


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gib", type=float, default=8.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/agent-gpu"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    weights = await asyncio.to_thread(make_weights, args.work, args.weights_gib)

    criu = Criu()
    await criu.require()
    runtime = ProcessRuntime(args.work / "control", criu)
    store = ArtifactStore(args.work / "artifacts")
    executor = Executor(runtime, store, criu, AgentConfig(node_name=os.uname().nodename))
    identity = CheckpointIdentity.model_validate({"model": "bench/raw-weights", "backendFramework": "vllm"})
    ident_hash = compute_identity_hash(identity)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": pythonpath, "WORKER_LINGER_S": "3"}
    res: dict[str, object] = {"weights_gib": args.weights_gib}

    await asyncio.to_thread(drop_caches)
    started = time.time()
    source = await runtime.launch(WorkloadSpec("source", [sys.executable, str(WORKER), str(weights)], env))
    await executor.wait_ready(source, within=600)
    res["cold_start_s"] = round(time.time() - started, 3)
    res["cold_timings"] = await wait_json(source.control_dir / "cold-timings.json", within=5)

    ckpt = await executor.checkpoint(source, ident_hash, identity)
    res["checkpoint_timings"] = ckpt.timings.phases
    res["cuda_checkpoint_s"] = ckpt.timings.phases.get("cuda_checkpoint")
    res["criu_dump_s"] = ckpt.timings.phases.get("criu_dump")
    res["artifact_gib"] = round(ckpt.artifact_bytes / 2**30, 3)

    await asyncio.to_thread(drop_caches)
    t0 = time.time()
    restored = await executor.restore("restored", ident_hash)
    verify = await wait_json(restored.workload.control_dir / "verify.json", within=300)
    res["restore_total_s"] = round(float(str(verify["verified_at"])) - t0, 3)
    res["restore_timings"] = restored.timings.phases
    res["criu_restore_s"] = restored.timings.phases.get("criu_restore")
    res["cuda_restore_s"] = restored.timings.phases.get("cuda_restore")
    res["verify_s"] = restored.timings.phases.get("verify")
    res["weights_ok"] = verify["weights_ok"]
    res["graph_ok"] = verify["graph_ok"]
    res["speedup_vs_cold"] = round(float(str(res["cold_start_s"])) / float(str(res["restore_total_s"])), 2)
    await runtime.stop("restored")
    await asyncio.to_thread(write_json, args.out, res)
    print(json.dumps(res, indent=1))
    return 0 if verify["weights_ok"] and verify["graph_ok"] else 1


def write_json(path: Path, data: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
