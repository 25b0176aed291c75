"""Serving a lazy restore's pages from images that are still arriving, over CRIU's page-server protocol.

A ``criu lazy-pages --page-server --ps-socket FD`` daemon fills the memory of a tree restored with
``--lazy-pages``: the pages a process faults on first, then every page left, in the background. With
``--page-server`` it asks for them on the socket it was given instead of reading ``pages-*.img`` (it still
reads the pagemaps, which say which pages there are). Each ask is a ``struct page_server_iov``
(criu/page-xfer.c: u32 cmd, u64 nr_pages after 4 bytes of padding, u64 vaddr, u64 dst_id; before CRIU 4.2
nr_pages is a u32 and there is no padding) with cmd PS_IOV_GET for ``nr_pages`` from ``vaddr`` of the
process whose pagemap is ``pagemap-<dst_id>.img``. The answer is the same header with cmd PS_IOV_ADD_F
and the flag PE_PRESENT, ``nr_pages`` as many as it gives (no more than asked, all from one pagemap
entry), then the pages' bytes; answers go in the order of the asks. A close (PS_IOV_CLOSE, or
PS_IOV_FORCE_CLOSE from a daemon whose socket another process also holds) is answered with a 32-bit
zero, and the exchange is over.

The server reads a page only once ``ready`` says the bytes that hold it are in and checked: so neither
the daemon nor the process it fills gets a byte a fetch has not checked yet. It is given one end of a
socket pair, the daemon the other: nothing listens, so no other process can ask it for pages.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_snapshot.criu.sparse import PAGE, read_pagemap
from dynamo_snapshot.criu.version import CriuVersion
from dynamo_snapshot.fileio.beneath import open_regular_beneath, opened_dir, reopen

__all__ = ["PageIndex", "PageServerError", "PageServerStats", "Ready", "serve_pages"]

log = logging.getLogger(__name__)

# struct page_server_iov as CRIU 4.2 and later send it, and as earlier ones do.
_IOV = struct.Struct("<I4xQQQ")
_IOV_BEFORE_4_2 = struct.Struct("<IIQQ")
_PS_IOV_GET = 7
_PS_IOV_ADD_F = 6
_PS_IOV_CLOSE = 0x1023
_PS_IOV_FORCE_CLOSE = 0x1024
_PS_CMD_BITS = 16
_PE_LAZY = 1 << 1
_PE_PRESENT = 1 << 2
_STATUS = struct.Struct("<i")

# (pages file, offset, length): returns once those bytes of the file are in and checked.
Ready = Callable[[str, int, int], Awaitable[None]]


class PageServerError(Exception):
    """The daemon asked for something the images do not hold, or the exchange broke."""


@dataclass(frozen=True)
class _Run:
    vaddr: int
    pages: int
    offset: int  # in the process's pages file
    lazy: bool  # PE_LAZY: the daemon may serve it; the rest the restore reads from the file itself


@dataclass(frozen=True)
class _Process:
    pages_file: str
    runs: list[_Run]
    starts: list[int]


class PageIndex:
    """Where each process's pages lie in its pages image: from the pagemaps, read once."""

    def __init__(self, images: Path) -> None:
        self._processes: dict[int, _Process] = {}
        for pagemap in sorted(images.glob("pagemap-*.img")):
            pid = int(pagemap.name.removeprefix("pagemap-").removesuffix(".img"))
            pages_id, entries = read_pagemap(pagemap)
            runs, offset = [], 0
            for vaddr, pages, flags in sorted(entries):
                runs.append(_Run(vaddr, pages, offset, bool(flags & _PE_LAZY)))
                offset += pages * PAGE
            self._processes[pid] = _Process(f"pages-{pages_id}.img", runs, [r.vaddr for r in runs])

    @property
    def pages_files(self) -> list[str]:
        return sorted({p.pages_file for p in self._processes.values()})

    def eager(self) -> list[tuple[str, int, int]]:
        """(pages file, offset, length) of the pages a lazy restore reads from the images itself (not
        PE_LAZY: stacks, shared and file mappings): they must be in before CRIU starts."""
        return [
            (p.pages_file, r.offset, r.pages * PAGE)
            for p in self._processes.values()
            for r in p.runs
            if not r.lazy
        ]

    def locate(self, pid: int, vaddr: int, pages: int) -> tuple[str, int, int]:
        """(pages file, offset, pages) of the first of `pages` from `vaddr`: as many as one run holds."""
        process = self._processes.get(pid)
        if process is None:
            raise PageServerError(f"pages of process {pid} asked for: the images hold no pagemap-{pid}.img")
        i = bisect.bisect_right(process.starts, vaddr) - 1
        run = process.runs[i] if i >= 0 else None
        if run is None or vaddr >= run.vaddr + run.pages * PAGE or (vaddr - run.vaddr) % PAGE:
            raise PageServerError(f"page {vaddr:#x} of process {pid} asked for: not in its images")
        skip = (vaddr - run.vaddr) // PAGE
        return process.pages_file, run.offset + skip * PAGE, min(pages, run.pages - skip)


@dataclass
class PageServerStats:
    asks: int = 0
    bytes: int = 0
    # Seconds asks waited for their bytes to be in and checked.
    waited_s: float = 0.0
    files: dict[str, int] = field(default_factory=dict)


async def serve_pages(
    sock: socket.socket, images: Path, index: PageIndex, ready: Ready, criu_version: CriuVersion
) -> PageServerStats:
    """Answer the daemon (of `criu_version`) on `sock`, its end of a socket pair, from the pages images in
    `images` (``index``: their pagemaps) until it closes the exchange."""
    iov = _IOV if criu_version.at_least((4, 2)) else _IOV_BEFORE_4_2
    stats = PageServerStats()
    # Opened now: the directory's names may go before the last ask (its files stay).
    opened = await asyncio.to_thread(_open_all, images, index.pages_files)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as fds:
        for fd in opened.values():
            fds.callback(os.close, fd)
        try:
            while True:
                try:
                    head = await reader.readexactly(iov.size)
                except asyncio.IncompleteReadError as e:
                    if not e.partial:
                        return stats  # the daemon went without a close: it said why in its log
                    raise PageServerError("the lazy-pages daemon sent half an ask") from None
                cmd, nr_pages, vaddr, pid = iov.unpack(head)
                if cmd & ((1 << _PS_CMD_BITS) - 1) in (_PS_IOV_CLOSE, _PS_IOV_FORCE_CLOSE):
                    writer.write(_STATUS.pack(0))
                    await writer.drain()
                    return stats
                if cmd != _PS_IOV_GET:
                    raise PageServerError(f"the lazy-pages daemon sent command {cmd:#x}, not a page ask")
                name, offset, pages = index.locate(pid, vaddr, nr_pages)
                length = pages * PAGE
                started = loop.time()
                await ready(name, offset, length)
                waited = loop.time() - started
                stats.waited_s += waited
                log.debug(
                    "pages asked for",
                    extra={"pid": pid, "file": name, "offset": offset, "bytes": length, "waited_s": waited},
                )
                data = await asyncio.to_thread(_pread_fully, opened[name], length, offset)
                flags = _PE_PRESENT << _PS_CMD_BITS | _PS_IOV_ADD_F
                writer.write(iov.pack(flags, pages, vaddr, pid))
                writer.write(data)
                await writer.drain()
                stats.asks += 1
                stats.bytes += length
                stats.files[name] = stats.files.get(name, 0) + length
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _open_all(images: Path, names: list[str]) -> dict[str, int]:
    opened: dict[str, int] = {}
    try:
        with opened_dir(images) as dirfd:
            for name in names:
                path_fd = open_regular_beneath(dirfd, name, what="pages image", single_link=False)
                try:
                    opened[name] = reopen(path_fd)
                finally:
                    os.close(path_fd)
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise
    return opened


def _pread_fully(fd: int, length: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < length:
        chunk = os.pread(fd, length - done, offset + done)
        if not chunk:
            raise PageServerError(f"pages image ends at {offset + done}, {length - done} bytes short")
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)
