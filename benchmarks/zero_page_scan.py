"""How fast the SDK's zero-page release scans memory (workload.zero_pages.release_zero_pages), on this
machine, against copying each chunk out and searching the copy for a zero page.

Four kinds of 1 MiB chunks, --mib of each, in private anonymous memory: zero-rich pages (the first KiB
random, the rest zeros, like much of a CUDA host copy), random pages, all-zero chunks, and mixed chunks
(every third page zero). For each kind: the release's seconds (best of --repeat, the memory refilled
before each), and the copy-and-search loop's on the same bytes.

    .venv/bin/python benchmarks/zero_page_scan.py --out benchmarks/results/zero-page-scan-cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import emit  # noqa: E402
from dynamo_snapshot.workload.zero_pages import release_zero_pages  # noqa: E402

PAGE = mmap.PAGESIZE
MIB = 1 << 20


def _zero_rich(n: int) -> bytes:
    out = bytearray(n)
    for off in range(0, n, PAGE):
        out[off : off + 1024] = os.urandom(1024)
    return bytes(out)


def _mixed(n: int) -> bytes:
    out = bytearray(os.urandom(n))
    for off in range(0, n, 3 * PAGE):
        out[off : off + PAGE] = bytes(PAGE)
    return bytes(out)


KINDS: dict[str, Callable[[int], bytes]] = {
    "zero_rich": _zero_rich,
    "random": os.urandom,
    "all_zero": bytes,
    "mixed": _mixed,
}


def _copy_and_search(addr: int, size: int) -> int:
    """The loop the release used before: each chunk copied out, the copy searched for a zero page."""
    zero_page, found = bytes(PAGE), 0
    for off in range(0, size, MIB):
        data = ctypes.string_at(addr + off, MIB)
        found += data.find(zero_page) >= 0
    return found


def measure(kind: str, mib: int, repeat: int) -> dict[str, object]:
    size = mib * MIB
    data = KINDS[kind](size)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    release, search = [], []
    released = 0
    for _ in range(repeat):
        m[:] = data  # every page present again, the released ones included
        t = time.perf_counter()
        _copy_and_search(addr, size)
        search.append(time.perf_counter() - t)
        stats = release_zero_pages([(addr, addr + size)])
        release.append(stats.seconds)
        released = stats.released_bytes
    return {
        "kind": kind,
        "mib": mib,
        "release_s": round(min(release), 4),
        "released_mib": released // MIB,
        "copy_and_search_s": round(min(search), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes of each kind (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    emit({"cpus": os.cpu_count(), "runs": [measure(k, args.mib, args.repeat) for k in KINDS]}, args.out)


if __name__ == "__main__":
    main()
