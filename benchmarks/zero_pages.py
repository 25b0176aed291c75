"""How fast the agent drops zero pages from a CRIU dump (criu.sparse), on this machine, with real CRIU.

A Python process holds --random-mib of random bytes, --zero-mib written with zeros, and --mixed-mib
where every other page is zero, all in private anonymous memory; it is dumped, and drop_zero_pages
rewrites the dump. Reports the seconds, the bytes scanned and dropped, and that the restored process
holds the same bytes.

    .venv/bin/python benchmarks/zero_pages.py --out benchmarks/results/zero-pages-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import emit  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402
from dynamo_snapshot.criu.sparse import drop_zero_pages  # noqa: E402
from tests.helpers.polling import wait_file  # noqa: E402

WORKER = r"""
import hashlib, mmap, os, sys, time
d, rnd, zero, mixed = sys.argv[1], *(int(a) << 20 for a in sys.argv[2:5])
P = mmap.PAGESIZE
m = mmap.mmap(-1, rnd + zero + mixed, flags=mmap.MAP_PRIVATE)
for off in range(0, rnd, 16 << 20):
    m[off:off + min(16 << 20, rnd - off)] = os.urandom(min(16 << 20, rnd - off))
m[rnd:rnd + zero] = bytes(zero)
for i in range(mixed // P):
    off = rnd + zero + i * P
    m[off:off + P] = os.urandom(P) if i % 2 else bytes(P)
def report(name):
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(hashlib.sha256(m).hexdigest())
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))
report("before")
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.02)
report("after")
"""


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-mib", type=int, default=512)
    ap.add_argument("--zero-mib", type=int, default=1024)
    ap.add_argument("--mixed-mib", type=int, default=256)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zero-pages-") as tmp:
        work, images = Path(tmp) / "work", Path(tmp) / "images"
        work.mkdir()
        sizes = (str(args.random_mib), str(args.zero_mib), str(args.mixed_mib))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, str(work), *sizes, start_new_session=True
        )
        restored = None
        try:
            before = await asyncio.to_thread(wait_file, work / "before", 300)
            criu = Criu()
            await criu.dump(proc.pid, images)
            await proc.wait()
            started = time.monotonic()
            stats = await asyncio.to_thread(drop_zero_pages, images)
            seconds = time.monotonic() - started
            restored = await criu.restore(images, log_dir=Path(tmp) / "logs")
            (work / "go").touch()
            after = await asyncio.to_thread(wait_file, work / "after", 300)
        finally:
            for pid in {proc.pid, restored.pid if restored else None} - {None}:
                assert pid is not None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    result = {
        "random_mib": args.random_mib,
        "zero_mib": args.zero_mib,
        "mixed_mib": args.mixed_mib,
        "scanned_gb": round(stats.pages_before * 4096 / 1e9, 3),
        "dropped_gb": round(stats.bytes_dropped / 1e9, 3),
        "seconds": round(seconds, 3),
        "scan_gbps": round(stats.pages_before * 4096 / 1e9 / seconds, 2),
        "restored_identical": before == after,
        "cpus": os.cpu_count(),
    }
    emit(result, args.out)


if __name__ == "__main__":
    asyncio.run(main())
