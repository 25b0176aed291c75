"""The page cache: how much of a file it holds (mincore), and filling it ahead of a reader."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WarmResult", "page_cache_fraction", "warm_page_cache"]


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def page_cache_fraction(path: Path | str) -> float | None:
    """How much of the file is in the page cache (0..1), from mincore(2); None where it cannot tell."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        libc = _libc()
        libc.mmap.restype = ctypes.c_void_p
        c = ctypes
        libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            flags = bytes(vec)
            resident = pages - flags.count(0)
            return resident / pages
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class WarmResult:
    path: str
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def warm_page_cache(path: Path | str, *, threads: int = 8, block: int = 16 << 20) -> WarmResult:
    """Read the file through the page cache with `threads` parallel readers so that a later reader
    finds it in memory (the node agent does this for a weights file while CRIU restores the worker)."""
    started = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)

        def read_range(first: int) -> int:
            buf = bytearray(block)
            done = 0
            # Strided: thread k reads blocks k, k + threads, ...; all of them sweep the file forward.
            for offset in range(first * block, size, threads * block):
                done += os.preadv(fd, [buf], offset)
            return done

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weights-warm") as pool:
            total = sum(pool.map(read_range, range(threads)))
    finally:
        os.close(fd)
    return WarmResult(str(path), total, time.monotonic() - started)
