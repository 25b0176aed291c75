"""Files the agent exchanges with a worker through its control directory: sentinels it writes
(restore-complete, snapshot-complete, weights-verified, restore-context.json, release-zero-pages.json),
JSON seen whole or not at all, and small JSON files the worker writes for it.

The directory is the tenant's to write: a link or a FIFO planted under a name the agent is about to
write or read must not turn the privileged agent's write into one elsewhere on the node, or its read
into a hang. Writes go to a new, randomly named file created exclusively without following links, then
renamed over the name (``fileio.write_atomic``: a rename replaces a planted link, never its target);
reads open without following links or blocking, and take a regular file only.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from dynamo_snapshot.fileio import write_atomic

__all__ = ["read_worker_json", "write_sentinel"]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def write_sentinel(path: Path, doc: dict[str, Any]) -> None:
    # Not durable: the control directory does not outlive its pod, and the worker polls for the name.
    write_atomic(path, json.dumps(doc, sort_keys=True).encode(), mode=0o644, durable=False)


def read_worker_json(path: Path, limit: int) -> Any:
    """The JSON of a file the worker wrote, read up to ``limit`` bytes. OSError when it is missing, a
    link or not a regular file; ValueError when it is longer than ``limit`` or not JSON."""
    fd = os.open(path, _READ)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is longer than {limit} bytes")
    return json.loads(data)
