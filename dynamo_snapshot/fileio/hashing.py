"""Hashing big files fast: every file cut into pieces that one pool of threads reads and hashes at
once (``pread`` per piece, a buffer per thread), optionally copying each piece on the way.

The threads spend their time in syscalls and in hashlib, both of which release the GIL, so they really
run in parallel; one huge file (CRIU's pages-1.img, a weights file) keeps every thread busy.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dynamo_snapshot.fileio.blocks import ALIGN, open_maybe_direct, transfer_block, usable_cpus
from dynamo_snapshot.fileio.bulk import IoStats, in_thread
from dynamo_snapshot.fileio.ioprio import IDLE, set_thread_ioprio

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HASH_BLOCK_SIZE",
    "HASH_PARALLEL",
    "FileDigests",
    "HashJob",
    "ahash_files",
    "chunk_count",
    "hash_files",
    "spans",
]

# Files larger than this are sealed as SHA-256s of pieces this size, so that one huge file (CRIU's
# pages-1.img, a weights file) is hashed by many threads instead of one.  64 MiB keeps the digest
# list short (160 per 10 GiB) while giving 16 cores plenty of independent work.
DEFAULT_CHUNK_BYTES = 64 << 20
# The read size inside one chunk: big enough that hashlib drops the GIL for long stretches and the
# page cache's readahead keeps up, small enough that a buffer per thread stays cheap.
HASH_BLOCK_SIZE = 4 << 20
# Twice the cores: half the threads wait in pread while the others hash.
HASH_PARALLEL = min(32, 2 * usable_cpus())


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many ``chunk_bytes`` pieces a file of ``size`` bytes has (the last may be shorter)."""
    return -(-size // chunk_bytes)


def spans(total: int, step: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each consecutive ``step``-byte piece of ``total`` bytes (the last may be
    shorter; none when ``total`` is 0)."""
    return [(offset, min(step, total - offset)) for offset in range(0, total, step)]


@dataclass(frozen=True)
class HashJob:
    """One file to hash: whole (``chunk_bytes`` None), or as consecutive ``chunk_bytes`` pieces.

    ``size`` is what to read (the size the file should have); ``dst``, when set, receives a copy of
    the bytes read, so a fetch checks what it copies without reading anything twice.
    """

    src: Path
    size: int
    chunk_bytes: int | None = None
    dst: Path | None = None

    def ranges(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of each piece; a whole-file job is one piece, even when empty."""
        if self.chunk_bytes is None:
            return [(0, self.size)]
        return spans(self.size, self.chunk_bytes)


@dataclass(frozen=True)
class FileDigests:
    """What hashing one job found: one digest per piece of ``job.ranges()``, and what was read.

    ``stats.bytes`` short of ``job.size`` means the file ended early; the digests of the pieces it
    did not fully reach are then of what was there.
    """

    job: HashJob
    digests: tuple[str, ...]
    stats: IoStats


class _Range(NamedTuple):
    digest: str
    bytes: int
    direct: bool
    started: float
    ended: float


class _Buffers(threading.local):
    """One read buffer per worker thread, reused across its pieces (mmap: page-aligned for O_DIRECT)."""

    buf: mmap.mmap | None = None

    def get(self, size: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) < size:
            self.buf = mmap.mmap(-1, size)
        return self.buf


def _hash_range(
    job: HashJob, offset: int, length: int, *, direct: bool, block_size: int, buffers: _Buffers
) -> _Range:
    """SHA-256 of ``length`` bytes at ``offset`` of ``job.src`` (copied to ``job.dst`` on the way)."""
    started = time.monotonic()
    hasher = hashlib.sha256()
    got = 0
    src, src_direct = open_maybe_direct(job.src, os.O_RDONLY, direct)
    try:
        dst, dst_direct = (
            open_maybe_direct(job.dst, os.O_WRONLY, direct) if job.dst is not None else (None, False)
        )
        try:
            buf = buffers.get(block_size)
            while got < length:
                want = min(block_size, length - got)
                n = transfer_block(src, dst, dst_direct, buf, offset + got, want)
                with memoryview(buf) as view, view[:n] as part:
                    hasher.update(part)
                got += n
                if n < want:
                    break  # the file ended early; the caller compares sizes
        finally:
            if dst is not None:
                os.close(dst)
    finally:
        os.close(src)
    used_direct = src_direct and (job.dst is None or dst_direct)
    return _Range(hasher.hexdigest(), got, used_direct, started, time.monotonic())


def _range_task(
    job: HashJob, offset: int, length: int, *, direct: bool, block_size: int, buffers: _Buffers
) -> _Range:
    try:
        return _hash_range(job, offset, length, direct=direct, block_size=block_size, buffers=buffers)
    except OSError as e:
        # Some filesystems accept O_DIRECT at open and refuse it per request: redo this piece buffered.
        if not (direct and e.errno == errno.EINVAL):
            raise
        return _hash_range(job, offset, length, direct=False, block_size=block_size, buffers=buffers)


def _prepare_destination(job: HashJob) -> None:
    if job.dst is None:
        return
    job.dst.parent.mkdir(parents=True, exist_ok=True)
    mode = os.stat(job.src).st_mode & 0o7777
    # Created empty up front: the pieces are written by different threads, each opening it itself.
    os.close(os.open(job.dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))


def _finish(job: HashJob, size: int, fsync: bool) -> None:
    """Cut a copy's O_DIRECT padding off and make the written (or just-sealed) file durable."""
    if job.dst is None and not fsync:
        return
    fd = os.open(job.dst if job.dst is not None else job.src, os.O_WRONLY if job.dst else os.O_RDONLY)
    try:
        if job.dst is not None:
            os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _collect(job: HashJob, pieces: list[_Range]) -> FileDigests:
    got = sum(p.bytes for p in pieces)
    seconds = max(p.ended for p in pieces) - min(p.started for p in pieces) if pieces else 0.0
    digests = tuple(p.digest for p in pieces)
    whole = digests[0] if job.chunk_bytes is None else None
    direct = bool(pieces) and all(p.direct for p in pieces)
    return FileDigests(job, digests, IoStats(bytes=got, seconds=seconds, direct=direct, sha256=whole))


def hash_files(
    jobs: Sequence[HashJob],
    *,
    parallel: int = HASH_PARALLEL,
    block_size: int = HASH_BLOCK_SIZE,
    direct: bool = False,
    fsync: bool = False,
    idle_io: bool = False,
) -> list[FileDigests]:
    """Hash (and copy) every piece of every job on one pool of ``parallel`` threads; one result per job.

    Each piece is read by its own task with ``pread`` into that thread's buffer, so one huge file
    keeps every thread busy.  Buffered reads by default (see ``sha256_file``); ``direct`` is for
    copies that must not evict the page cache.  ``fsync`` makes each destination durable, or each
    source when a job has none (CRIU does not fsync its images).  ``idle_io`` reads at the idle I/O
    priority (see ``ioprio``).  The first I/O error cancels the pieces not yet started and is raised.
    """
    if block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"block_size must be a positive multiple of {ALIGN}")
    for job in jobs:
        if job.chunk_bytes is not None and (job.chunk_bytes <= 0 or job.chunk_bytes % ALIGN):
            raise ValueError(f"{job.src}: chunk_bytes must be a positive multiple of {ALIGN}")
    for job in jobs:
        _prepare_destination(job)
    task = functools.partial(_range_task, direct=direct, block_size=block_size, buffers=_Buffers())
    # Longest pieces first, so the small files fill the gaps at the end instead of trailing.
    pieces = sorted(
        (
            (i, k, offset, length)
            for i, job in enumerate(jobs)
            for k, (offset, length) in enumerate(job.ranges())
        ),
        key=lambda p: -p[3],
    )
    with ThreadPoolExecutor(
        max_workers=max(1, parallel),
        thread_name_prefix="artifact-hash",
        initializer=(lambda: set_thread_ioprio(IDLE)) if idle_io else None,
    ) as pool:
        try:
            futures = {(i, k): pool.submit(task, jobs[i], offset, length) for i, k, offset, length in pieces}
            done = {key: future.result() for key, future in futures.items()}
            results = [
                _collect(job, [done[(i, k)] for k in range(len(job.ranges()))]) for i, job in enumerate(jobs)
            ]
            finishing = [pool.submit(_finish, r.job, r.stats.bytes, fsync) for r in results]
            for future in finishing:
                future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return results


ahash_files = in_thread(hash_files)
