"""Restore of the CPU reference worker from an S3-compatible store against the node's own store: one node
checkpoints (real CRIU, host-process runtime) and writes the artifact to a local SeaweedFS server; another
node with an empty store restores it, fetching every chunk (checked) first; then restores on that node read
its own copy. The page cache is not dropped: on this 2-core machine the server and the agent share the CPU,
so the fetch is bound by hashing and the server, not by a network. Each fetch run starts from an empty node
store.

    python benchmarks/object_store.py --state-mib 256 --runs 5 --out benchmarks/results/object-store-cpu.json
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from benchmarks.gpu.host import emit  # noqa: E402
from dynamo_snapshot.agent.executor import Executor  # noqa: E402
from dynamo_snapshot.agent.object_store import ObjectStore  # noqa: E402
from dynamo_snapshot.agent.runtime import ProcessRuntime  # noqa: E402
from dynamo_snapshot.artifact.s3 import S3Location  # noqa: E402
from dynamo_snapshot_dev.localcluster.s3server import LocalS3  # noqa: E402
from tests.agent.local_node import checkpoint_worker_outcome, local_executor  # noqa: E402

WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "0123456789abcdef"
CRIU = Path.home() / ".cache" / "dynamo-snapshot" / "bin" / "criu"


def _objects(root: Path, location: S3Location, server: LocalS3) -> ObjectStore:
    return ObjectStore(location, server.write_credentials(root / "credentials"))


async def _timed_restore(executor: Executor, runtime: ProcessRuntime, digest: str) -> dict[str, float]:
    started = time.monotonic()
    outcome = await executor.restore("restored", HASH, manifest_digest=digest)
    total = time.monotonic() - started
    await runtime.stop("restored")
    await asyncio.to_thread(shutil.rmtree, outcome.workload.control_dir, True)
    return {"total_s": round(total, 4), "fetch_s": round(outcome.timings.phases.get("fetch", 0.0), 4)}


def _summary(runs: list[dict[str, float]]) -> dict[str, object]:
    return {"runs": runs, "median_total_s": round(statistics.median(r["total_s"] for r in runs), 4)}


async def measure(state_mib: int, runs: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="object-store-", dir="/var/tmp"))
    try:
        with LocalS3(root / "server") as server:
            location = S3Location(endpoint=server.endpoint, bucket="checkpoints", prefix="bench/")
            await server.create_bucket(location.bucket)
            a, runtime_a = local_executor(
                root / "a", CRIU, compress_pages=False, kind=Executor, runtime_kind=ProcessRuntime
            )
            _, outcome = await checkpoint_worker_outcome(
                a, runtime_a, WORKER, HASH, {"WORKER_STATE_MIB": str(state_mib)}
            )
            a.objects = _objects(root / "a", location, server)
            started = time.monotonic()
            await a.share(HASH)
            upload_s = time.monotonic() - started
            artifact_bytes = sum(f.size for f in a.store.open(HASH).manifest.files)
            digest = outcome.manifest_digest

            local = [await _timed_restore(a, runtime_a, digest) for _ in range(runs)]
            b, runtime_b = local_executor(
                root / "b", CRIU, compress_pages=False, kind=Executor, runtime_kind=ProcessRuntime
            )
            b.objects = _objects(root / "b", location, server)
            fetched = []
            for _ in range(runs):
                await asyncio.to_thread(b.store.delete, HASH)
                fetched.append(await _timed_restore(b, runtime_b, digest))
            after = [await _timed_restore(b, runtime_b, digest) for _ in range(runs)]
        return {
            "cores": os.cpu_count(),
            "worker_state_mib": state_mib,
            "artifact_bytes": artifact_bytes,
            "upload_s": round(upload_s, 4),
            "restore_from_node_store": _summary(local),
            "restore_fetching_from_s3": _summary(fetched),
            "restore_after_fetch_node_copy": _summary(after),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = asyncio.run(measure(args.state_mib, args.runs))
    command = f"benchmarks/object_store.py --state-mib {args.state_mib} --runs {args.runs}"
    emit({**result, "command": command}, args.out)


if __name__ == "__main__":
    main()
