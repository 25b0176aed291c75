"""The files a process tree holds, as its own mount namespace names them: mapped, open, its working
directories and executables. CRIU opens these again at restore, so a container's writable layer must hold
them before CRIU starts; the layer's other files can follow beside it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

# Watches CRIU brings back by file handle, whatever the path: which layer files they need is unknown.
_UNKNOWN_HOLDERS = ("anon_inode:inotify", "anon_inode:[fanotify]")
_DELETED = " (deleted)"


def mapped_paths(maps: str) -> Iterator[str]:
    """The file paths in /proc/PID/maps text (pseudo entries such as [heap] and deleted files left out;
    a newline in a path, which the kernel writes as \\012, given back)."""
    for line in maps.split("\n"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(_DELETED):
            yield fields[5].replace("\\012", "\n")


def held_paths(pids: Iterable[int], proc: Path = Path("/proc")) -> set[str] | None:
    """Every path `pids` hold; None where one holds a watch (inotify, fanotify), as then any file may be
    needed. A process that ended meanwhile holds nothing."""
    held: set[str] = set()
    for pid in pids:
        base = proc / str(pid)
        with contextlib.suppress(OSError):
            held.update(mapped_paths((base / "maps").read_text(errors="surrogateescape")))
        for link in ("cwd", "exe", "root"):
            with contextlib.suppress(OSError):
                held.add(os.readlink(base / link))
        with contextlib.suppress(OSError):
            for fd in os.listdir(base / "fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(base / "fd" / fd)
                    if target.startswith(_UNKNOWN_HOLDERS):
                        return None
                    held.add(target)
    return {p for p in held if p.startswith("/") and not p.endswith(_DELETED)}
