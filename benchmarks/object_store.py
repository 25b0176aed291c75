"""Restore of the CPU reference worker from an S3-compatible store against the node's own store: one node
checkpoints (real CRIU, host-process runtime) and writes the artifact to a local SeaweedFS server; another
node with an empty store and node cache restores it, fetching every chunk (checked) into its node cache
first; then restores on that node read that copy. The fetch is measured on the loopback link and through a
shaped link at each ``--link-mbps`` (a remote store's bandwidth, shared by the fetch's parallel requests).
The page cache is not dropped: on this 2-core machine the server and the agent share the CPU. Each fetch
run starts from an empty node cache.

From the measured times, a model of N nodes restoring one checkpoint at once over a store link of each
bandwidth: with a volume every restore reads the whole artifact from the store; with the object store each
node fetches it once and its later restores read its copy.

    python benchmarks/object_store.py --state-mib 256 --runs 5 --link-mbps 100 400 \
        --out benchmarks/results/object-store-cpu.json
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
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from benchmarks.gpu.host import emit  # noqa: E402
from dynamo_snapshot.agent.executor import Executor  # noqa: E402
from dynamo_snapshot.agent.object_store import ObjectStore  # noqa: E402
from dynamo_snapshot.agent.runtime import ProcessRuntime  # noqa: E402
from dynamo_snapshot.artifact import ArtifactCache  # noqa: E402
from dynamo_snapshot.artifact.s3 import S3Location  # noqa: E402
from dynamo_snapshot_dev.localcluster.link import shaped_link  # noqa: E402
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


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "runs": runs,
        "median_total_s": round(statistics.median(r["total_s"] for r in runs), 4),
        "median_fetch_s": round(statistics.median(r["fetch_s"] for r in runs), 4),
    }


async def _fetching_runs(
    root: Path, location: S3Location, server: LocalS3, digest: str, runs: int
) -> dict[str, Any]:
    # As the chart's agents with storage.type s3: fetched artifacts go into the node cache.
    cache = ArtifactCache(root / "cache", 1 << 40)
    b, runtime_b = local_executor(
        root, CRIU, compress_pages=False, cache=cache, kind=Executor, runtime_kind=ProcessRuntime
    )
    b.objects = _objects(root, location, server)
    fetched = []
    for _ in range(runs):
        await asyncio.to_thread(cache.discard, HASH)
        fetched.append(await _timed_restore(b, runtime_b, digest))
    after = [await _timed_restore(b, runtime_b, digest) for _ in range(runs)]
    return {"fetching": _summary(fetched), "after_fetch": _summary(after)}


def _model(
    artifact_bytes: int, node_rate: float, restore_local_s: float, link_mbps: float, nodes: int, per_node: int
) -> dict[str, Any]:
    """``nodes`` nodes, ``per_node`` restores each, all at once over one store link of ``link_mbps`` MB/s,
    a node taking the artifact in no faster than ``node_rate`` bytes/s (its measured fetch, hashing
    included): the bytes read from the store and the time until the last restore serves. Without a node
    copy every restore reads the whole artifact from the store; with one (the object store's fetch, or the
    node cache in front of a volume) each node reads it once."""
    link = link_mbps * 1e6

    def case(reads_per_node: int) -> dict[str, Any]:
        store_bytes = artifact_bytes * nodes * reads_per_node
        transfer = max(store_bytes / link, artifact_bytes * reads_per_node / node_rate)
        return {"store_bytes": store_bytes, "all_serving_s": round(transfer + restore_local_s, 2)}

    return {
        "link_mbps": link_mbps,
        "nodes": nodes,
        "restores_per_node": per_node,
        "every_restore_reads_the_store": case(per_node),
        "once_per_node": case(1),
    }


async def measure(state_mib: int, runs: int, link_mbps: list[float]) -> dict[str, object]:
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
            loopback = await _fetching_runs(root / "b", location, server, digest, runs)
            shaped = {}
            upstream = urlsplit(server.endpoint)
            for mbps in link_mbps:
                assert upstream.hostname is not None
                assert upstream.port is not None
                async with shaped_link(upstream.hostname, upstream.port, bytes_per_s=mbps * 1e6) as hostport:
                    far = location.model_copy(update={"endpoint": f"http://{hostport}"})
                    shaped[f"{mbps:g}"] = (
                        await _fetching_runs(root / f"link-{mbps:g}", far, server, digest, runs)
                    )["fetching"]
        restore_local_s = statistics.median(r["total_s"] for r in local)
        node_rate = artifact_bytes / loopback["fetching"]["median_fetch_s"]
        return {
            "cores": os.cpu_count(),
            "worker_state_mib": state_mib,
            "artifact_bytes": artifact_bytes,
            "upload_s": round(upload_s, 4),
            "restore_from_node_store": _summary(local),
            "restore_fetching_from_s3": loopback["fetching"],
            "restore_after_fetch_node_copy": loopback["after_fetch"],
            "restore_fetching_over_link_mbps": shaped,
            "model": [
                _model(artifact_bytes, node_rate, restore_local_s, mbps, nodes, per_node)
                for mbps in link_mbps
                for nodes, per_node in ((4, 1), (16, 4))
            ],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--link-mbps", type=float, nargs="*", default=[100.0, 400.0])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = asyncio.run(measure(args.state_mib, args.runs, args.link_mbps))
    links = " ".join(f"{m:g}" for m in args.link_mbps)
    command = (
        f"benchmarks/object_store.py --state-mib {args.state_mib} --runs {args.runs} --link-mbps {links}"
    )
    emit({**result, "command": command}, args.out)


if __name__ == "__main__":
    main()
