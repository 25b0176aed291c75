"""A restore from an S3-compatible store of a worker that reads its decoupled weights as they arrive
(agent --s3-stream-weights, on by default; the SDK's `reads_arriving_weights`): the worker told to go on
while the fetch still brings its weights file, reading each chunk once it is in and checked ("arriving"),
against the same worker told to go on once the fetch is over ("after the fetch", the setting off). Real
CRIU (host-process runtime), a local SeaweedFS server, each fetch through a shaped link (a remote store's
bandwidth) into an emptied node cache; the two alternate, run by run. Per run: when the restore call
returned, and when the worker had read every byte of its weights, checked them against what it saved
and had the agent's verdict (its verify.json).

    python benchmarks/object_store_arriving_weights.py --weights-mib 512 --runs 3 --link-mbps 100 \
        --out benchmarks/results/object-store-arriving-weights-cpu.json
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
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash  # noqa: E402

WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "bench/arriving", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)
ARMS: dict[str, dict[str, Any]] = {"arriving": {}, "after_fetch": {"s3_stream_weights": False}}


async def _run(far: FarNodes, node: Node) -> dict[str, Any]:
    try:
        got = await far.restore(node, HASH)
    finally:
        # The weights put back for this worker (a link to this cache's copy): the next restore places its own.
        await asyncio.to_thread(shutil.rmtree, far.control_dir / "weights", True)
    return {
        "back_s": got.back_s,
        "weights_read_s": got.verified_s,
        "phases": got.phases,
        "weights_ok": got.verdict.get("weights_ok") is True,
    }


async def measure(weights_mib: int, runs: int, link_mbps: float) -> dict[str, Any]:
    env = {
        "WORKER_WAITS_FOR_CHECK": "1",
        "WORKER_READS_ARRIVING": "1",
        "WORKER_WEIGHTS_MIB": str(weights_mib),
    }
    async with far_nodes(
        "object-store-arriving-weights-", WORKER, HASH, env, link_mbps, ARMS, identity=IDENTITY
    ) as far:
        results = await far.alternate(runs, functools.partial(_run, far))
    files = far.manifest.files
    summaries = {name: summary(r, ("back_s", "weights_read_s"), "weights_ok") for name, r in results.items()}
    return {
        "artifact_bytes": sum(f.size for f in files),
        "weights_bytes": sum(f.size for f in files if f.path.startswith("weights/")),
        "link_mbps": link_mbps,
        **summaries,
        "arriving_over_after_fetch": round(
            summaries["arriving"]["median_weights_read_s"]
            / summaries["after_fetch"]["median_weights_read_s"],
            3,
        ),
    }


def main() -> None:
    bench_main(__doc__ or "", "object_store_arriving_weights.py", ("--weights-mib", 512), measure)


if __name__ == "__main__":
    main()
