"""How fast CRIU pages packed by criu.packed unpack with all cores, one-shot zlib.decompress (what
unpack_file does) against a decompressobj per chunk (what it did first), and against writing the chunks
through a shared mapping of the output instead of pwrite (whether writes into one tmpfs file are what
limits it), on this machine.

    python3 benchmarks/unpack_threads.py [--mib 1024] [--out FILE]

The file is synthetic (text-like runs, some random bytes, some zeros); it is packed once, then unpacked
into /dev/shm three times each way. It compresses far better than a real pages image (14.6x on the H200,
benchmarks/results/unpack-threads-h200.json, against about 4.2x for the reference worker's), so its
speeds compare the ways of unpacking, not what a restore of a real image sees.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu.host import emit
from dynamo_snapshot.criu import packed


def _decompressobj(data: bytes, wbits: int, bufsize: int) -> bytes:
    z = zlib.decompressobj(wbits)
    return z.decompress(data, bufsize + 1)


def _unpack_mapped(src: Path, dst: Path, threads: int) -> None:
    """unpack_file's work, but each chunk is copied into a MAP_SHARED mapping of ``dst``: page faults
    instead of write(2), which takes the file's lock for every chunk."""
    fd = os.open(src, os.O_RDONLY)
    out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        header = packed._read_header(fd, src.name)
        os.ftruncate(out, header.size)
        with mmap.mmap(out, header.size) as mm:

            def one(chunk: Any) -> None:
                data = os.pread(fd, chunk.stored, chunk.offset)
                plain = (
                    data if chunk.kind == packed._RAW else zlib.decompress(data, packed._WBITS, chunk.length)
                )
                mm[chunk.start : chunk.start + chunk.length] = plain

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, header.chunks))
    finally:
        os.close(fd)
        os.close(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path("/dev/shm/unpack-threads")
    work.mkdir(parents=True, exist_ok=True)
    src, pk, dst = work / "src", work / "src.dsz", work / "dst"
    text = b"the quick brown fox jumps over the lazy dog 0123456789 " * 80000
    parts = []
    for i in range(args.mib // 4):
        kind = i % 4
        parts.append(
            bytes(4 << 20)
            if kind == 0
            else text[: 3 << 20] + os.urandom(1 << 20)
            if kind == 1
            else text[: 4 << 20]
        )
    src.write_bytes(b"".join(parts))
    result: dict[str, object] = {"bytes": src.stat().st_size, "threads": packed.DEFAULT_THREADS}
    t = time.perf_counter()
    packed.pack_file(src, pk)
    result["pack_gbps"] = round(src.stat().st_size / (time.perf_counter() - t) / 1e9, 3)
    result["packed_bytes"] = pk.stat().st_size
    for name, patch in (("one_shot", None), ("decompressobj", _decompressobj)):
        runs = []
        for _ in range(3):
            with mock.patch.object(zlib, "decompress", patch) if patch else contextlib.nullcontext():
                t = time.perf_counter()
                packed.unpack_file(pk, dst)
                runs.append(round(src.stat().st_size / (time.perf_counter() - t) / 1e9, 3))
            assert dst.read_bytes() == src.read_bytes()
        result[f"unpack_gbps_{name}"] = runs
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        _unpack_mapped(pk, dst, packed.DEFAULT_THREADS)
        runs.append(round(src.stat().st_size / (time.perf_counter() - t) / 1e9, 3))
        assert dst.read_bytes() == src.read_bytes()
    result["unpack_gbps_mapped"] = runs
    for f in (src, pk, dst):
        f.unlink()
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
