"""Drop all-zero pages of anonymous memory from a CRIU dump, so they are neither stored nor restored.

CRIU dumps every page a process has touched, zeros included; a restore reads each back from the image
and copies it into freshly mapped memory. For private anonymous memory that copy is pointless: CRIU
maps such a region anew at restore, and a page it does not fill reads as zero anyway. A GPU worker has
a lot of it: on the H200 the reference worker's image was 1.9 GB of which 54% were zero pages (most of
the CUDA checkpoint's host copy of GPU state). Dropping them shrinks the artifact and the restore by that
much, on the disk and in CRIU's page copying, which runs at ~1.6-1.9 GB/s.

A page is dropped only where a missing page really means zero on restore:
- in a private anonymous VMA (CRIU's status VMA_ANON_PRIVATE; not file-backed, where a missing page
  would show the file's bytes, and not shared memory, which CRIU keeps elsewhere). That holds in a
  forked child too: where CRIU restores a child's VMA as a copy-on-write child of its parent's, it
  discards every page the child's own images do not hold (criu/mem.c, "Remove pages, which were not
  shared with a child");
- in pagemaps whose entries all are present pages (no pages of an incremental dump's parent);
  anything else is left exactly as CRIU wrote it.

Image formats (criu/image.c, images/*.proto): pagemap-PID.img and mm-PID.img start with two u32 magics
and hold protobuf messages each preceded by its u32 length; pages-ID.img is raw pages in pagemap order.
"""

from __future__ import annotations

import bisect
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PAGE", "Damaged", "ImageFormatError", "SparseStats", "Stopped", "drop_zero_pages", "read_pagemap"]

# CRIU's images are in the kernel's pages (64 KiB on some arm64 kernels).
PAGE = mmap.PAGESIZE
_ZERO = bytes(PAGE)
_IMG_COMMON_MAGIC = 0x54564319
_PAGEMAP_MAGIC = 0x56084025
_MM_MAGIC = 0x57492820
_PSTREE_MAGIC = 0x50273030
# criu/include/image.h, criu/include/pagemap.h
_VMA_ANON_PRIVATE = 1 << 9
_VMA_NOT_PLAIN_ANON = (1 << 6) | (1 << 7) | (1 << 8) | (1 << 10) | (1 << 14) | (1 << 27) | (1 << 31)
_PE_LAZY = 1 << 1
_PE_PRESENT = 1 << 2
# madvise(2)'s advice, as a VMA's bits in its madv field (images/vma.proto, field 9), which CRIU's
# restorer applies once the memory is back.
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_HUGE_PAGE = 2 << 20
# Pages read and written per step.
_BATCH_PAGES = 256
_ZERO_BATCH = bytes(_BATCH_PAGES * PAGE)


class ImageFormatError(ValueError):
    """A CRIU image is not what this module understands; the dump is left as it was."""


class Stopped(Exception):
    """drop_zero_pages was asked to stop. Asked before a process's pages moved, the dump is whole;
    after, it is ``Damaged`` and only good for the bin, which is where a cancelled checkpoint puts it."""


class Damaged(Exception):
    """A process's pages were moving when the rewrite failed: its pages image no longer matches its
    pagemap, so the dump must not be published."""


@dataclass
class SparseStats:
    """What drop_zero_pages did: per process, and in all."""

    pages_before: int = 0
    seconds: float = 0.0
    processes: dict[int, int] = field(default_factory=dict)  # pid -> pages dropped
    skipped: dict[int, str] = field(default_factory=dict)  # pid -> why its images were left alone
    huge_page_advice: int = 0  # VMAs the rewrite emptied and marked for huge pages (drop_zero_pages)
    unadvised: dict[int, str] = field(default_factory=dict)  # pid -> why that mark was not written

    @property
    def pages_dropped(self) -> int:
        return sum(self.processes.values())

    @property
    def bytes_dropped(self) -> int:
        return self.pages_dropped * PAGE


# ---- protobuf, the little of it these messages use --------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ImageFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ImageFormatError("varint too long")


def _fields(msg: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of every field: ints for varints and fixed, bytes for
    length-delimited fields."""
    pos = 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(msg, pos)
        elif wire == 1:
            value, pos = int.from_bytes(msg[pos : pos + 8], "little"), pos + 8
        elif wire == 5:
            value, pos = int.from_bytes(msg[pos : pos + 4], "little"), pos + 4
        elif wire == 2:
            length, pos = _varint(msg, pos)
            value, pos = msg[pos : pos + length], pos + length
        else:
            raise ImageFormatError(f"unsupported protobuf wire type {wire}")
        if pos > len(msg):
            raise ImageFormatError("truncated protobuf field")
        yield number, wire, value


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_field(out: bytearray, number: int, wire: int, value: int | bytes) -> None:
    """One field as ``_fields`` read it, encoded again."""
    _put_varint(out, number << 3 | wire)
    if isinstance(value, bytes):
        _put_varint(out, len(value))
        out += value
    elif wire == 0:
        _put_varint(out, value)
    else:
        out += value.to_bytes(8 if wire == 1 else 4, "little")


def _ints(msg: bytes) -> dict[int, int]:
    return {n: v for n, w, v in _fields(msg) if isinstance(v, int)}


# ---- image files -------------------------------------------------------------------------------------


def _read_entries(path: Path, magic: int) -> list[bytes]:
    data = path.read_bytes()
    if len(data) < 8 or struct.unpack_from("<II", data) != (_IMG_COMMON_MAGIC, magic):
        raise ImageFormatError(f"{path.name}: not the image it should be (magic)")
    entries, pos = [], 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageFormatError(f"{path.name}: truncated entry size")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise ImageFormatError(f"{path.name}: truncated entry")
        entries.append(data[pos : pos + size])
        pos += size
    return entries


def _write_entries(path: Path, magic: int, entries: list[bytes]) -> None:
    out = bytearray(struct.pack("<II", _IMG_COMMON_MAGIC, magic))
    for e in entries:
        out += struct.pack("<I", len(e)) + e
    path.write_bytes(out)


@dataclass(frozen=True)
class _Vma:
    start: int
    end: int
    status: int
    madv: int = 0

    @property
    def plain_anon(self) -> bool:
        return bool(self.status & _VMA_ANON_PRIVATE) and not self.status & _VMA_NOT_PLAIN_ANON


def _vmas(images: Path, pid: int) -> list[_Vma]:
    (mm,) = _read_entries(images / f"mm-{pid}.img", _MM_MAGIC)
    out = []
    for number, _, value in _fields(mm):
        if number == 14 and isinstance(value, bytes):  # mm_entry.vmas
            v = _ints(value)
            out.append(_Vma(v.get(1, 0), v.get(2, 0), v.get(7, 0), v.get(9, 0)))
    return sorted(out, key=lambda v: v.start)


def _tree(images: Path) -> dict[int, int]:
    """pid -> ppid of every process of the dump."""
    tree = {}
    for entry in _read_entries(images / "pstree.img", _PSTREE_MAGIC):
        v = _ints(entry)
        tree[v[1]] = v.get(2, 0)
    return tree


# ---- the rewrite -------------------------------------------------------------------------------------


def _filled(vma: _Vma, runs: list[tuple[int, int]], starts: list[int]) -> int:
    """Bytes of ``vma`` the sorted, disjoint ``runs`` (their ``starts``) cover."""
    filled = 0
    for i in range(max(bisect.bisect_right(starts, vma.start) - 1, 0), len(runs)):
        lo, hi = runs[i]
        if lo >= vma.end:
            break
        filled += max(0, min(hi, vma.end) - max(lo, vma.start))
    return filled


def _emptied(vmas: list[_Vma], before: list[tuple[int, int]], after: list[tuple[int, int]]) -> set[int]:
    """The starts of the private anonymous VMAs of 2 MiB or more that the dump filled to half or more and
    the rewrite left under half: where a restore that advises huge pages for densely filled memory (the
    project's CRIU) no longer does, and the pages dropped are faulted back one 4 KiB page at a time by
    whatever reads them first (a CUDA restore reads all of its host copy)."""
    before, after = sorted(before), sorted(after)
    before_starts, after_starts = [lo for lo, _ in before], [lo for lo, _ in after]
    huge = (1 << _MADV_HUGEPAGE) | (1 << _MADV_NOHUGEPAGE)
    return {
        v.start
        for v in vmas
        if v.plain_anon
        and v.end - v.start >= _HUGE_PAGE
        and not v.madv & huge
        and 2 * _filled(v, before, before_starts) >= v.end - v.start
        and 2 * _filled(v, after, after_starts) < v.end - v.start
    }


def _advise_huge_pages(images: Path, pid: int, starts: set[int]) -> None:
    """Mark the VMAs at ``starts`` in ``pid``'s mm image for huge pages (MADV_HUGEPAGE in their madv
    bits); every other byte of the image is encoded as it was. Written aside and renamed."""
    path = images / f"mm-{pid}.img"
    (mm,) = _read_entries(path, _MM_MAGIC)
    out = bytearray()
    for number, wire, value in _fields(mm):
        if number == 14 and isinstance(value, bytes) and _ints(value).get(1) in starts:
            vma, marked = bytearray(), False
            for n, w, v in _fields(value):
                if n == 9 and isinstance(v, int):
                    v, marked = v | 1 << _MADV_HUGEPAGE, True
                _put_field(vma, n, w, v)
            if not marked:
                _put_field(vma, 9, 0, 1 << _MADV_HUGEPAGE)
            value = bytes(vma)
        _put_field(out, number, wire, value)
    tmp = path.with_name(path.name + ".sparse")
    try:
        _write_entries(tmp, _MM_MAGIC, [bytes(out)])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _droppable(vmas: list[_Vma]) -> list[tuple[int, int]]:
    return [(v.start, v.end) for v in vmas if v.plain_anon]


def _inside(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether [lo, hi) lies within one of ``ranges``. Few hundred VMAs at most: a scan per pagemap
    entry, not per page."""
    return any(r_lo <= lo and hi <= r_hi for r_lo, r_hi in ranges)


def _entry(vaddr: int, nr_pages: int, flags: int) -> bytes:
    out = bytearray()
    out.append(1 << 3)
    _put_varint(out, vaddr)
    out.append(2 << 3)
    _put_varint(out, nr_pages)
    out.append(4 << 3)
    _put_varint(out, flags)
    return bytes(out)


def _head(pages_id: int) -> bytes:
    out = bytearray([1 << 3])
    _put_varint(out, pages_id)
    return bytes(out)


def read_pagemap(pagemap: Path) -> tuple[int, list[tuple[int, int, int]]]:
    """(pages id, [(vaddr, pages, flags)]) of a pagemap image whose entries are all present pages."""
    head, *raw_entries = _read_entries(pagemap, _PAGEMAP_MAGIC)
    pages_id = _ints(head).get(1)
    if pages_id is None:
        raise ImageFormatError(f"{pagemap.name}: no pages id")
    entries = []
    for raw in raw_entries:
        v = _ints(raw)
        # PE_LAZY only says the pages could be served lazily; a plain restore reads them as any other.
        flags = v.get(4, 0)
        if v.get(3) or not flags & _PE_PRESENT or flags & ~(_PE_PRESENT | _PE_LAZY):
            raise ImageFormatError(f"{pagemap.name}: entries other than present pages ({flags:#x})")
        entries.append((v[1], v[2], flags))
    return pages_id, entries


def _read_fully(fd: int, into: memoryview, offset: int) -> int:
    """Bytes read into ``into`` from ``offset``: all of it unless the file ends first."""
    got = 0
    while got < len(into) and (n := os.preadv(fd, [into[got:]], offset + got)):
        got += n
    return got


class _Compactor:
    """Moves the pages that stay towards the start of the pages image they are in.

    In place, because the pages CRIU just wrote are dirty in the page cache: writing them again where
    they already are costs a copy, while a new file of the same pages is new dirty memory the kernel
    throttles writers for (BENCHMARKS.md: a rewrite into a new file took 1.1-1.6 s on the H200 where
    this one takes 0.84-1.17 s, and 3x as long on the 2-core machine). A kept page never moves past the
    place it was read from, so nothing is overwritten before it is read.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.read_at = 0  # offset of the next batch to read
        self.write_at = 0  # offset the next kept page goes to

    def read(self, into: memoryview) -> int:
        """Fill ``into`` with the next pages of the image; returns the offset they were read from."""
        at = self.read_at
        if _read_fully(self.fd, into, at) != len(into):
            raise ImageFormatError("pages image shorter than its pagemap")
        self.read_at += len(into)
        return at

    def keep(self, view: memoryview, at: int, in_place: int | None = None) -> None:
        """Keep ``view`` at the write position: its first ``in_place`` bytes (all of them by default)
        as read from ``at``, the rest gathered from pages after them."""
        in_place = len(view) if in_place is None else in_place
        skip = in_place if self.write_at == at else 0
        done = skip
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.write_at + done)
        self.write_at += len(view)


def _compact(
    fd: int,
    entries: list[tuple[int, int, int]],
    droppable: list[tuple[int, int]],
    stop: threading.Event | None,
) -> tuple[list[bytes], int, int]:
    """Compact the pages of ``entries`` in the pages image ``fd``: (the new pagemap entries, pages before,
    pages dropped). The image then holds the kept pages and, past them, what is left to truncate."""
    new_entries: list[bytes] = []
    before = dropped = 0
    out = _Compactor(fd)
    # One buffer read into again and again, compared and written without a copy: fresh 1 MiB blocks
    # would each be new memory the kernel must fault in, and slices of them copies.
    buf = bytearray(_BATCH_PAGES * PAGE)
    view = memoryview(buf)
    for vaddr, nr, flags in entries:
        before += nr
        run_start, run_len = vaddr, 0
        for first in range(0, nr, _BATCH_PAGES):
            if stop is not None and stop.is_set():
                raise Stopped
            count = min(_BATCH_PAGES, nr - first)
            size = count * PAGE
            at = out.read(view[:size])
            base = vaddr + first * PAGE
            # A page may go only if it lies in a droppable VMA; an entry may span VMAs.
            whole = _inside(droppable, base, base + size)
            # Fast paths, at memcmp speed: a batch all zeros (a KV cache, GPU state), or one holding no
            # zero page at all, need no look at each page.
            if whole and buf.startswith(_ZERO_BATCH[:size]):
                dropped += count
                if run_len:
                    new_entries.append(_entry(run_start, run_len, flags))
                run_start, run_len = base + size, 0
                continue
            if buf.find(_ZERO, 0, size) < 0:
                out.keep(view[:size], at)
                run_len += count
                continue
            # The batch's kept pages are gathered at the start of the buffer and written with one call:
            # a write per run of kept pages was most of the rewrite's system calls.
            gathered = run_from = 0  # pages gathered so far; first page of the run being scanned
            in_place: int | None = None  # pages before the batch's first dropped one
            for i in range(count):
                addr = base + i * PAGE
                zero = buf.startswith(_ZERO, i * PAGE)
                if not (zero and (whole or _inside(droppable, addr, addr + PAGE))):
                    run_len += 1
                    continue
                if in_place is None:
                    in_place = i
                if gathered != run_from:
                    view[gathered * PAGE : (gathered + i - run_from) * PAGE] = view[
                        run_from * PAGE : i * PAGE
                    ]
                gathered += i - run_from
                run_from = i + 1
                dropped += 1
                if run_len:
                    new_entries.append(_entry(run_start, run_len, flags))
                run_start, run_len = addr + PAGE, 0
            if gathered != run_from:
                view[gathered * PAGE : (gathered + count - run_from) * PAGE] = view[run_from * PAGE : size]
            gathered += count - run_from
            out.keep(view[: gathered * PAGE], at, None if in_place is None else in_place * PAGE)
        if run_len:
            new_entries.append(_entry(run_start, run_len, flags))
    return new_entries, before, dropped


def _runs(entries: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(vaddr, vaddr + nr * PAGE) for vaddr, nr, _ in entries]


def _sparsify_process(
    images: Path,
    pid: int,
    droppable: list[tuple[int, int]],
    stop: threading.Event | None = None,
) -> tuple[int, int, list[tuple[int, int]], list[tuple[int, int]]]:
    """Rewrite one process's pagemap and pages images; (pages before, pages dropped, the memory the dump
    filled, the memory the images fill now).

    Everything that can refuse the images (their format, their sizes) is read before the first byte
    moves. Once pages move, the pages image matches the old pagemap no more: a failure from then on
    raises ``Damaged`` (or ``Stopped``), and the dump must be thrown away."""
    pagemap = images / f"pagemap-{pid}.img"
    pages_id, entries = read_pagemap(pagemap)
    pages = images / f"pages-{pages_id}.img"
    if pages.stat().st_size != PAGE * sum(n for _, n, _ in entries):
        raise ImageFormatError(f"{pages.name}: size does not match {pagemap.name}")
    if stop is not None and stop.is_set():
        raise Stopped
    tmp_map = pagemap.with_name(pagemap.name + ".sparse")
    fd = os.open(pages, os.O_RDWR | os.O_CLOEXEC)
    try:
        new_entries, before, dropped = _compact(fd, entries, droppable, stop)
        # A pagemap with no entry at all crashes CRIU's restore (prepare_mappings reads the first
        # entry unchecked): a process whose every page is zero keeps its images, which the compaction
        # has not touched (nothing was kept, so nothing was written).
        if not dropped or not new_entries:
            return before, 0, [], []
        # CRIU does not fsync its images either; the artifact writer fsyncs every file it seals.
        _write_entries(tmp_map, _PAGEMAP_MAGIC, [_head(pages_id), *new_entries])
        os.ftruncate(fd, (before - dropped) * PAGE)
        os.replace(tmp_map, pagemap)
        kept = [(v[1], v[2], 0) for v in map(_ints, new_entries)]
        return before, dropped, _runs(entries), _runs(kept)
    except (OSError, ImageFormatError) as e:
        raise Damaged(f"{pages.name}: {e}") from e
    finally:
        os.close(fd)
        tmp_map.unlink(missing_ok=True)


def drop_zero_pages(
    images: Path, stop: threading.Event | None = None, *, advise_huge_pages: bool = False
) -> SparseStats:
    """Drop the zero pages of private anonymous memory from the CRIU dump in ``images`` (in place).

    A process whose images are not as expected is left untouched and named in ``skipped``; the dump
    stays valid either way. ``ImageFormatError`` only when the dump itself cannot be read (pstree).
    ``stop`` set: ``Stopped`` within one batch of pages. ``Damaged`` (and ``Stopped`` once pages
    moved): the dump is not to be published. ``advise_huge_pages``: the VMAs the rewrite emptied
    (``_emptied``) are marked for huge pages in the mm image, which CRIU's restorer applies (where that
    mark cannot be written the images stay valid without it).
    """
    started = time.monotonic()
    stats = SparseStats()
    for pid in _tree(images):
        try:
            vmas = _vmas(images, pid)
            before, dropped, dumped, kept = _sparsify_process(images, pid, _droppable(vmas), stop)
        except (OSError, ImageFormatError, ValueError, KeyError) as e:
            stats.skipped[pid] = str(e)
            continue
        stats.pages_before += before
        stats.processes[pid] = dropped
        emptied = _emptied(vmas, dumped, kept) if advise_huge_pages and dropped else set()
        if emptied:
            try:
                _advise_huge_pages(images, pid, emptied)
                stats.huge_page_advice += len(emptied)
            except (OSError, ImageFormatError) as e:
                stats.unadvised[pid] = str(e)
    stats.seconds = time.monotonic() - started
    return stats
