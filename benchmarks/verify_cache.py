"""What the agent's verified-files cache saves: hashing an artifact's files for every restore, against
once per node while they are unchanged; and three concurrent restores each hashing, against one shared
check. The artifact is random data of the demo's size (CRIU pages of a 256 MiB worker) in /var/tmp; the
page cache is warmed first, so what is timed is hashing, as for restores 2..N on a node.

    .venv/bin/python benchmarks/verify_cache.py --mib 280 --out benchmarks/results/verify-cache.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import emit  # noqa: E402
from dynamo_snapshot.artifact import ArtifactStore, ArtifactWriter, VerifiedFiles  # noqa: E402
from tests.artifact.helpers import H200, HASH, IDENTITY  # noqa: E402


async def measure(mib: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="verify-cache-", dir="/var/tmp"))
    try:
        store = ArtifactStore(root)
        with ArtifactWriter(store, HASH) as writer:
            (writer.directory / "pages-1.img").write_bytes(os.urandom((mib - 8) << 20))
            (writer.directory / "core-1.img").write_bytes(os.urandom(8 << 20))
            await writer.publish(
                criu_version="4.1.1", gpus=H200, identity=IDENTITY, source_node="n", timings={}
            )
        artifact = store.open(HASH)
        artifact.verify()  # warm the page cache
        uncached = [round(artifact.verify().seconds, 4) for _ in range(3)]
        cache = VerifiedFiles()
        cached = [round(artifact.verify(verified=cache).seconds, 4) for _ in range(3)]
        started = time.monotonic()
        await asyncio.gather(*(artifact.averify() for _ in range(3)))
        concurrent = round(time.monotonic() - started, 4)
        return {
            "artifact_mib": mib,
            "cores": os.cpu_count(),
            "verify_every_restore_s": uncached,
            "verify_with_cache_s": cached,
            "three_concurrent_uncached_s": concurrent,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=280)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = asyncio.run(measure(args.mib))
    emit({**result, "command": f"benchmarks/verify_cache.py --mib {args.mib}"}, args.out)


if __name__ == "__main__":
    main()
