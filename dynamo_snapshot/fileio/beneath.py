"""Paths someone else controls, resolved beneath a directory descriptor without following links.

A privileged process that opens ``<dir>/<name the tenant chose>`` by path lets the tenant steer it: a
symbolic link, a ``..``, a bind or a mount point anywhere along the way turns the open into one
elsewhere on the host. Everything here resolves a relative path below a directory file descriptor, one
component at a time as the kernel's ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`` does (used where the kernel has it; a walk with ``O_NOFOLLOW``
from one directory descriptor to the next where it does not), so nothing outside the directory is ever
opened, read, written or even stat'ed.

Files are first opened ``O_PATH`` (which opens nothing: a FIFO does not block, a device's driver is not
called) and only reopened for reading, through ``/proc/self/fd``, once ``fstat`` has shown a regular file
with one name: a second hard link could be another tenant's file or one of the host's that the tenant
linked into its directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "UnsafePath",
    "components",
    "fd_path",
    "kind_of",
    "lstat_beneath",
    "open_dir",
    "open_dirs_beneath",
    "open_regular_beneath",
    "opened_dir",
    "read_json_beneath",
    "reopen",
    "temporary_name",
]

# openat2(2): the same number on every architecture Linux has added it to (5.6+).
_SYS_OPENAT2 = 437
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
# A rename elsewhere in the tree makes the kernel give up a resolution with EAGAIN; it is retried.
_AGAIN_TRIES = 16


class UnsafePath(OSError):
    """The path names something the caller must not touch; the message says what and why."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# None until the first call tells whether this kernel (and seccomp profile) lets openat2 through.
_have_openat2: bool | None = None


def components(rel: str | PurePosixPath) -> tuple[str, ...]:
    """The names of a relative path, refused (UnsafePath) when it is absolute, empty or has ``..``."""
    path = PurePosixPath(rel)
    if path.is_absolute():
        raise UnsafePath(errno.EXDEV, f"{str(rel)!r} is absolute: only a path inside the directory is taken")
    parts = tuple(p for p in path.parts if p != ".")
    if ".." in parts:
        raise UnsafePath(errno.EXDEV, f"{str(rel)!r} has '..': only a path inside the directory is taken")
    if not parts:
        raise UnsafePath(errno.EINVAL, f"{str(rel)!r} names no file")
    return parts


def fd_path(fd: int) -> Path:
    """A path that reopens the very file behind ``fd`` (whatever its name is by now)."""
    return Path(f"/proc/self/fd/{fd}")


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words, for a refusal."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def open_dir(path: Path) -> int:
    """A descriptor of the directory ``path`` (a path the caller trusts), its last name not a link."""
    return os.open(path, _DIR)


@contextlib.contextmanager
def opened_dir(path: Path) -> Iterator[int]:
    fd = open_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def _openat2(dirfd: int, rel: str, flags: int, mode: int, *, cross_mounts: bool) -> int | None:
    """openat2 with the module's resolve flags; None where the kernel or a seccomp profile lacks it."""
    global _have_openat2
    if _have_openat2 is False:
        return None
    how = _OpenHow(flags, mode, _RESOLVE if cross_mounts else _RESOLVE | _RESOLVE_NO_XDEV)
    for _ in range(_AGAIN_TRIES):
        fd = _libc.syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dirfd),
            ctypes.c_char_p(os.fsencode(rel)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            _have_openat2 = True
            return int(fd)
        err = ctypes.get_errno()
        if err == errno.EAGAIN:
            continue
        if err in (errno.ENOSYS, errno.EPERM) and not _have_openat2:
            _have_openat2 = False
            return None
        raise _refusal(err, rel, dirfd)
    raise UnsafePath(errno.EAGAIN, f"{rel!r}: the directory kept changing while it was resolved")


def _refusal(err: int, rel: str, dirfd: int | None = None) -> OSError:
    if err in (errno.ENOTDIR, errno.ELOOP) and dirfd is not None:
        blocker = _blocker(dirfd, components(rel))
        if blocker is not None:
            where, mode = blocker
            code = errno.ELOOP if stat.S_ISLNK(mode) else errno.ENOTDIR
            said = f"{where!r} is {kind_of(mode)}, not a directory"
            return UnsafePath(code, said if where == rel else f"{rel!r}: {said}")
    if err == errno.ELOOP:
        return UnsafePath(err, f"{rel!r} goes through a symbolic link")
    if err == errno.EXDEV:
        return UnsafePath(err, f"{rel!r} leaves the directory (a mount point or a link out of it)")
    if err == errno.ENOTDIR:
        return UnsafePath(err, f"{rel!r}: a name on the way is not a directory")
    return OSError(err, f"{rel}: {os.strerror(err)}")


def _blocker(dirfd: int, parts: tuple[str, ...]) -> tuple[str, int] | None:
    """The first name on the way that is no directory, and its ``st_mode``."""
    fd = os.dup(dirfd)
    try:
        for i, name in enumerate(parts):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return "/".join(parts[: i + 1]), st.st_mode
            try:
                nfd = os.open(name, _DIR, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nfd
        return None
    finally:
        os.close(fd)


def _walk_open(dirfd: int, parts: tuple[str, ...], flags: int, mode: int, *, cross_mounts: bool) -> int:
    """Without openat2: each directory opened from the last with O_NOFOLLOW, staying on its device
    unless ``cross_mounts``."""
    device = None if cross_mounts else os.fstat(dirfd).st_dev
    fd = os.dup(dirfd)
    try:
        for i, name in enumerate(parts[:-1]):
            try:
                nfd = os.open(name, _DIR, dir_fd=fd)
            except OSError as e:
                raise _refusal(e.errno or errno.EIO, "/".join(parts[: i + 1]), dirfd) from None
            os.close(fd)
            fd = nfd
            if device is not None and os.fstat(fd).st_dev != device:
                raise UnsafePath(errno.EXDEV, f"{'/'.join(parts[: i + 1])!r} is another filesystem's")
        try:
            out = os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=fd)
        except OSError as e:
            raise _refusal(e.errno or errno.EIO, "/".join(parts), dirfd) from None
        if device is not None and os.fstat(out).st_dev != device:
            os.close(out)
            raise UnsafePath(errno.EXDEV, f"{'/'.join(parts)!r} is another filesystem's")
        return out
    finally:
        os.close(fd)


def _open_beneath(
    dirfd: int, parts: tuple[str, ...], flags: int, mode: int = 0, *, cross_mounts: bool = False
) -> int:
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    fd = _openat2(dirfd, "/".join(parts), flags, mode, cross_mounts=cross_mounts)
    if fd is not None:
        return fd
    return _walk_open(dirfd, parts, flags, mode, cross_mounts=cross_mounts)


def open_regular_beneath(
    dirfd: int,
    rel: str | PurePosixPath,
    *,
    what: str = "file",
    single_link: bool = True,
    cross_mounts: bool = False,
) -> int:
    """An ``O_PATH`` descriptor of the regular file ``rel`` beneath ``dirfd``, with one name (no other
    hard link) unless not ``single_link``, on the directory's own filesystem unless ``cross_mounts``
    (mounts a runtime made in a container's root, which its tenant cannot); UnsafePath, saying what it
    found, for anything else. Read it through ``reopen``."""
    parts = components(rel)
    fd = _open_beneath(dirfd, parts, _PATH, cross_mounts=cross_mounts)
    try:
        st = os.fstat(fd)
        shown = "/".join(parts)
        if not stat.S_ISREG(st.st_mode):
            code = errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.EINVAL
            raise UnsafePath(code, f"{what} {shown!r} is {kind_of(st.st_mode)}, not a regular file")
        if single_link and st.st_nlink != 1:
            raise UnsafePath(
                errno.EMLINK,
                f"{what} {shown!r} has {st.st_nlink} hard links: it may be a file from outside the "
                "directory, which is never read through it",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen(fd: int, flags: int = os.O_RDONLY) -> int:
    """A new descriptor of the file behind the (``O_PATH``) descriptor ``fd``, opened with ``flags``."""
    return os.open(fd_path(fd), flags | os.O_CLOEXEC)


def read_json_beneath(path: Path, limit: int, *, what: str = "file") -> Any:
    """The JSON of the file ``path`` (a name in a directory another party writes), read up to ``limit``
    bytes beneath the directory's descriptor. OSError when it is missing, a link or not a regular file with
    one name (a fifo is refused, never opened); ValueError when it is longer than ``limit`` or not JSON."""
    with opened_dir(path.parent) as directory:
        handle = open_regular_beneath(directory, path.name, what=what)
        try:
            fd = reopen(handle)
        finally:
            os.close(handle)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is longer than {limit} bytes")
    return json.loads(data)


def open_dirs_beneath(dirfd: int, rel: str | PurePosixPath, *, create: bool, mode: int = 0o755) -> int:
    """A descriptor of the directory ``rel`` beneath ``dirfd``, each missing directory made on the way
    when ``create``; a link, a file or a mount point where a directory should be is UnsafePath."""
    parts = components(rel)
    device = os.fstat(dirfd).st_dev
    fd = os.dup(dirfd)
    try:
        for i, name in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=fd)
            try:
                nfd = _open_beneath(fd, (name,), os.O_RDONLY | os.O_DIRECTORY)
            except UnsafePath as e:
                raise _refusal(e.errno or errno.ENOTDIR, "/".join(parts[: i + 1]), dirfd) from None
            os.close(fd)
            fd = nfd
            if os.fstat(fd).st_dev != device:
                raise UnsafePath(errno.EXDEV, f"{'/'.join(parts[: i + 1])!r} is another filesystem's")
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_beneath(dirfd: int, name: str) -> os.stat_result | None:
    """The status of the entry ``name`` of ``dirfd`` itself (a link is a link); None when absent."""
    components(name)
    if "/" in name:
        raise UnsafePath(errno.EINVAL, f"{name!r} is not a single name")
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def temporary_name(name: str) -> str:
    """A fresh, unguessable name beside ``name`` for a file that is then renamed over it."""
    return f".{name}.{secrets.token_hex(8)}.tmp"
