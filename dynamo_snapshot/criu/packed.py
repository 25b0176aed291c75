"""CRIU's memory-page images stored compressed, in chunks that compress and decompress in parallel.

After the zero pages are dropped (criu.sparse) a GPU worker's pages images still hold about a gigabyte:
the H200 reference worker's, stored this way, went from 1.08 to 0.26 GB (1 GiB model) and 1.28 to
0.31 GB (8 GiB model), about 4.2x (BENCHMARKS.md, "Restore of the reference worker on the H200"). Its
disk read 1.5-2.1 GB/s in those runs, so storing the pages compressed saves most of that read and shrinks
the artifact.
CRIU itself reads only plain images (it preads pages at their offsets), so a restore unpacks the file
first, into a staging images directory on a tmpfs, with a copy of every other (small) image there
(``stage_images``).

One packed file (``pages-N.img`` + ``PACKED_SUFFIX``), little-endian::

    prefix   magic "DSZPAGES", u32 version (1), u32 chunk bytes, u64 original size, u64 chunk count
    index    per chunk: u64 offset in this file, u32 stored length, u32 kind (0 raw, 1 raw deflate)
    chunks   back to back, in order, right after the index

Chunk i holds original bytes [i * chunk, min((i + 1) * chunk, size)). Each compressed chunk is an
independent raw-deflate stream (zlib level 1), so threads (zlib releases the GIL) work on chunks at once;
one that would not shrink by ``MIN_GAIN`` is stored raw. Every length is checked on decode: a truncated
or garbled file raises ``PackedFormatError``, it never unpacks short. The format has no checksum of its
own: in an artifact the manifest's SHA-256 seals the packed file, and it is checked before any unpack.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TypeVar

from dynamo_snapshot.fileio import chunk_count, pwrite_all, usable_cpus

__all__ = [
    "CHUNK_BYTES",
    "MIN_PACK_BYTES",
    "PACKED_SUFFIX",
    "PackStats",
    "PackedFormatError",
    "PagesPacked",
    "StageStats",
    "Stopped",
    "is_packed_pages",
    "pack_file",
    "pack_pages",
    "stage_images",
    "staged_bytes",
    "unpack_file",
    "unpacked_size",
]

PACKED_SUFFIX = ".dsz"
MAGIC = b"DSZPAGES"
VERSION = 1
# Original bytes per chunk: big enough that zlib's per-call overhead is nothing, small enough that a
# pages file of a few hundred MiB keeps every thread busy.
CHUNK_BYTES = 4 << 20
# Pages files smaller than this are left plain: nothing to gain that is worth a staging copy.
MIN_PACK_BYTES = 1 << 20
# A chunk, and a whole file, is kept compressed only if that saves at least this fraction.
MIN_GAIN = 0.03
LEVEL = 1
# Packed bytes read per read(2) at unpack.
READ_BYTES = 32 << 20

_PREFIX = struct.Struct("<8sIIQQ")
_INDEX = struct.Struct("<QII")
_RAW, _DEFLATE = 0, 1
_MAX_CHUNK = 1 << 30
_WBITS = -15  # raw deflate: no zlib header or trailer (the manifest seals the bytes)

T = TypeVar("T")


DEFAULT_THREADS = max(1, min(16, usable_cpus()))


class PackedFormatError(ValueError):
    """A packed file is not one this module wrote, or it is truncated or damaged."""


class Stopped(Exception):
    """pack_file/unpack_file were asked to stop; their partial output is removed."""


@dataclass(frozen=True)
class PackStats:
    size: int  # original bytes
    packed: int  # bytes of the packed file
    chunks: int
    raw_chunks: int  # stored uncompressed


@dataclass(frozen=True)
class _Chunk:
    number: int
    offset: int  # in the packed file
    stored: int
    kind: int
    start: int  # in the original
    length: int


@dataclass(frozen=True)
class _Header:
    size: int
    chunks: tuple[_Chunk, ...]


def is_packed_pages(name: str) -> bool:
    """Whether ``name`` (a file name or an artifact path) is a packed CRIU pages image."""
    base = PurePosixPath(name).name
    return base.startswith("pages-") and base.endswith(".img" + PACKED_SUFFIX)


def _pread_exact(fd: int, length: int, offset: int, what: str) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise PackedFormatError(f"{what}: truncated (wanted {length} bytes at offset {offset})")
        data += more
    return data


# ---- pack --------------------------------------------------------------------------------------------


def _deflate(fd: int, start: int, length: int) -> tuple[bytes, int]:
    data = os.pread(fd, length, start)
    if len(data) != length:
        raise OSError(f"source shrank while packing (offset {start})")
    z = zlib.compressobj(LEVEL, zlib.DEFLATED, _WBITS)
    packed = z.compress(data) + z.flush()
    if len(packed) > length * (1 - MIN_GAIN):
        return data, _RAW
    return packed, _DEFLATE


def _run_ordered(
    jobs: Iterable[Callable[[], T]],
    pool: ThreadPoolExecutor,
    window: int,
    stop: threading.Event | None,
    take: Callable[[T], None],
) -> None:
    """Run ``jobs`` on ``pool``, at most ``window`` at a time, handing their results to ``take`` in order.
    ``stop`` set: Stopped before the next job; any failure cancels what has not started."""
    pending: deque[Future[T]] = deque()
    try:
        for job in jobs:
            if stop is not None and stop.is_set():
                raise Stopped
            pending.append(pool.submit(job))
            while len(pending) >= window:
                take(pending.popleft().result())
        while pending:
            if stop is not None and stop.is_set():
                raise Stopped
            take(pending.popleft().result())
    finally:
        for f in pending:
            f.cancel()
        # Nothing of this call keeps running once it returns: its output may be removed right away.
        for f in pending:
            with contextlib.suppress(BaseException):
                f.result()


@contextlib.contextmanager
def _output(dst: Path, flag: int, mode: int) -> Iterator[int]:
    """``dst`` opened for writing (created; ``flag`` O_EXCL or O_TRUNC); removed if the block fails."""
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | flag | os.O_CLOEXEC, mode)
    try:
        yield out
    except BaseException:
        os.close(out)
        dst.unlink(missing_ok=True)
        raise
    os.close(out)


def pack_file(
    src: Path,
    dst: Path,
    *,
    threads: int = DEFAULT_THREADS,
    stop: threading.Event | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> PackStats:
    """Write ``src`` packed to ``dst`` (which must not exist). On any failure, or ``Stopped`` once
    ``stop`` is set (within a few chunks), ``dst`` is removed; ``src`` is never changed."""
    if not 0 < chunk_bytes <= _MAX_CHUNK:
        raise ValueError(f"chunk_bytes {chunk_bytes} out of range")
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        size = st.st_size
        count = chunk_count(size, chunk_bytes)
        with _output(dst, os.O_EXCL, st.st_mode & 0o7777) as out:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            index: list[tuple[int, int, int]] = []
            pos = _PREFIX.size + count * _INDEX.size

            def job(i: int) -> Callable[[], tuple[bytes, int]]:
                start = i * chunk_bytes
                return functools.partial(_deflate, fd, start, min(chunk_bytes, size - start))

            def take(result: tuple[bytes, int]) -> None:
                nonlocal pos
                data, kind = result
                pwrite_all(out, data, pos)
                index.append((pos, len(data), kind))
                pos += len(data)

            threads = max(1, threads)
            with ThreadPoolExecutor(threads, thread_name_prefix="pack") as pool:
                _run_ordered((job(i) for i in range(count)), pool, 2 * threads, stop, take)
            head = bytearray(_PREFIX.pack(MAGIC, VERSION, chunk_bytes, size, count))
            for entry in index:
                head += _INDEX.pack(*entry)
            pwrite_all(out, head, 0)
    finally:
        os.close(fd)
    return PackStats(
        size=size,
        packed=pos,
        chunks=count,
        raw_chunks=sum(1 for _, _, kind in index if kind == _RAW),
    )


@dataclass
class PagesPacked:
    """What pack_pages did to one images directory."""

    files: int = 0  # pages images now packed
    bytes_before: int = 0  # their original size
    bytes_after: int = 0  # their packed size
    kept: int = 0  # big enough, but packing saved too little: left plain
    failed: dict[str, str] = field(default_factory=dict)  # file -> why it was left plain
    seconds: float = 0.0


def pack_pages(
    images: Path,
    *,
    threads: int = DEFAULT_THREADS,
    stop: threading.Event | None = None,
) -> PagesPacked:
    """Replace every ``pages-*.img`` of ``images`` of ``MIN_PACK_BYTES`` or more by its packed form
    (``pages-N.img`` + ``PACKED_SUFFIX``), unless packing saves less than ``MIN_GAIN``.

    Each file is switched over on its own (packed next to it, renamed, then the plain one removed): a
    failure or a stop leaves every pages image either plain or packed, never both or neither. A file
    that cannot be packed (``OSError``) stays plain and is named in ``failed``; ``stop`` set: ``Stopped``
    within a few chunks."""
    started = time.monotonic()
    done = PagesPacked()
    for plain in sorted(images.glob("pages-*.img")):
        packed = plain.with_name(plain.name + PACKED_SUFFIX)
        tmp = plain.with_name(f".{packed.name}.tmp")
        try:
            if plain.is_symlink() or not plain.is_file() or plain.stat().st_size < MIN_PACK_BYTES:
                continue
            tmp.unlink(missing_ok=True)
            stats = pack_file(plain, tmp, threads=threads, stop=stop)
        except OSError as e:
            done.failed[plain.name] = str(e)
            continue
        if stats.packed > stats.size * (1 - MIN_GAIN):
            tmp.unlink()
            done.kept += 1
            continue
        os.replace(tmp, packed)
        plain.unlink()
        done.files += 1
        done.bytes_before += stats.size
        done.bytes_after += stats.packed
    done.seconds = time.monotonic() - started
    return done


# ---- unpack ------------------------------------------------------------------------------------------


def _read_header(fd: int, what: str) -> _Header:
    file_size = os.fstat(fd).st_size
    if file_size < _PREFIX.size:
        raise PackedFormatError(f"{what}: truncated ({file_size} bytes, no complete header)")
    magic, version, chunk_bytes, size, count = _PREFIX.unpack(_pread_exact(fd, _PREFIX.size, 0, what))
    if magic != MAGIC:
        raise PackedFormatError(f"{what}: not a packed pages file (magic {magic!r})")
    if version != VERSION:
        raise PackedFormatError(f"{what}: packed format version {version}, this agent reads {VERSION}")
    if not 0 < chunk_bytes <= _MAX_CHUNK or count != chunk_count(size, chunk_bytes):
        raise PackedFormatError(f"{what}: {count} chunks of {chunk_bytes} bytes cannot hold {size} bytes")
    pos = _PREFIX.size + count * _INDEX.size
    if pos > file_size:
        raise PackedFormatError(f"{what}: truncated (index of {count} chunks, file of {file_size} bytes)")
    raw_index = _pread_exact(fd, count * _INDEX.size, _PREFIX.size, what)
    chunks = []
    for i in range(count):
        offset, stored, kind = _INDEX.unpack_from(raw_index, i * _INDEX.size)
        start = i * chunk_bytes
        length = min(chunk_bytes, size - start)
        if offset != pos:
            raise PackedFormatError(f"{what}: chunk {i} at offset {offset}, expected {pos}")
        if kind == _RAW and stored != length:
            raise PackedFormatError(f"{what}: raw chunk {i} of {stored} bytes, expected {length}")
        if kind == _DEFLATE and not 0 < stored <= length:
            raise PackedFormatError(f"{what}: compressed chunk {i} of {stored} bytes for {length}")
        if kind not in (_RAW, _DEFLATE):
            raise PackedFormatError(f"{what}: chunk {i} of unknown kind {kind}")
        chunks.append(_Chunk(i, offset, stored, kind, start, length))
        pos += stored
    if pos != file_size:
        state = "truncated" if pos > file_size else "trailing bytes"
        raise PackedFormatError(f"{what}: {state} (chunks end at {pos}, file has {file_size} bytes)")
    return _Header(size, tuple(chunks))


def unpacked_size(path: Path) -> int:
    """The original size of the packed file ``path`` (its header checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_header(fd, path.name).size
    finally:
        os.close(fd)


def _inflate_to(out: int, data: memoryview, chunk: _Chunk, what: str) -> None:
    if chunk.kind == _RAW:
        pwrite_all(out, data, chunk.start)
        return
    try:
        # One shot into a buffer of exactly the chunk's size, written as it is: simpler than a
        # decompressobj, not faster (the H200 unpacked 1.7-2.2 vs 1.8 GB/s either way,
        # benchmarks/results/unpack-threads-h200.json). Bytes after the stream's end cannot change what
        # it decodes to; the length check catches everything else.
        plain = zlib.decompress(data, _WBITS, chunk.length)
    except zlib.error as e:
        raise PackedFormatError(f"{what}: chunk {chunk.number} is damaged ({e})") from None
    if len(plain) != chunk.length:
        raise PackedFormatError(
            f"{what}: chunk {chunk.number} decodes to {len(plain)} bytes, expected {chunk.length}"
        )
    pwrite_all(out, plain, chunk.start)


def _spans(chunks: tuple[_Chunk, ...], read_bytes: int) -> Iterable[tuple[int, int, list[_Chunk]]]:
    """Consecutive chunks grouped into reads of about ``read_bytes``: (offset, length, chunks)."""
    group: list[_Chunk] = []
    for c in chunks:
        if group and c.offset + c.stored - group[0].offset > read_bytes:
            yield group[0].offset, group[-1].offset + group[-1].stored - group[0].offset, group
            group = []
        group.append(c)
    if group:
        yield group[0].offset, group[-1].offset + group[-1].stored - group[0].offset, group


def unpack_file(
    src: Path,
    dst: Path,
    *,
    threads: int = DEFAULT_THREADS,
    stop: threading.Event | None = None,
) -> int:
    """Write the original of the packed file ``src`` to ``dst`` (created, or truncated); its size.

    ``src`` is read in large sequential reads; its chunks are inflated on ``threads`` threads, each
    written at its offset into ``dst`` (sized up front). ``PackedFormatError`` when ``src`` is not
    whole; then, on any other failure and on ``Stopped`` (``stop`` set) ``dst`` is removed."""
    what = src.name
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = _read_header(fd, what)
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with _output(dst, os.O_TRUNC, 0o600) as out:
            os.ftruncate(out, header.size)

            def jobs() -> Iterable[Callable[[], None]]:
                for offset, length, group in _spans(header.chunks, READ_BYTES):
                    view = memoryview(_pread_exact(fd, length, offset, what))
                    for c in group:
                        part = view[c.offset - offset : c.offset - offset + c.stored]
                        yield functools.partial(_inflate_to, out, part, c, what)

            threads = max(1, threads)
            with ThreadPoolExecutor(threads, thread_name_prefix="unpack") as pool:
                _run_ordered(jobs(), pool, 4 * threads, stop, lambda _: None)
    finally:
        os.close(fd)
    return header.size


# ---- a staging images directory for CRIU -------------------------------------------------------------


@dataclass(frozen=True)
class StageStats:
    files: int  # packed files unpacked
    packed_bytes: int  # their size
    bytes: int  # what they unpacked to
    copied: int  # other files
    seconds: float


def _staged_rel(rel: str) -> str:
    """Where a file of the artifact's images goes in the staging dir: a packed one under its plain name."""
    return rel.removesuffix(PACKED_SUFFIX) if is_packed_pages(rel) else rel


def staged_bytes(images: Path, files: Iterable[str]) -> int:
    """What ``stage_images`` writes for ``files`` (paths relative to ``images``): what the packed ones
    unpack to and the size of the others."""
    total = 0
    for rel in files:
        total += unpacked_size(images / rel) if is_packed_pages(rel) else (images / rel).stat().st_size
    return total


def stage_images(
    images: Path,
    files: Iterable[str],
    dest: Path,
    *,
    threads: int = DEFAULT_THREADS,
    stop: threading.Event | None = None,
) -> StageStats:
    """Fill ``dest`` (an existing, empty directory) with what CRIU reads as the images dir ``images``: for
    each of ``files`` (relative to ``images``), the packed pages unpacked under their plain name, and
    every other file copied (CRIU's metadata images: small). ``files`` are the ones to expose (the
    artifact's sealed ones): nothing else of ``images`` is in ``dest``.

    Copies, not links: runc's CRIU opens the images from inside the container's mount namespace, where
    a symbolic link into the artifact store leads nowhere; a hard link (only possible on the store's
    filesystem) would change the artifact files' ctime, which makes the next restore hash them again."""
    started = time.monotonic()
    rels = sorted(set(files))
    names = {_staged_rel(r) for r in rels}
    if len(names) != len(rels):
        raise PackedFormatError("both a plain and a packed form of one pages image")
    for rel in rels:
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            raise ValueError(f"not a relative path inside the images dir: {rel}")
    unpacked = packed = copied = count = 0
    # The small files first; then the pages, which take the time.
    for rel in sorted(rels, key=is_packed_pages):
        source = images / rel
        target = dest / _staged_rel(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        if stop is not None and stop.is_set():
            raise Stopped
        if is_packed_pages(rel):
            packed += source.stat().st_size
            unpacked += unpack_file(source, target, threads=threads, stop=stop)
            count += 1
            continue
        shutil.copyfile(source, target)
        copied += 1
    return StageStats(count, packed, unpacked, copied, time.monotonic() - started)
