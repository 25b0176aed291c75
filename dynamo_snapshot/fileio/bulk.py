"""Copying and hashing large files: big aligned blocks, several in flight, O_DIRECT where it works.

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
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import ParamSpec, Protocol, TypeVar

from dynamo_snapshot.fileio.blocks import ALIGN, open_maybe_direct, round_up, transfer_block
from dynamo_snapshot.fileio.durable import fsync_dirs

__all__ = [
    "BLOCK_SIZE",
    "INFLIGHT",
    "PARALLEL_FILES",
    "IoStats",
    "TreeStats",
    "acopy_file",
    "acopy_tree",
    "asha256_file",
    "copy_file",
    "copy_tree",
    "in_thread",
    "sha256_file",
]

P = ParamSpec("P")
R = TypeVar("R")

BLOCK_SIZE = 16 << 20
INFLIGHT = 4
PARALLEL_FILES = 4


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
    buf_size = min(block_size, round_up(size))
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
                    pending.append(
                        (pool.submit(transfer_block, src, dst, dst_direct, buf, offset, length), buf)
                    )
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
    fd, used_direct = open_maybe_direct(path, os.O_RDONLY, direct)
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
    src_fd, src_direct = open_maybe_direct(src, os.O_RDONLY, direct)
    try:
        st = os.fstat(src_fd)
        dst_fd, dst_direct = open_maybe_direct(
            dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct, st.st_mode & 0o7777
        )
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
        fsync_dirs({dst, *((dst / rel).parent for rel in rels)})
    return TreeStats(
        bytes=sum(r.bytes for r in results.values()),
        seconds=time.monotonic() - started,
        files=dict(sorted(results.items())),
    )


def in_thread(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """``fn`` as a coroutine function that runs it in a worker thread."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(fn, *args, **kwargs)

    run.__doc__ = f"``{fn.__name__}`` in a worker thread, so the event loop keeps serving."
    return run


asha256_file = in_thread(sha256_file)
acopy_file = in_thread(copy_file)
acopy_tree = in_thread(copy_tree)
