"""A failed CRIU run's log, kept where the caller's clean-up does not reach.

CRIU writes its log into the operation's work directory: a dump's staging directory, a restore's workload
directory. Those go with the failure, while the error message names the log: so the log of a failed run
is copied into a directory of its own (the last `KEPT_LOG_BYTES`, the newest `KEPT_LOGS` runs) and the
message names that copy.
"""

from __future__ import annotations

import os
import secrets
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["KEPT_LOGS", "KEPT_LOG_BYTES", "keep_log"]

# A -v4 log of a large tree's failed dump runs to tens of MiB; what explains a failure is at its end.
KEPT_LOG_BYTES = 1 << 20
KEPT_LOGS = 32


def keep_log(
    log: Path, directory: Path, op: str, *, max_bytes: int = KEPT_LOG_BYTES, keep: int = KEPT_LOGS
) -> Path:
    """Copy the last `max_bytes` of `log` (from a line's start) into a new file in `directory` and remove
    the oldest kept logs beyond `keep`; the copy's path. Raises OSError when it cannot."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = directory / f"{op}-{stamp}-{secrets.token_hex(3)}.log"
    # O_EXCL and O_NOFOLLOW: the agent runs as root, and a name planted in the directory is not followed.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as dst, log.open("rb") as src:
        size = os.fstat(src.fileno()).st_size
        if size > max_bytes:
            src.seek(size - max_bytes)
            src.readline()  # the rest of a cut line
            left_out = src.tell()
            dst.write(f"[the first {left_out} of {size} bytes of {log} are left out]\n".encode())
        dst.write(src.read(max_bytes))
    _prune(directory, keep)
    return target


def _prune(directory: Path, keep: int) -> None:
    kept = []
    for entry in os.scandir(directory):
        if entry.name.endswith(".log") and entry.is_file(follow_symlinks=False):
            try:
                kept.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name))
            except FileNotFoundError:
                continue  # pruned by a run beside this one
    for _, name in sorted(kept)[: max(0, len(kept) - keep)]:
        (directory / name).unlink(missing_ok=True)
