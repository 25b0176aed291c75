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

import argparse
import asyncio
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
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash  # noqa: E402
from dynamo_snapshot.artifact import ArtifactCache, Manifest  # noqa: E402
from dynamo_snapshot.artifact.s3 import S3Location  # noqa: E402
from dynamo_snapshot_dev.localcluster.link import shaped_link  # noqa: E402
from dynamo_snapshot_dev.localcluster.s3server import LocalS3  # noqa: E402
from tests.agent.local_node import checkpoint_worker, local_executor  # noqa: E402
from tests.helpers.polling import await_json  # noqa: E402

WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "bench/streamed", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)
CRIU = Path.home() / ".cache" / "dynamo-snapshot" / "bin" / "criu"


def _everything(manifest: Manifest) -> list[str]:
    return [f.path for f in manifest.files]


class WholeFirst(Executor):
    """The agent with every file of a fetch brought before the restore starts."""

    fetch_first = staticmethod(_everything)


async def _run(
    node: Executor, runtime: ProcessRuntime, cache: ArtifactCache, digest: str, ctl: Path
) -> dict[str, Any]:
    await asyncio.to_thread(cache.discard, HASH)
    (ctl / "verify.json").unlink(missing_ok=True)
    started = time.monotonic()
    outcome = await node.restore("restored", HASH, manifest_digest=digest)
    total = time.monotonic() - started
    try:
        verdict = await await_json(ctl / "verify.json", settle=0.05)
    finally:
        await runtime.stop("restored")
        # The weights put back for this worker (a link to this cache's copy): the next restore places its own.
        await asyncio.to_thread(shutil.rmtree, ctl / "weights", True)
    phases = {k: round(v, 4) for k, v in outcome.timings.phases.items()}
    return {"total_s": round(total, 4), "phases": phases, "weights_ok": verdict.get("weights_ok") is True}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": runs,
        "median_total_s": round(statistics.median(r["total_s"] for r in runs), 4),
        "all_weights_ok": all(r["weights_ok"] for r in runs),
    }


async def measure(weights_mib: int, runs: int, link_mbps: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="object-store-streaming-", dir="/var/tmp"))
    try:
        with LocalS3(root / "server") as server:
            location = S3Location(endpoint=server.endpoint, bucket="checkpoints", prefix="bench/")
            await server.create_bucket(location.bucket)
            creds = server.write_credentials(root / "credentials")
            a, runtime_a = local_executor(
                root / "a", CRIU, compress_pages=False, kind=Executor, runtime_kind=ProcessRuntime
            )
            env = {"WORKER_WAITS_FOR_CHECK": "0", "WORKER_WEIGHTS_MIB": str(weights_mib)}
            source = await checkpoint_worker(a, runtime_a, WORKER, HASH, env, identity=IDENTITY)
            a.objects = ObjectStore(location, creds)
            await a.share(HASH)
            artifact = a.store.open(HASH)
            digest = artifact.manifest.digest
            assert digest is not None
            upstream = urlsplit(server.endpoint)
            assert upstream.hostname is not None
            assert upstream.port is not None
            async with shaped_link(upstream.hostname, upstream.port, bytes_per_s=link_mbps * 1e6) as hostport:
                far = ObjectStore(location.model_copy(update={"endpoint": f"http://{hostport}"}), creds)
                nodes = {}
                for name, kind in (("streamed", Executor), ("whole_first", WholeFirst)):
                    cache = ArtifactCache(root / name / "cache", 1 << 40)
                    node, runtime = local_executor(
                        root / name,
                        CRIU,
                        compress_pages=False,
                        objects=far,
                        cache=cache,
                        kind=kind,
                        runtime_kind=ProcessRuntime,
                    )
                    nodes[name] = (node, runtime, cache)
                results: dict[str, list[dict[str, Any]]] = {name: [] for name in nodes}
                for _ in range(runs):
                    for name, (node, runtime, cache) in nodes.items():
                        results[name].append(await _run(node, runtime, cache, digest, source.control_dir))
        weights = sum(f.size for f in artifact.manifest.files if f.path.startswith("weights/"))
        summaries = {name: _summary(r) for name, r in results.items()}
        return {
            "artifact_bytes": sum(f.size for f in artifact.manifest.files),
            "weights_bytes": weights,
            "link_mbps": link_mbps,
            **summaries,
            "streamed_over_whole_first": round(
                summaries["streamed"]["median_total_s"] / summaries["whole_first"]["median_total_s"], 3
            ),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--link-mbps", type=float, default=100.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = asyncio.run(measure(args.weights_mib, args.runs, args.link_mbps))
    command = (
        f"benchmarks/object_store_streaming.py --weights-mib {args.weights_mib} --runs {args.runs} "
        f"--link-mbps {args.link_mbps:g}"
    )
    emit({**result, "command": command}, args.out)


if __name__ == "__main__":
    main()
