"""CRIU's restore of a process holding --mib of dense private memory, from the page cache, in 4 KiB pages,
with `--restore-huge-pages` (the project's CRIU advising huge pages for that memory before reading it in:
scripts/criu-restore-thp.patch), with the host's transparent huge pages set to `always` for the restore,
and with `--restore-readers` (its restorer reading the pages with several threads:
scripts/criu-restore-readers.patch). The seconds of `criu restore` and the huge pages the process came back
with. Root, real CRIU (the one scripts/test-env.sh builds).

    .venv/bin/python benchmarks/criu_restore_huge_pages.py --repeat 5 \
        --out benchmarks/results/criu-restore-huge-pages-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import emit, host_facts, thp_mode  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402

# Fills a private anonymous mapping of argv[2] MiB with random bytes, says where it is, then waits.
WORKER = r"""
import ctypes, mmap, os, sys, time
size = int(sys.argv[2]) << 20
m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
chunk = os.urandom(1 << 20)
for off in range(0, size, 1 << 20):
    m[off:off + (1 << 20)] = chunk
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(hex(ctypes.addressof(ctypes.c_char.from_buffer(m))))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(1)
"""
# Each arm: huge pages advised, the host's THP mode for the restore (None: as it is), page readers.
ARMS: dict[str, tuple[bool, str | None, int]] = {
    "small_pages": (False, None, 1),
    "restore_huge_pages": (True, None, 1),
    "host_thp_always": (False, "always", 1),
    "small_pages_readers_2": (False, None, 2),
    "restore_huge_pages_readers_2": (True, None, 2),
}


def _anon_huge_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _read_pages(images: Path) -> int:
    """Read the pages images once, into the page cache (every arm restores from there); their bytes."""
    total = 0
    for path in images.glob("pages-*.img"):
        with path.open("rb") as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total


async def _gone(pid: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while await asyncio.to_thread(os.path.exists, f"/proc/{pid}"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} still there")
        await asyncio.sleep(0.02)


async def run(mib: int, repeat: int, work: Path) -> dict[str, Any]:
    ready, images = work / "ready", work / "images"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WORKER,
        str(ready),
        str(mib),
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    while not ready.exists():  # noqa: ASYNC110 - the worker's one sign of having filled its memory
        await asyncio.sleep(0.05)
    await Criu().dump(proc.pid, images)
    await proc.wait()
    pid = proc.pid
    pages_bytes = await asyncio.to_thread(_read_pages, images)
    result: dict[str, Any] = {"mib": mib, "pages_bytes": pages_bytes, "arms": {}}
    for n in range(repeat):
        for arm, (huge, host, readers) in ARMS.items():
            await _gone(pid)
            with thp_mode(host):
                restored = await Criu(restore_huge_pages=huge, restore_readers=readers).restore(
                    images, log_dir=work / f"logs-{arm}-{n}"
                )
            result["arms"].setdefault(arm, []).append(
                {"criu_s": round(restored.seconds, 3), "anon_huge_kib": _anon_huge_kib(restored.pid)}
            )
            os.killpg(restored.pid, signal.SIGKILL)
    await _gone(pid)
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="criu-thp-") as tmp:
        result = asyncio.run(run(args.mib, args.repeat, Path(tmp)))
    result["host"] = host_facts()
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
