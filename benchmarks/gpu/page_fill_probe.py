"""How fast a host fills fresh anonymous memory from a file in the page cache, the work of CRIU's page restore
(its restorer preadv()s the pages image into the restored mappings, one reader): with 4 KiB pages, with
transparent huge pages advised, into memory already faulted in (the copy alone), the faulting alone, and
the same split over several threads. Run as root on the device; prints and writes JSON.

    python3 benchmarks/gpu/page_fill_probe.py --gib 2 --out $OUT/page-fill.json
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.host import drop_caches, emit

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
CHUNK = 256 << 20
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _madvise(region: mmap.mmap, advice: int) -> None:
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(len(region)), advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise {advice}")


def _fresh(size: int, *, huge: bool = False, populate: bool = False) -> mmap.mmap:
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        _madvise(region, MADV_HUGEPAGE)
    if populate:
        _madvise(region, MADV_POPULATE_WRITE)
    return region


def _fill(fd: int, region: mmap.mmap, offset: int) -> None:
    view = memoryview(region)
    done = 0
    while done < len(region):
        done += os.preadv(fd, [view[done : done + CHUNK]], offset + done)
    view.release()


def arm(path: Path, size: int, *, threads: int = 1, huge: bool = False, prefault: bool = False) -> float:
    """GB/s of filling ``size`` bytes of fresh memory from the cached file, over ``threads`` readers."""
    part = size // threads
    regions = [_fresh(part, huge=huge, populate=prefault) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda k: _fill(fd, regions[k], k * part), range(threads)))
        seconds = time.monotonic() - started
    finally:
        os.close(fd)
        for region in regions:
            region.close()
    return round(size / seconds / 1e9, 3)


def fault_only(size: int, *, huge: bool = False) -> float:
    region = _fresh(size, huge=huge)
    started = time.monotonic()
    _madvise(region, MADV_POPULATE_WRITE)
    seconds = time.monotonic() - started
    region.close()
    return round(size / seconds / 1e9, 3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--file", type=Path, default=Path("/tmp/page-fill.bin"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    size = args.gib << 30
    if not args.file.exists() or args.file.stat().st_size != size:
        with args.file.open("wb") as f:
            for _ in range(size // CHUNK):
                f.write(os.urandom(CHUNK))
    drop_caches()
    with args.file.open("rb") as f:
        while f.read(CHUNK):
            pass  # the file in the page cache, as the verify leaves a pages image
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    result: dict[str, object] = {
        "bytes": size,
        "thp_enabled": (thp / "enabled").read_text().strip(),
        "thp_defrag": (thp / "defrag").read_text().strip(),
    }
    gbps: dict[str, float] = {}
    for rnd in range(2):
        for name, run in (
            ("fill_4k_1", lambda: arm(args.file, size)),
            ("fill_4k_4", lambda: arm(args.file, size, threads=4)),
            ("fill_4k_8", lambda: arm(args.file, size, threads=8)),
            ("fill_thp_1", lambda: arm(args.file, size, huge=True)),
            ("fill_thp_4", lambda: arm(args.file, size, threads=4, huge=True)),
            ("copy_only_1", lambda: arm(args.file, size, prefault=True)),
            ("copy_only_4", lambda: arm(args.file, size, threads=4, prefault=True)),
            ("fault_4k", lambda: fault_only(size)),
            ("fault_thp", lambda: fault_only(size, huge=True)),
        ):
            gbps[f"{name}#{rnd}"] = run()
    result["gbps"] = gbps
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
