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

import functools
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.object_store_nodes import FarNodes, Node, bench_main, far_nodes, summary  # noqa: E402

WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "5eed5eed5eed5eed"
CRIU = Path.home() / ".cache" / "dynamo-snapshot" / "bin" / "criu"
ARMS: dict[str, dict[str, Any]] = {"streamed_pages": {"s3_stream_pages": True}, "default": {}}


async def _run(far: FarNodes, node: Node) -> dict[str, Any]:
    got = await far.restore(node, HASH)
    intact = got.verdict.get("digest_after") == got.verdict.get("digest_before")
    return {
        "process_back_s": got.back_s,
        "memory_whole_s": got.verified_s,
        "phases": got.phases,
        "intact": intact,
    }


async def measure(state_mib: int, runs: int, link_mbps: float) -> dict[str, Any]:
    env = {"WORKER_STATE_MIB": str(state_mib)}
    async with far_nodes("object-store-stream-pages-", WORKER, HASH, env, link_mbps, ARMS) as far:
        results = await far.alternate(runs, functools.partial(_run, far))
    summaries = {
        name: summary(r, ("process_back_s", "memory_whole_s"), "intact") for name, r in results.items()
    }
    streamed, default = summaries["streamed_pages"], summaries["default"]
    files = far.manifest.files
    return {
        "artifact_bytes": sum(f.size for f in files),
        "pages_bytes": sum(f.size for f in files if f.path.startswith("criu/pages-")),
        "link_mbps": link_mbps,
        **summaries,
        "process_back_streamed_over_default": round(
            streamed["median_process_back_s"] / default["median_process_back_s"], 3
        ),
        "memory_whole_streamed_over_default": round(
            streamed["median_memory_whole_s"] / default["median_memory_whole_s"], 3
        ),
    }


def main() -> None:
    bench_main(__doc__ or "", "object_store_stream_pages.py", ("--state-mib", 512), measure)


if __name__ == "__main__":
    main()
