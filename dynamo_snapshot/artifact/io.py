"""Large-file I/O for artifacts: big aligned blocks, several in flight, O_DIRECT where it works.

Checkpoint artifacts are a few small CRIU images and a few files of tens of GiB (memory pages, GPU
memory).  Moving those at disk or network speed needs many large requests in flight, and O_DIRECT keeps
a bulk copy from evicting the page cache the running workers use.  The threads spend their time in
syscalls and in hashlib, both of which release the GIL, so they really run in parallel.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import NamedTuple, ParamSpec, Protocol, TypeVar

from dynamo_snapshot.artifact.ioprio import IDLE, set_thread_ioprio

__all__ = [
    "ALIGN",
    "BLOCK_SIZE",
    "DEFAULT_CHUNK_BYTES",
    "HASH_BLOCK_SIZE",
    "HASH_PARALLEL",
    "INFLIGHT",
    "PARALLEL_FILES",
    "FileDigests",
    "HashJob",
    "IoStats",
    "TreeStats",
    "acopy_file",
    "acopy_tree",
    "ahash_files",
    "asha256_file",
    "chunk_count",
    "copy_file",
    "copy_tree",
    "hash_files",
    "sha256_file",
]

P = ParamSpec("P")
R = TypeVar("R")

BLOCK_SIZE = 16 << 20
INFLIGHT = 4
PARALLEL_FILES = 4
# O_DIRECT needs buffer, offset and length aligned to the logical block size; a page covers every
# device we expect (512 B and 4 KiB sectors).
ALIGN = 4096
# Files larger than this are sealed as SHA-256s of pieces this size, so that one huge file (CRIU's
# pages-1.img, a weights file) is hashed by many threads instead of one.  64 MiB keeps the digest
# list short (160 per 10 GiB) while giving 16 cores plenty of independent work.
DEFAULT_CHUNK_BYTES = 64 << 20
# The read size inside one chunk: big enough that hashlib drops the GIL for long stretches and the
# page cache's readahead keeps up, small enough that a buffer per thread stays cheap.
HASH_BLOCK_SIZE = 4 << 20


def usable_cpus() -> int:
    """The cores this process may run on: the affinity mask, not the host's core count (a container
    may be pinned to a few cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """All of ``data`` written at ``offset`` (pwrite may write less than asked)."""
    with memoryview(data) as whole:
        done = 0
        while done < len(whole):
            with whole[done:] as part:
                n = os.pwrite(fd, part, offset + done)
            if n <= 0:
                raise OSError(f"pwrite wrote nothing at offset {offset + done}")
            done += n


# Twice the cores: half the threads wait in pread while the others hash.
HASH_PARALLEL = min(32, 2 * usable_cpus())


@dataclass(frozen=True)
class IoStats:
    """What one file operation moved; ``direct`` says whether O_DIRECT was really used."""

    bytes: int
    seconds: float
    direct: bool
    sha256: str | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TreeStats:
    """A whole-tree copy: totals over wall-clock time, and each file's stats by relative path."""

    bytes: int
    seconds: float
    files: dict[str, IoStats] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _open(path: Path, flags: int, direct: bool, mode: int = 0o600) -> tuple[int, bool]:
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            # EINVAL is how a filesystem without O_DIRECT support answers; anything else is real.
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def _transfer(src: int, dst: int | None, dst_direct: bool, buf: mmap.mmap, offset: int, length: int) -> int:
    """Read ``length`` bytes at ``offset`` into ``buf`` (and write them to ``dst``); bytes read."""
    # Every view is released explicitly: a live slice (say, held by a traceback) would stop the
    # buffer from being closed and mask the real error.
    with memoryview(buf) as view:
        # Ask for the aligned length: O_DIRECT refuses a ragged tail, and the read stops at EOF anyway.
        want = min(_round_up(length), len(view))
        got = 0
        while got < length:
            with view[got:want] as part:
                n = os.preadv(src, [part], offset + got)
            if n == 0:
                break
            got += n
        got = min(got, length)
        if dst is not None and got:
            # An O_DIRECT write must be aligned too; the caller truncates the padding off at the end.
            end = min(_round_up(got), len(view)) if dst_direct else got
            with view[:end] as part:
                pwrite_all(dst, part, offset)
        return got


class _Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...


def _stream(
    src: int,
    size: int,
    *,
    dst: int | None,
    dst_direct: bool,
    hasher: _Hasher | None,
    block_size: int,
    inflight: int,
) -> int:
    """Move ``size`` bytes through up to ``inflight`` parallel block transfers; bytes actually read.

    Blocks complete in any order but are hashed in file order, each while later blocks are in flight.
    """
    if block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"block_size must be a positive multiple of {ALIGN}")
    blocks = -(-size // block_size)
    if blocks == 0:
        return 0
    buf_size = min(block_size, _round_up(size))
    buffers = [mmap.mmap(-1, buf_size) for _ in range(max(1, min(inflight, blocks)))]
    free = list(buffers)
    pending: deque[tuple[Future[int], mmap.mmap]] = deque()
    total = 0

    def finish() -> None:
        nonlocal total
        future, buf = pending.popleft()
        n = future.result()
        if hasher is not None and n:
            with memoryview(buf) as view, view[:n] as part:
                hasher.update(part)
        total += n
        free.append(buf)

    try:
        with ThreadPoolExecutor(max_workers=len(buffers), thread_name_prefix="artifact-io") as pool:
            try:
                for i in range(blocks):
                    if not free:
                        finish()
                    buf = free.pop()
                    offset = i * block_size
                    length = min(block_size, size - offset)
                    pending.append((pool.submit(_transfer, src, dst, dst_direct, buf, offset, length), buf))
                while pending:
                    finish()
            finally:
                for future, _ in pending:
                    future.cancel()
    finally:
        for buf in buffers:
            # Never let cleanup mask the error that got us here; the GC unmaps what is left.
            with contextlib.suppress(BufferError):
                buf.close()
    return total


def sha256_file(
    path: Path, *, direct: bool = False, block_size: int = BLOCK_SIZE, inflight: int = INFLIGHT
) -> IoStats:
    """SHA-256 of a file read in big blocks with reads in flight while hashing.

    Buffered by default: files to hash were usually just written (CRIU dump) or are about to be read
    again (restore), so the page cache is an asset here, not pollution.
    """
    started = time.monotonic()
    fd, used_direct = _open(path, os.O_RDONLY, direct)
    try:
        hasher = hashlib.sha256()
        size = os.fstat(fd).st_size
        try:
            n = _stream(
                fd, size, dst=None, dst_direct=False, hasher=hasher, block_size=block_size, inflight=inflight
            )
        except OSError as e:
            if not (used_direct and e.errno == errno.EINVAL):
                raise
            return sha256_file(path, direct=False, block_size=block_size, inflight=inflight)
    finally:
        os.close(fd)
    return IoStats(bytes=n, seconds=time.monotonic() - started, direct=used_direct, sha256=hasher.hexdigest())


def copy_file(
    src: Path,
    dst: Path,
    *,
    direct: bool = True,
    sha256: bool = False,
    fsync: bool = True,
    block_size: int = BLOCK_SIZE,
    inflight: int = INFLIGHT,
) -> IoStats:
    """Copy ``src`` to ``dst`` (replaced if present) with parallel aligned block transfers.

    ``sha256`` hashes the bytes as they were read, so a fetch can check the copy without a second
    pass; ``fsync`` makes the copy durable before it returns.
    """
    started = time.monotonic()
    src_fd, src_direct = _open(src, os.O_RDONLY, direct)
    try:
        st = os.fstat(src_fd)
        dst_fd, dst_direct = _open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct, st.st_mode & 0o7777)
        try:
            hasher = hashlib.sha256() if sha256 else None
            try:
                n = _stream(
                    src_fd,
                    st.st_size,
                    dst=dst_fd,
                    dst_direct=dst_direct,
                    hasher=hasher,
                    block_size=block_size,
                    inflight=inflight,
                )
            except OSError as e:
                # Some filesystems accept O_DIRECT at open and refuse it per request: go buffered.
                if not ((src_direct or dst_direct) and e.errno == errno.EINVAL):
                    raise
                os.close(dst_fd)
                dst_fd = -1
                return copy_file(
                    src,
                    dst,
                    direct=False,
                    sha256=sha256,
                    fsync=fsync,
                    block_size=block_size,
                    inflight=inflight,
                )
            os.ftruncate(dst_fd, n)
            if fsync:
                os.fsync(dst_fd)
        finally:
            if dst_fd >= 0:
                os.close(dst_fd)
    finally:
        os.close(src_fd)
    return IoStats(
        bytes=n,
        seconds=time.monotonic() - started,
        direct=src_direct and dst_direct,
        sha256=hasher.hexdigest() if hasher is not None else None,
    )


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many ``chunk_bytes`` pieces a file of ``size`` bytes has (the last may be shorter)."""
    return -(-size // chunk_bytes)


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
        step = self.chunk_bytes
        return [(offset, min(step, self.size - offset)) for offset in range(0, self.size, step)]


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
    src, src_direct = _open(job.src, os.O_RDONLY, direct)
    try:
        dst, dst_direct = _open(job.dst, os.O_WRONLY, direct) if job.dst is not None else (None, False)
        try:
            buf = buffers.get(block_size)
            while got < length:
                want = min(block_size, length - got)
                n = _transfer(src, dst, dst_direct, buf, offset + got, want)
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


def _tree_files(src: Path) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(src):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise ValueError(f"{path}: not a regular file or directory")
        files += [(Path(dirpath) / name).relative_to(src).as_posix() for name in filenames]
    return files


def _checked_relative(rel: str) -> PurePosixPath:
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"{rel!r} is not a relative path inside the tree")
    return path


def copy_tree(
    src: Path,
    dst: Path,
    *,
    files: Iterable[str] | None = None,
    direct: bool = True,
    sha256: bool = False,
    fsync: bool = True,
    parallel_files: int = PARALLEL_FILES,
    block_size: int = BLOCK_SIZE,
    inflight: int = INFLIGHT,
) -> TreeStats:
    """Copy the regular files under ``src`` (or just ``files``, relative paths) into ``dst``.

    Several files move at once, largest first, so a tree of one huge page file and many small images
    finishes when the huge file does.  Symlinks and special files are refused, not followed.
    """
    started = time.monotonic()
    rels = [_checked_relative(r).as_posix() for r in files] if files is not None else _tree_files(src)
    root = src.resolve()
    for rel in rels:
        path = src / rel
        # resolve() catches a symlinked directory on the way, not just a symlinked file.
        if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(root):
            raise ValueError(f"{path}: not a regular file inside {src}")
    sizes = {rel: (src / rel).stat().st_size for rel in rels}
    dst.mkdir(parents=True, exist_ok=True)
    for parent in {(dst / rel).parent for rel in rels}:
        parent.mkdir(parents=True, exist_ok=True)
    copy = functools.partial(
        copy_file, direct=direct, sha256=sha256, fsync=fsync, block_size=block_size, inflight=inflight
    )
    with ThreadPoolExecutor(max_workers=max(1, parallel_files), thread_name_prefix="artifact-copy") as pool:
        futures = {
            rel: pool.submit(copy, src / rel, dst / rel) for rel in sorted(rels, key=lambda r: -sizes[r])
        }
        results = {rel: future.result() for rel, future in futures.items()}
    if fsync:
        _fsync_dirs({dst, *((dst / rel).parent for rel in rels)})
    return TreeStats(
        bytes=sum(r.bytes for r in results.values()),
        seconds=time.monotonic() - started,
        files=dict(sorted(results.items())),
    )


def _fsync_dirs(dirs: Iterable[Path]) -> None:
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _in_thread(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(fn, *args, **kwargs)

    run.__doc__ = f"``{fn.__name__}`` in a worker thread, so the event loop keeps serving."
    return run


asha256_file = _in_thread(sha256_file)
ahash_files = _in_thread(hash_files)
acopy_file = _in_thread(copy_file)
acopy_tree = _in_thread(copy_tree)
