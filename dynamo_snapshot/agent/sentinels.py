"""Files the agent exchanges with a worker through its control directory: sentinels it writes
(restore-complete, snapshot-complete, weights-verified, restore-context.json, release-zero-pages.json),
JSON seen whole or not at all, and small JSON files the worker writes for it.

The directory is the tenant's to write: a link, a FIFO, a device node or a hard link planted under a
name the agent is about to write or read must not turn the privileged agent's write into one elsewhere
on the node, or its read into a hang, a read of another file or a device's side effect. Writes go to a
new, randomly named file created exclusively without following links, then renamed over the name
(``fileio.write_atomic``: a rename replaces a planted link, never its target); reads resolve the name
beneath the directory's descriptor and read only a regular file with one name (``fileio.beneath``);
a name is present only as what it is, never as what a link points to.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from dynamo_snapshot.fileio import write_atomic
from dynamo_snapshot.fileio.beneath import lstat_beneath, open_regular_beneath, opened_dir, reopen

__all__ = ["present", "read_worker_json", "regular_present", "write_sentinel", "write_sentinel_bytes"]


def write_sentinel(path: Path, doc: dict[str, Any]) -> None:
    write_sentinel_bytes(path, json.dumps(doc, sort_keys=True).encode())


def write_sentinel_bytes(path: Path, data: bytes) -> None:
    # Not durable: the control directory does not outlive its pod, and the worker polls for the name.
    write_atomic(path, data, mode=0o644, durable=False)


def read_worker_json(path: Path, limit: int) -> Any:
    """The JSON of the file ``path`` (a name in a control directory) the worker wrote, read up to
    ``limit`` bytes. OSError when it is missing, a link or not a regular file with one name; ValueError
    when it is longer than ``limit`` or not JSON."""
    with opened_dir(path.parent) as directory:
        handle = open_regular_beneath(directory, path.name, what="worker file")
        try:
            fd = reopen(handle)
        finally:
            os.close(handle)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is longer than {limit} bytes")
    return json.loads(data)


def present(path: Path) -> bool:
    """Whether the control directory has an entry named ``path.name`` (a link counts as itself)."""
    try:
        with opened_dir(path.parent) as directory:
            return lstat_beneath(directory, path.name) is not None
    except OSError:
        return False


def regular_present(path: Path) -> bool:
    """Whether ``path.name`` is a regular file in its control directory (a link to one is not)."""
    try:
        with opened_dir(path.parent) as directory:
            st = lstat_beneath(directory, path.name)
    except OSError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode)
