"""What the object-store restore benchmarks share: a local SeaweedFS server, node A's checkpoint of a worker
written to it, and nodes that fetch it through one shaped link (a remote store's bandwidth), each into a
node cache of its own, restoring in turn, arm after arm, run after run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks.gpu.host import emit
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import ArtifactCache, Manifest
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot_dev.localcluster.link import shaped_link
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.agent.local_node import checkpoint_worker, local_executor
from tests.helpers.polling import await_json

CRIU = Path.home() / ".cache" / "dynamo-snapshot" / "bin" / "criu"

Node = tuple[Executor, ProcessRuntime, ArtifactCache]
Restore = Callable[[Node], Awaitable[dict[str, Any]]]


@dataclass
class Restored:
    back_s: float  # the restore call returned: CRIU done, the worker told to go on
    verified_s: float  # the worker wrote its verify.json
    phases: dict[str, float]
    verdict: dict[str, Any]


@dataclass
class FarNodes:
    """The shared checkpoint (its manifest and digest, the control dir its restored workers report into)
    and the nodes that fetch it, by arm."""

    manifest: Manifest
    digest: str
    control_dir: Path
    nodes: dict[str, Node]

    async def restore(self, node: Node, identity_hash: str) -> Restored:
        """One restore on ``node`` from an emptied node cache, timed to the call's return and to the
        restored worker's verify.json; the worker is stopped after."""
        executor, runtime, cache = node
        await asyncio.to_thread(cache.discard, identity_hash)
        (self.control_dir / "verify.json").unlink(missing_ok=True)
        started = time.monotonic()
        outcome = await executor.restore("restored", identity_hash, manifest_digest=self.digest)
        back = time.monotonic() - started
        try:
            verdict = await await_json(self.control_dir / "verify.json", within=300, settle=0.05)
            whole = time.monotonic() - started
        finally:
            await runtime.stop("restored")
        phases = {k: round(v, 4) for k, v in outcome.timings.phases.items()}
        return Restored(round(back, 4), round(whole, 4), phases, verdict)

    async def alternate(self, runs: int, one: Restore) -> dict[str, list[dict[str, Any]]]:
        """``one`` restore on each arm's node, arms in turn, ``runs`` times: the runs, by arm."""
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in self.nodes}
        for _ in range(runs):
            for name, node in self.nodes.items():
                results[name].append(await one(node))
        return results


@contextlib.asynccontextmanager
async def far_nodes(
    prefix: str,
    worker: Path,
    identity_hash: str,
    env: dict[str, str],
    link_mbps: float,
    arms: dict[str, dict[str, Any]],
    identity: CheckpointIdentity | None = None,
) -> AsyncIterator[FarNodes]:
    """``worker`` checkpointed on node A and written to the store; a node per arm (its agent settings by
    name, ``kind`` its Executor class) fetching through a ``link_mbps`` link. Everything goes on exit."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    try:
        with LocalS3(root / "server") as server:
            location = S3Location(endpoint=server.endpoint, bucket="checkpoints", prefix="bench/")
            await server.create_bucket(location.bucket)
            creds = server.write_credentials(root / "credentials")
            a, runtime_a = local_executor(
                root / "a", CRIU, compress_pages=False, kind=Executor, runtime_kind=ProcessRuntime
            )
            source = await checkpoint_worker(a, runtime_a, worker, identity_hash, env, identity=identity)
            a.objects = ObjectStore(location, creds)
            await a.share(identity_hash)
            manifest = a.store.open(identity_hash).manifest
            assert manifest.digest is not None
            upstream = urlsplit(server.endpoint)
            assert upstream.hostname is not None
            assert upstream.port is not None
            async with shaped_link(upstream.hostname, upstream.port, bytes_per_s=link_mbps * 1e6) as hostport:
                far = ObjectStore(location.model_copy(update={"endpoint": f"http://{hostport}"}), creds)
                nodes: dict[str, Node] = {}
                for name, settings in arms.items():
                    cache = ArtifactCache(root / name / "cache", 1 << 40)
                    settings = {"kind": Executor, **settings}
                    node, runtime = local_executor(
                        root / name,
                        CRIU,
                        compress_pages=False,
                        objects=far,
                        cache=cache,
                        runtime_kind=ProcessRuntime,
                        **settings,
                    )
                    nodes[name] = (node, runtime, cache)
                yield FarNodes(manifest, manifest.digest, source.control_dir, nodes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summary(runs: list[dict[str, Any]], medians: tuple[str, ...], every: str) -> dict[str, Any]:
    """An arm's runs, the median of each of ``medians`` (as ``median_<key>``) and whether ``every`` run had
    ``every`` true (as ``all_<every>``)."""
    out: dict[str, Any] = {"runs": runs}
    for key in medians:
        out[f"median_{key}"] = round(statistics.median(r[key] for r in runs), 4)
    out[f"all_{every}"] = all(r[every] for r in runs)
    return out


def bench_main(
    doc: str,
    script: str,
    size: tuple[str, int],
    measure: Callable[[int, int, float], Coroutine[Any, Any, dict[str, Any]]],
) -> None:
    """The command line both benchmarks take: the worker's size flag (``size``: its name and default),
    --runs, --link-mbps, --out; the result printed and written with the command that made it."""
    flag, default = size
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument(flag, type=int, default=default)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--link-mbps", type=float, default=100.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    mib = getattr(args, flag.removeprefix("--").replace("-", "_"))
    result = asyncio.run(measure(mib, args.runs, args.link_mbps))
    command = f"benchmarks/{script} {flag} {mib} --runs {args.runs} --link-mbps {args.link_mbps:g}"
    emit({**result, "command": command}, args.out)
