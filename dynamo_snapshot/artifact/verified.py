"""Files of an artifact this node has already hashed and found intact, so a burst of restores from one
checkpoint hashes its files once, not once per restore.

A file counts as verified while it is the very same file: same device and inode, size, modification and
status-change times (any write, rename over it, chmod or re-link changes one of them, and the kernel sets
the status-change time, which user space cannot set back), and the same expected digests. What the cache
cannot see is a bit flip on disk below the filesystem after the check; entries expire after `ttl_s`, so
such damage is caught by the next check after that, as it would be by the first one.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from cachetools import TTLCache

from dynamo_snapshot.artifact.manifest import FileEntry

__all__ = ["VerifiedFiles"]


@dataclass(frozen=True)
class _Fingerprint:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    digests: tuple[str, ...]


def _fingerprint(path: Path, entry: FileEntry) -> _Fingerprint | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    digests = tuple(entry.chunks) if entry.chunks is not None else (entry.sha256 or "",)
    return _Fingerprint(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digests)


class VerifiedFiles:
    """Thread-safe (verification runs in worker threads); bounded in entries and in age."""

    def __init__(self, ttl_s: float = 3600.0, max_files: int = 65536) -> None:
        self._seen: TTLCache[str, _Fingerprint] = TTLCache(maxsize=max_files, ttl=ttl_s)
        self._lock = threading.Lock()

    def known(self, root: Path, entry: FileEntry) -> bool:
        """Whether this file was verified as `entry` describes it and has not changed since."""
        path = root / entry.path
        now = _fingerprint(path, entry)
        with self._lock:
            return now is not None and self._seen.get(str(path)) == now

    def remember(self, root: Path, entries: list[FileEntry]) -> None:
        """Record files that were just hashed and matched."""
        for entry in entries:
            path = root / entry.path
            fp = _fingerprint(path, entry)
            if fp is not None:
                with self._lock:
                    self._seen[str(path)] = fp
