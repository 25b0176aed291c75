"""Aligned block I/O: opening with O_DIRECT where the filesystem has it, and reads and writes that move
every byte asked for (``pread``/``pwrite`` may move less).

O_DIRECT needs buffer address, file offset and length aligned to the device's logical block size;
``ALIGN`` (a page) covers 512 B and 4 KiB sectors alike.  A filesystem without O_DIRECT (tmpfs, some
overlays) answers EINVAL, at open or per request: every caller then falls back to buffered I/O.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Final

__all__ = [
    "ALIGN",
    "DirectReader",
    "open_maybe_direct",
    "pwrite_all",
    "round_up",
    "transfer_block",
    "usable_cpus",
]

ALIGN: Final = 4096


def round_up(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def usable_cpus() -> int:
    """The cores this process may run on: the affinity mask, not the host's core count (a container
    may be pinned to a few cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pwrite_all(fd: int, data: bytes | bytearray | memoryview | mmap.mmap, offset: int) -> None:
    """All of ``data`` written at ``offset`` (pwrite may write less than asked)."""
    with memoryview(data) as whole:
        done = 0
        while done < len(whole):
            with whole[done:] as part:
                n = os.pwrite(fd, part, offset + done)
            if n <= 0:
                raise OSError(f"pwrite wrote nothing at offset {offset + done}")
            done += n


def open_maybe_direct(path: Path | str, flags: int, direct: bool, mode: int = 0o600) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` opened with O_DIRECT when asked and the filesystem has it, else
    without; the flag says which."""
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            # EINVAL is how a filesystem without O_DIRECT support answers; anything else is real.
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def transfer_block(
    src: int, dst: int | None, dst_direct: bool, buf: mmap.mmap, offset: int, length: int
) -> int:
    """Read ``length`` bytes at ``offset`` into ``buf`` (and write them to ``dst``); bytes read."""
    # Every view is released explicitly: a live slice (say, held by a traceback) would stop the
    # buffer from being closed and mask the real error.
    with memoryview(buf) as view:
        # Ask for the aligned length: O_DIRECT refuses a ragged tail, and the read stops at EOF anyway.
        want = min(round_up(length), len(view))
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
            end = min(round_up(got), len(view)) if dst_direct else got
            with view[:end] as part:
                pwrite_all(dst, part, offset)
        return got


class DirectReader:
    """Reads pieces of one file from several threads, through O_DIRECT while the kernel accepts it,
    else buffered."""

    def __init__(self, path: Path, direct: bool) -> None:
        self._buffered = os.open(path, os.O_RDONLY)
        self._direct: int | None = None
        if direct:
            fd, opened_direct = open_maybe_direct(path, os.O_RDONLY, True)
            if opened_direct:
                self._direct = fd
            else:
                os.close(fd)
        self._use_direct = self._direct is not None
        self.fell_back = False

    @property
    def direct(self) -> bool:
        """Whether every read so far went through O_DIRECT."""
        return self._use_direct and not self.fell_back

    def read(self, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset`; bytes read (fewer only at end of file)."""
        got = 0
        want = len(view)
        while got < want:
            fd = self._direct if self._use_direct and self._direct is not None else self._buffered
            try:
                with view[got:] as part:
                    n = os.preadv(fd, [part], offset + got)
            except OSError as e:
                if fd == self._direct and e.errno == errno.EINVAL:
                    # A read the kernel would not do directly (alignment it requires beyond ours):
                    # every later read goes buffered. The fd stays open: other threads may be in it.
                    self._use_direct = False
                    self.fell_back = True
                    continue
                raise
            if n == 0:
                break
            got += n
        return got

    def close(self) -> None:
        os.close(self._buffered)
        if self._direct is not None:
            os.close(self._direct)
