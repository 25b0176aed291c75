"""Which of the host's files an image takes, at the paths they have on the host.

A worker image made of the host's own Python environment keeps every file where the host has it: the
interpreter path, `sys.path` and every library a process maps are then the same in the container as on
the host, and a CRIU restore of a container's process into another container of the same image finds each
mapped file at its recorded path.

`walk_tree` lists a directory tree as `HostFile`s (`merge` sorts them, a directory before its contents),
staying on the tree's own filesystem: a mount inside it (the NVIDIA driver's read-only /usr/local/nvidia
on the GPU machine) belongs to the host, and the node injects it into the containers that ask for it
(CDI). It leaves out what `Tree.skip` names and every compile cache (`COMPILE_CACHE_NAMES`): a worker
from the image must start with an empty torch.compile / Triton / CUDA JIT cache, as on a new node.
`path_chain` adds one host path with each symlink met on the way to the file it names, and the
directories above it.

The files' metadata (not their contents) make the image's tag (`describe`): a file whose size, mode, owner
or modification time changes makes a new image, which is how `make` and `rsync` tell changed files; the
layer's digest, computed while it is streamed, covers the bytes.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Directory and file names under a selected tree that are compile caches or tools' caches, never part of
# an environment: torch.compile (`torchinductor_<user>`), Triton (`.triton`), CUDA's JIT cache (`.nv`),
# and the generic per-user cache directory.
COMPILE_CACHE_NAMES = frozenset({".triton", ".nv", ".cache", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
COMPILE_CACHE_PREFIXES = ("torchinductor_",)


class SelectionError(RuntimeError):
    """A path the image needs is missing or is not what the selection expects."""


@dataclass(frozen=True)
class HostFile:
    """One path of the image, taken from the host at the same path (`path` is relative to /)."""

    path: str
    kind: str  # "dir", "file" or "link"
    mode: int
    uid: int
    gid: int
    size: int = 0
    mtime_ns: int = 0
    link: str = ""
    # Where a file's bytes are read from when that is not the same host path (staged files).
    src: str = ""
    # (device, inode) of a file with more than one name: the layer stores the later names as hard links.
    inode: tuple[int, int] | None = field(default=None, compare=False)

    @property
    def source(self) -> str:
        return self.src or "/" + self.path

    def describe(self) -> bytes:
        """What the tag hashes for this path: its metadata."""
        return (
            f"{self.path}\0{self.kind}\0{self.mode:o}\0{self.uid}:{self.gid}\0{self.size}\0"
            f"{self.mtime_ns}\0{self.link}\n"
        ).encode()


@dataclass(frozen=True)
class Tree:
    """A host directory taken whole, less `skip`: paths relative to `root` left out with all below them."""

    root: Path
    skip: frozenset[str] = field(default_factory=frozenset)


@dataclass
class WalkReport:
    """What a walk left out, for the build's summary."""

    other_mounts: list[str] = field(default_factory=list)
    caches: list[str] = field(default_factory=list)
    special: list[str] = field(default_factory=list)


def host_file(path: str, st: os.stat_result | None = None) -> HostFile:
    """The `HostFile` for absolute host `path` (not followed if it is a symlink)."""
    st = st or os.lstat(path)
    rel = path.lstrip("/")
    mode, uid, gid, mtime = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns
    if stat.S_ISLNK(st.st_mode):
        return HostFile(rel, "link", mode, uid, gid, mtime_ns=mtime, link=os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return HostFile(rel, "dir", mode, uid, gid, mtime_ns=mtime)
    if stat.S_ISREG(st.st_mode):
        inode = (st.st_dev, st.st_ino) if st.st_nlink > 1 else None
        return HostFile(rel, "file", mode, uid, gid, size=st.st_size, mtime_ns=mtime, inode=inode)
    raise SelectionError(f"{path} is not a file, directory or symlink")


def is_compile_cache(name: str) -> bool:
    return name in COMPILE_CACHE_NAMES or name.startswith(COMPILE_CACHE_PREFIXES)


def walk_tree(tree: Tree, report: WalkReport | None = None) -> Iterator[HostFile]:
    """`tree.root` and everything under it on the same filesystem, less skipped paths, compile caches and
    sockets, FIFOs and devices (which `report` lists). In no particular order: `merge` sorts."""
    report = report if report is not None else WalkReport()
    root = str(tree.root)
    try:
        top = os.lstat(root)
    except FileNotFoundError:
        raise SelectionError(f"{root} is missing (the image takes it whole)") from None
    if not stat.S_ISDIR(top.st_mode):
        raise SelectionError(f"{root} is not a directory (the image takes it whole)")
    yield host_file(root, top)
    pending = [(root, "")]
    while pending:
        d, rel = pending.pop()
        with os.scandir(d) as it:
            for e in it:
                e_rel = f"{rel}/{e.name}" if rel else e.name
                if e_rel in tree.skip:
                    continue
                st = e.stat(follow_symlinks=False)
                if st.st_dev != top.st_dev:
                    report.other_mounts.append(e.path)
                elif is_compile_cache(e.name):
                    report.caches.append(e.path)
                elif stat.S_ISDIR(st.st_mode):
                    yield host_file(e.path, st)
                    pending.append((e.path, e_rel))
                elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    yield host_file(e.path, st)
                else:
                    report.special.append(e.path)


def path_chain(path: str) -> list[HostFile]:
    """Absolute host `path` as the loader finds it: the directories above it and, for every symlink met
    on the way (a merged-/usr `/lib64`, a library's `.so.6` name), the link and what it names, down to
    the file itself."""
    out: list[HostFile] = []
    seen: set[str] = set()
    _chain(path, out, seen, depth=0)
    return out


def _chain(path: str, out: list[HostFile], seen: set[str], depth: int) -> None:
    if depth > 40:
        raise SelectionError(f"too many levels of symbolic links resolving {path}")
    current = "/"
    parts = Path(os.path.normpath(path)).parts[1:]
    for i, part in enumerate(parts):
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            raise SelectionError(f"{path} is missing ({current} does not exist)") from None
        if stat.S_ISLNK(st.st_mode):
            if current not in seen:
                seen.add(current)
                out.append(host_file(current, st))
            target = os.path.join(os.path.dirname(current), os.readlink(current))
            rest = os.path.join(target, *parts[i + 1 :]) if i + 1 < len(parts) else target
            _chain(rest, out, seen, depth + 1)
            return
        if current not in seen:
            seen.add(current)
            out.append(host_file(current, st))


def merge(*groups: Iterable[HostFile]) -> list[HostFile]:
    """One list of the groups' paths, each once (the first group that names a path wins), with every
    directory above each path present, sorted so that a directory's contents follow it."""
    by_path: dict[str, HostFile] = {}
    for group in groups:
        for f in group:
            by_path.setdefault(f.path, f)
    for path in list(by_path):
        parent = path.rpartition("/")[0]
        while parent and parent not in by_path:
            by_path[parent] = _directory(parent)
            parent = parent.rpartition("/")[0]
    return [by_path[p] for p in sorted(by_path, key=_sort_key)]


def _directory(path: str) -> HostFile:
    """The host's directory at `path`, or a plain one where the host has none (a staged file's)."""
    try:
        found = host_file("/" + path)
    except FileNotFoundError:
        return HostFile(path, "dir", mode=0o755, uid=0, gid=0)
    if found.kind != "dir":
        raise SelectionError(
            f"/{path} is a {found.kind}, not a directory, on this host, yet the image has files under it: "
            "name the trees by their real paths"
        )
    return found


def _sort_key(path: str) -> tuple[str, ...]:
    # Component-wise, so a directory's contents follow it directly ("a/b" before "a-c").
    return tuple(path.split("/"))


def total_bytes(files: Iterable[HostFile]) -> int:
    return sum(f.size for f in files)
