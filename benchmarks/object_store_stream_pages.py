"""A restore from an S3-compatible store on a node without the artifact, with the memory pages streamed
(agent --s3-stream-pages: CRIU restores with --lazy-pages once the images and the chunks of pages it reads
itself are in, every other page served as the fetch checks it) against the default (CRIU once every
process file is in). The agent tests' CPU worker holding --state-mib of state; real CRIU (host-process
runtime), a local SeaweedFS server, each fetch through a shaped link into an emptied node cache; the two
alternate, run by run. Per run: the process back (the restore call returns: CRIU done, the worker told
to go on), its memory whole (the worker has read all of its state and found it intact), the phases.

    python benchmarks/object_store_stream_pages.py --state-mib 512 --runs 5 --link-mbps 100 \
        --out benchmarks/results/object-store-stream-pages-cpu.json
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
from dynamo_snapshot.artifact import ArtifactCache  # noqa: E402
from dynamo_snapshot.artifact.s3 import S3Location  # noqa: E402
from dynamo_snapshot_dev.localcluster.link import shaped_link  # noqa: E402
from dynamo_snapshot_dev.localcluster.s3server import LocalS3  # noqa: E402
from tests.agent.local_node import checkpoint_worker, local_executor  # noqa: E402
from tests.helpers.polling import await_json  # noqa: E402

WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "5eed5eed5eed5eed"
CRIU = Path.home() / ".cache" / "dynamo-snapshot" / "bin" / "criu"
ARMS = {"streamed_pages": True, "default": False}


async def _run(
    node: Executor, runtime: ProcessRuntime, cache: ArtifactCache, digest: str, ctl: Path
) -> dict[str, Any]:
    await asyncio.to_thread(cache.discard, HASH)
    (ctl / "verify.json").unlink(missing_ok=True)
    started = time.monotonic()
    outcome = await node.restore("restored", HASH, manifest_digest=digest)
    back = time.monotonic() - started
    try:
        verdict = await await_json(ctl / "verify.json", within=300, settle=0.05)
        whole = time.monotonic() - started
    finally:
        await runtime.stop("restored")
    phases = {k: round(v, 4) for k, v in outcome.timings.phases.items()}
    intact = verdict.get("digest_after") == verdict.get("digest_before")
    return {
        "process_back_s": round(back, 4),
        "memory_whole_s": round(whole, 4),
        "phases": phases,
        "intact": intact,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": runs,
        "median_process_back_s": round(statistics.median(r["process_back_s"] for r in runs), 4),
        "median_memory_whole_s": round(statistics.median(r["memory_whole_s"] for r in runs), 4),
        "all_intact": all(r["intact"] for r in runs),
    }


async def measure(state_mib: int, runs: int, link_mbps: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="object-store-stream-pages-", dir="/var/tmp"))
    try:
        with LocalS3(root / "server") as server:
            location = S3Location(endpoint=server.endpoint, bucket="checkpoints", prefix="bench/")
            await server.create_bucket(location.bucket)
            creds = server.write_credentials(root / "credentials")
            a, runtime_a = local_executor(
                root / "a", CRIU, compress_pages=False, kind=Executor, runtime_kind=ProcessRuntime
            )
            source = await checkpoint_worker(a, runtime_a, WORKER, HASH, {"WORKER_STATE_MIB": str(state_mib)})
            a.objects = ObjectStore(location, creds)
            await a.share(HASH)
            manifest = a.store.open(HASH).manifest
            digest = manifest.digest
            assert digest is not None
            upstream = urlsplit(server.endpoint)
            assert upstream.hostname is not None
            assert upstream.port is not None
            async with shaped_link(upstream.hostname, upstream.port, bytes_per_s=link_mbps * 1e6) as hostport:
                far = ObjectStore(location.model_copy(update={"endpoint": f"http://{hostport}"}), creds)
                nodes = {}
                for name, stream in ARMS.items():
                    cache = ArtifactCache(root / name / "cache", 1 << 40)
                    node, runtime = local_executor(
                        root / name,
                        CRIU,
                        compress_pages=False,
                        objects=far,
                        cache=cache,
                        kind=Executor,
                        runtime_kind=ProcessRuntime,
                        s3_stream_pages=stream,
                    )
                    nodes[name] = (node, runtime, cache)
                results: dict[str, list[dict[str, Any]]] = {name: [] for name in nodes}
                for _ in range(runs):
                    for name, (node, runtime, cache) in nodes.items():
                        results[name].append(await _run(node, runtime, cache, digest, source.control_dir))
        summaries = {name: _summary(r) for name, r in results.items()}
        streamed, default = summaries["streamed_pages"], summaries["default"]
        pages = sum(f.size for f in manifest.files if f.path.startswith("criu/pages-"))
        return {
            "artifact_bytes": sum(f.size for f in manifest.files),
            "pages_bytes": pages,
            "link_mbps": link_mbps,
            **summaries,
            "process_back_streamed_over_default": round(
                streamed["median_process_back_s"] / default["median_process_back_s"], 3
            ),
            "memory_whole_streamed_over_default": round(
                streamed["median_memory_whole_s"] / default["median_memory_whole_s"], 3
            ),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=int, default=512)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--link-mbps", type=float, default=100.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = asyncio.run(measure(args.state_mib, args.runs, args.link_mbps))
    command = (
        f"benchmarks/object_store_stream_pages.py --state-mib {args.state_mib} --runs {args.runs} "
        f"--link-mbps {args.link_mbps:g}"
    )
    emit({**result, "command": command}, args.out)


if __name__ == "__main__":
    main()
