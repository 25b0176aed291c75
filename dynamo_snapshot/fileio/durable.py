"""Making writes durable: a file replaced whole or not at all, and the directory entries that name it
flushed to disk (an fsync of a file does not persist a rename or a create in its directory)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

__all__ = ["fsync_dir", "fsync_dirs", "write_atomic", "write_replacing"]

T = TypeVar("T")

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TRIES = 8


def fsync_dir(path: Path) -> None:
    """Flush the directory ``path`` (its entries: creates, renames, unlinks) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs(dirs: Iterable[Path]) -> None:
    for d in dirs:
        fsync_dir(d)


def write_replacing(path: Path, write: Callable[[Path], T], *, durable: bool = True) -> T:
    """``write(tmp)`` fills a new file beside ``path``, which then replaces ``path`` in one rename (with
    ``durable``, the directory flushed best-effort: some filesystems refuse that); ``write``'s result. A
    reader sees the old file or the new one, never a part; a failed ``write`` leaves no temporary file
    behind."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        result = write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)
    return result


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data``: a reader sees the old file or the new one, never a part. With
    ``durable``, on disk when this returns; without it, only whole: what another process must never see
    half-written (a sentinel in a control directory that does not outlive its pod) need not wait for the
    disk.

    The new file gets a random name, created exclusively without following links, so a link planted in
    a directory that someone else may write cannot turn this write into one elsewhere; the rename then
    replaces whatever ``path`` is (a planted link included, never its target)."""
    for attempt in range(_TRIES):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, _CREATE, mode)
        except FileExistsError:
            if attempt + 1 == _TRIES:
                raise
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)  # not the umask's to say: the reader may be another user
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        break
    if durable:
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)
