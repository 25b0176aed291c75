"""A container's writable layer as a tar: captured from its overlayfs upperdir at checkpoint, applied into
another live container's root filesystem at restore.

The tar holds first what CRIU opens at restore (directories, symlinks and the files the checkpointed tree
had mapped or open) and then every other file; its header counts the first part ("early"), so a restore
can start CRIU once that part is written and write the rest beside it. A diff without the count is
applied whole before CRIU.

Applying runs as root on the host into a tree the tenant's image controls, so every path is walked one
component at a time from a directory fd with O_NOFOLLOW: a symlink planted where a directory is expected is
an error, never a way out of the tree. Capturing never follows a symlink either.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import stat
import tarfile
import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DIFF_FILE = "rootfs-diff.tar"  # inside the artifact's criu/ directory
HEADER_NAME = ".dynamo-snapshot-rootfs-diff.json"
# 2: each member's whole-second mtime in its tar header and the sub-second ones in the diff's own header
# (PAX would put a header of its own before every member with one: a compile cache's thousands of files
# cost a restore more to parse than to write). 1: PAX mtimes, still applied.
FORMAT = 2
_READABLE_FORMATS = (1, 2)
_NS = 1_000_000_000
_MAX_HEADER = 256 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a fifo swapped in at a file's place must fail the open (ENXIO) instead of blocking the agent.
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OCTAL = re.compile(rb"\\([0-7]{3})")
_TAR_KINDS = {
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.LNKTYPE: "a hard link",
}


class RootfsDiffError(Exception):
    """message meant for a pod annotation: names the path and what is wrong"""


@dataclass(frozen=True)
class DiffStats:
    files: int  # regular files + symlinks + dirs written
    bytes: int  # regular-file bytes
    deleted: int  # whiteouts (captured) / paths removed (applied)
    skipped: tuple[str, ...]  # container paths left out (devices, fifos, sockets, excluded...)
    early: int | None = None  # captured: the members written first, for CRIU (None: not told apart)


def _unescape(field: str) -> str:
    raw = _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), field.encode("utf-8", "surrogateescape"))
    return raw.decode("utf-8", "surrogateescape")


def overlay_upperdir(mountinfo: str) -> Path | None:
    """From /proc/PID/mountinfo text: the upperdir of the overlay mounted at "/", None when "/" is not
    overlay or has no upperdir."""
    upper: Path | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields[6:] or _unescape(fields[4]) != "/":
            continue
        # Mounts stacked on "/" come later in the file: the last one is what the process sees.
        upper = None
        sep = fields.index("-", 6)
        if fields[sep + 1] not in ("overlay", "overlayfs") or len(fields) < sep + 4:
            continue
        # The kernel writes a ',' inside an option's value as \054, so splitting before unescaping is exact.
        for option in fields[sep + 3].split(","):
            key, _, value = option.partition("=")
            if key == "upperdir" and value:
                upper = Path(_unescape(value))
    return upper


def _excludes(exclude: Sequence[str]) -> tuple[str, ...]:
    # "/" becomes "" so that every container path ("/...") lies beneath it.
    return tuple("/".join(("", *filter(None, e.split("/")))) for e in exclude)


def _under(cpath: str, excl: tuple[str, ...]) -> bool:
    return any(cpath == e or cpath.startswith(e + "/") for e in excl)


def _ovl_xattr(path: str, name: str) -> bytes | None:
    for prefix in ("trusted.overlay.", "user.overlay."):
        try:
            return os.getxattr(path, prefix + name, follow_symlinks=False)
        except OSError:
            continue
    return None


@contextmanager
def _naming(cpath: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise RootfsDiffError(f"{cpath}: {e.strerror or e}") from e


@contextmanager
def _parent(root_fd: int, rel: str, *, create: bool) -> Iterator[int | None]:
    """The directory holding `rel`, walked from `root_fd` without following any link (None when one on
    the way is missing and `create` is off); OSErrors in the block become errors naming `rel`."""
    parts = rel.split("/")
    with _naming("/" + rel):
        fd = os.dup(root_fd)
        try:
            for i, name in enumerate(parts[:-1]):
                try:
                    nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        break
                    os.mkdir(name, 0o755, dir_fd=fd)
                    nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                    raise RootfsDiffError(
                        f"/{rel}: /{'/'.join(parts[: i + 1])} in the target root filesystem is "
                        f"{'a symlink' if link else 'not a directory'}; refusing to go through it"
                    ) from e
                os.close(fd)
                fd = nfd
            else:
                yield fd
                return
            yield None
        finally:
            os.close(fd)


def capture_diff(
    upperdir: Path, out: Path, *, exclude: Sequence[str] = (), held: Collection[str] | None = None
) -> DiffStats:
    """Write the writable layer at `upperdir` as an uncompressed tar at `out`: a JSON header of the
    deleted (whiteout) and opaque paths first, then files, directories and symlinks in sorted order.

    Given `held` (the container paths the checkpointed tree has mapped or open), the directories,
    symlinks and held files come first and the header counts them; without it the count is left out and
    a restore applies the whole diff before CRIU."""
    excl = _excludes(exclude)
    entries: list[tuple[str, os.stat_result, str]] = []  # relative path, lstat, symlink target
    deleted: list[str] = []
    opaque: list[str] = []
    skipped: list[str] = []

    def walk(dir_path: str, rel: str) -> None:
        with _naming("/" + rel):
            names = sorted(os.listdir(dir_path))
        for name in names:
            r, path = f"{rel}/{name}" if rel else name, os.path.join(dir_path, name)
            if _under("/" + r, excl):
                skipped.append("/" + r)
                continue
            with _naming("/" + r):
                st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                deleted.append(r)
            elif stat.S_ISDIR(st.st_mode):
                # Either would leave the data in a lower layer the diff does not carry.
                if _ovl_xattr(path, "redirect") is not None:
                    raise RootfsDiffError(f"/{r}: a directory renamed through overlay redirect_dir")
                opaque.extend([r] if _ovl_xattr(path, "opaque") == b"y" else [])
                entries.append((r, st, ""))
                walk(path, r)
            elif stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode):
                if _ovl_xattr(path, "metacopy") is not None:
                    raise RootfsDiffError(f"/{r}: an overlay metacopy file (data in a lower layer)")
                with _naming("/" + r):
                    entries.append((r, st, os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""))
            else:
                skipped.append("/" + r)

    nbytes = 0
    with _naming(str(upperdir)):
        root_fd = os.open(upperdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walk(str(upperdir), "")
        mtimes = {rel: st.st_mtime_ns for rel, st, _ in entries if st.st_mtime_ns % _NS}
        early = None if held is None else _held_first(entries, held)
        counted = {} if early is None else {"early": early}
        with _naming(str(out)), tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            doc = json.dumps(
                {"format": FORMAT, "deleted": deleted, "opaque": opaque, **counted, "mtimes": mtimes}
            ).encode()
            header = tarfile.TarInfo(HEADER_NAME)
            header.size, header.mode = len(doc), 0o644
            tar.addfile(header, io.BytesIO(doc))
            for rel, st, target in entries:
                info = tarfile.TarInfo(rel)
                info.mode, info.uid, info.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
                info.mtime = st.st_mtime_ns // _NS
                if not stat.S_ISREG(st.st_mode):
                    info.type = tarfile.SYMTYPE if stat.S_ISLNK(st.st_mode) else tarfile.DIRTYPE
                    info.linkname = target
                    tar.addfile(info)
                    continue
                with _parent(root_fd, rel, create=False) as parent:
                    if parent is None:
                        raise FileNotFoundError(errno.ENOENT, "vanished while capturing")
                    fd = os.open(_base(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
                with os.fdopen(fd, "rb") as f:
                    now = os.fstat(fd)
                    if not stat.S_ISREG(now.st_mode):
                        raise RootfsDiffError(f"/{rel}: no longer a regular file while capturing")
                    info.size = now.st_size
                    tar.addfile(info, f)
                nbytes += info.size
    finally:
        os.close(root_fd)
    return DiffStats(len(entries), nbytes, len(deleted), tuple(skipped), early)


def _held_first(entries: list[tuple[str, os.stat_result, str]], held: Collection[str]) -> int:
    """Reorder ``entries`` (relative path, lstat, link target) with the directories, symlinks and held
    files first; returns how many come first."""
    first = {"/" + rel for rel, st, _ in entries if not stat.S_ISREG(st.st_mode)} | set(held)
    # A stable sort keeps the walk's order (a directory before what it holds) within each part.
    entries.sort(key=lambda e: "/" + e[0] not in first)
    return sum(1 for rel, _, _ in entries if "/" + rel in first)


def _base(rel: str) -> str:
    return rel.rsplit("/", 1)[-1]


def _relpath(name: str, what: str) -> str:
    parts = name.removesuffix("/").split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise RootfsDiffError(
            f"rootfs diff {what} {name!r}: not a relative path inside the root filesystem "
            "(empty, absolute, or with '.' or '..')"
        )
    return "/".join(parts)


@dataclass(frozen=True)
class _Header:
    deleted: list[str]
    opaque: list[str]
    mtimes: dict[str, int]
    early: int | None  # members CRIU needs, written first; None: all of them


def _read_header(tar: tarfile.TarFile, diff: Path) -> _Header:
    first = tar.next()
    if first is None or first.name != HEADER_NAME or not first.isreg() or first.size > _MAX_HEADER:
        found = repr(first.name) if first is not None else "nothing"
        raise RootfsDiffError(f"{diff}: not a rootfs diff: its first member is {found}, not {HEADER_NAME}")
    src = tar.extractfile(first)
    try:
        doc: object = json.loads(src.read() if src is not None else b"")
    except ValueError as e:
        raise RootfsDiffError(f"{diff}: its {HEADER_NAME} is not JSON: {e}") from e
    version = doc.get("format") if isinstance(doc, dict) else doc
    if not isinstance(doc, dict) or version not in _READABLE_FORMATS:
        raise RootfsDiffError(
            f"{diff}: rootfs diff format {version!r} is unknown (this agent reads "
            f"{' and '.join(map(str, _READABLE_FORMATS))})"
        )
    lists: list[list[str]] = []
    for key in ("deleted", "opaque"):
        paths = doc.get(key, [])
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise RootfsDiffError(f"{diff}: the header's {key!r} is not a list of paths")
        lists.append([_relpath(p, f"{key} path") for p in paths])
    mtimes = doc.get("mtimes", {})
    if not isinstance(mtimes, dict) or not all(_is_int(v) for v in mtimes.values()):
        raise RootfsDiffError(f"{diff}: the header's 'mtimes' is not a map of paths to nanoseconds")
    early = doc.get("early")
    if early is not None and not (_is_int(early) and early >= 0):
        raise RootfsDiffError(f"{diff}: the header's 'early' is {early!r}, not a count of members")
    try:
        stamps = {_relpath(k, "mtimes path"): v for k, v in mtimes.items()}
    except RootfsDiffError as e:
        raise RootfsDiffError(f"{diff}: {e}") from None
    return _Header(lists[0], lists[1], stamps, early)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Target:
    """Writes into the root filesystem open at `root`; counts what it did."""

    def __init__(self, root: int, excl: tuple[str, ...], mtimes: dict[str, int]) -> None:
        self.root, self.excl, self.mtimes = root, excl, mtimes
        self.files = self.bytes = self.deleted = 0
        self.skipped: list[str] = []
        self.dir_times: list[tuple[str, int]] = []

    def mtime_ns(self, rel: str, m: tarfile.TarInfo) -> int:
        """The member's mtime as captured: the diff's header where it has sub-seconds, else the tar's."""
        found = self.mtimes.get(rel)
        if found is not None:
            return found
        whole = int(m.mtime)  # a PAX mtime (format 1) is a float: its fraction apart, to stay exact
        return whole * _NS + round((m.mtime - whole) * _NS)

    def excluded(self, cpath: str) -> bool:
        hit = _under(cpath, self.excl)
        self.skipped.extend([cpath] if hit else [])
        return hit

    def remove(self, dfd: int, name: str, cpath: str) -> bool:
        """Remove `name` without following it, keeping any excluded path beneath; True when it went."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dfd)
        elif any(e.startswith(cpath + "/") for e in self.excl):
            self.clear(dfd, name, cpath)
            return False  # stays, holding what is excluded; clear() counted what went
        else:
            shutil.rmtree(name, dir_fd=dfd)
        return True

    def clear(self, parent: int, name: str, cpath: str) -> None:
        try:
            dfd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError:
            return  # missing or not a directory: nothing to empty, a directory member replaces it
        try:
            for child in sorted(os.listdir(dfd)):
                if not self.excluded(f"{cpath}/{child}") and self.remove(dfd, child, f"{cpath}/{child}"):
                    self.deleted += 1
        finally:
            os.close(dfd)

    def delete(self, rel: str, *, opaque: bool) -> None:
        if self.excluded("/" + rel):
            return
        with _parent(self.root, rel, create=False) as parent:
            if parent is not None and opaque:
                self.clear(parent, _base(rel), "/" + rel)
            elif parent is not None and self.remove(parent, _base(rel), "/" + rel):
                self.deleted += 1

    def write(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        rel = _relpath(m.name, "member")
        if not (m.isreg() or m.isdir() or m.issym()):
            kind = _TAR_KINDS.get(m.type, f"a tar member of type {m.type!r}")
            raise RootfsDiffError(f"/{rel}: the diff holds {kind}; only files, dirs and symlinks are applied")
        if self.excluded("/" + rel):
            return
        name = _base(rel)
        with _parent(self.root, rel, create=True) as parent:
            assert parent is not None
            try:
                st: os.stat_result | None = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            keep = stat.S_IFDIR if m.isdir() else stat.S_IFREG if m.isreg() else -1
            if st is not None and stat.S_IFMT(st.st_mode) != keep:
                self.remove(parent, name, "/" + rel)
                st = None
            if m.issym():
                os.symlink(m.linkname, name, dir_fd=parent)
                os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
                mtime = self.mtime_ns(rel, m)
                os.utime(name, ns=(mtime, mtime), dir_fd=parent, follow_symlinks=False)
            else:
                if m.isdir() and st is None:
                    os.mkdir(name, 0o700, dir_fd=parent)
                fd = os.open(name, _DIR_FLAGS if m.isdir() else _FILE_FLAGS, 0o600, dir_fd=parent)
                try:
                    self.fill(tar, m, fd, rel)
                finally:
                    os.close(fd)
            self.dir_times.extend([(rel, self.mtime_ns(rel, m))] if m.isdir() else [])
        self.files += 1

    def fill(self, tar: tarfile.TarFile, m: tarfile.TarInfo, fd: int, rel: str) -> None:
        if m.isreg():
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RootfsDiffError(f"/{m.name}: not a regular file in the target root filesystem")
            src = tar.extractfile(m)
            with open(fd, "wb", closefd=False) as out:
                shutil.copyfileobj(src or io.BytesIO(), out, 1 << 20)
            mtime = self.mtime_ns(rel, m)
            os.utime(fd, ns=(mtime, mtime))
            self.bytes += m.size
        os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears set-id bits


class DiffApply:
    """A `capture_diff` tar applied onto the live root filesystem directory `rootfs` in two steps:
    `early` (deleted paths removed, opaque directories emptied, then the members CRIU needs) and `rest`
    (every other member, then the directories' mtimes), which may run beside CRIU in another thread.
    Paths under `exclude` are left alone. Closed by `rest`, or by `close` where it does not run."""

    def __init__(self, diff: Path, rootfs: Path, *, exclude: Sequence[str] = ()) -> None:
        self.diff = diff
        self.stop = threading.Event()  # set: `rest` ends before its next member, unfinished
        with _naming(str(rootfs)):
            self._root = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with _naming(str(diff)), self._reading():
                self._tar = tarfile.open(diff, "r:")  # noqa: SIM115 (closed by rest or close)
        except BaseException:
            os.close(self._root)
            raise
        self._exclude = _excludes(exclude)
        self._target: _Target | None = None
        self._early: int | None = None

    @classmethod
    def begin(cls, diff: Path, rootfs: Path, *, exclude: Sequence[str] = ()) -> DiffApply:
        """Open the diff and apply its `early` part; closed again where that fails."""
        applying = cls(diff, rootfs, exclude=exclude)
        try:
            applying.early()
        except BaseException:
            applying.close()
            raise
        return applying

    @contextmanager
    def _reading(self) -> Iterator[None]:
        try:
            yield
        except tarfile.TarError as e:
            raise RootfsDiffError(f"{self.diff}: not a readable rootfs diff tar: {e}") from e

    def early(self) -> None:
        with self._reading():
            header = _read_header(self._tar, self.diff)
            target = self._target = _Target(self._root, self._exclude, header.mtimes)
            for rel in header.deleted:
                target.delete(rel, opaque=False)
            for rel in header.opaque:
                target.delete(rel, opaque=True)
            self._early = header.early
            written = 0
            while header.early is None or written < header.early:
                if (member := self._tar.next()) is None:
                    break
                target.write(self._tar, member)
                written += 1

    @property
    def complete(self) -> bool:
        """Whether `early` wrote the whole diff (it had no count of the members CRIU needs)."""
        return self._early is None

    def rest(self) -> DiffStats:
        target = self._target
        assert target is not None, "early() first"
        try:
            with self._reading():
                while not self.stop.is_set() and (member := self._tar.next()) is not None:
                    target.write(self._tar, member)
            if self.stop.is_set():
                raise RootfsDiffError(f"{self.diff}: applying stopped, the restore having ended")
            # Last and deepest first, as writing into a directory moves its mtime.
            for rel, mtime in reversed(target.dir_times):
                with _parent(self._root, rel, create=False) as parent:
                    if parent is not None:
                        os.utime(_base(rel), ns=(mtime, mtime), dir_fd=parent, follow_symlinks=False)
        finally:
            self.close()
        return DiffStats(target.files, target.bytes, target.deleted, tuple(target.skipped))

    def close(self) -> None:
        if self._root >= 0:
            self._tar.close()
            os.close(self._root)
            self._root = -1


def apply_diff(diff: Path, rootfs: Path, *, exclude: Sequence[str] = ()) -> DiffStats:
    """Apply a `capture_diff` tar onto the live root filesystem directory `rootfs` whole: deleted paths
    removed, opaque directories emptied, then the members written; paths under `exclude` are left
    alone."""
    return DiffApply.begin(diff, rootfs, exclude=exclude).rest()
