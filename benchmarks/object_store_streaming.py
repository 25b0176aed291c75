"""A restore from an S3-compatible store of a worker whose weights travel beside its process images (the
SDK's decoupled weights), on a node without the artifact: CRIU restores the process from the process images
as soon as they are in while the weights still arrive ("streamed", the agent's default) against the restore
begun only once the whole artifact is in ("whole first": the same fetch, every file brought before the
restore starts). Real CRIU (host-process runtime), a local SeaweedFS server, each fetch through a shaped
link (a remote store's bandwidth) into an emptied node cache; the two alternate, run by run, so both see
the same machine. Per run: the restore's time (the call to the worker told to go on), its phases, and
whether the worker found its weights intact.

    python benchmarks/object_store_streaming.py --weights-mib 256 --runs 5 --link-mbps 100 \
        --out benchmarks/results/object-store-streaming-cpu.json
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.object_store_nodes import FarNodes, Node, bench_main, far_nodes, summary  # noqa: E402
from dynamo_snapshot.agent.executor import Executor  # noqa: E402
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash  # noqa: E402
from dynamo_snapshot.artifact import Manifest  # noqa: E402

WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "bench/streamed", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)
CRIU = Path.home() / ".cache" / "dynamo-snapshot" / "bin" / "criu"


def _everything(manifest: Manifest) -> list[str]:
    return [f.path for f in manifest.files]


class WholeFirst(Executor):
    """The agent with every file of a fetch brought before the restore starts."""

    fetch_first = staticmethod(_everything)


async def _run(far: FarNodes, node: Node) -> dict[str, Any]:
    try:
        got = await far.restore(node, HASH)
    finally:
        # The weights put back for this worker (a link to this cache's copy): the next restore places its own.
        await asyncio.to_thread(shutil.rmtree, far.control_dir / "weights", True)
    return {"total_s": got.back_s, "phases": got.phases, "weights_ok": got.verdict.get("weights_ok") is True}


async def measure(weights_mib: int, runs: int, link_mbps: float) -> dict[str, Any]:
    env = {"WORKER_WAITS_FOR_CHECK": "0", "WORKER_WEIGHTS_MIB": str(weights_mib)}
    arms: dict[str, dict[str, Any]] = {"streamed": {}, "whole_first": {"kind": WholeFirst}}
    async with far_nodes(
        "object-store-streaming-", WORKER, HASH, env, link_mbps, arms, identity=IDENTITY
    ) as far:
        results = await far.alternate(runs, functools.partial(_run, far))
    files = far.manifest.files
    weights = sum(f.size for f in files if f.path.startswith("weights/"))
    summaries = {name: summary(r, ("total_s",), "weights_ok") for name, r in results.items()}
    return {
        "artifact_bytes": sum(f.size for f in files),
        "weights_bytes": weights,
        "link_mbps": link_mbps,
        **summaries,
        "streamed_over_whole_first": round(
            summaries["streamed"]["median_total_s"] / summaries["whole_first"]["median_total_s"], 3
        ),
    }


def main() -> None:
    bench_main(__doc__ or "", "object_store_streaming.py", ("--weights-mib", 256), measure)


if __name__ == "__main__":
    main()
