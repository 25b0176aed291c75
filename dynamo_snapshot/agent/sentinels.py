"""Files the agent exchanges with a worker through its control directory: sentinels it writes
(restore-complete, restore-failed, snapshot-complete, weights-verified, restore-context.json,
release-zero-pages.json), seen whole or not at all, and small JSON files the worker writes for it (its
ready file among them).

The directory is the tenant's to write: a link, a FIFO, a device node or a hard link planted under a
name the agent is about to write or read must not turn the privileged agent's write into one elsewhere
on the node, or its read into a hang, a read of another file or a device's side effect. Writes go to a
new, randomly named file created exclusively without following links, then renamed over the name
(``fileio.write_atomic``: a rename replaces a planted link, never its target); reads resolve the name
beneath the directory's descriptor and read only a regular file with one name (``fileio.beneath``);
a name is present only as what it is, never as what a link points to.
"""

from __future__ import annotations

import contextlib
import json
import stat
from pathlib import Path
from typing import Any

from dynamo_snapshot.api import protocol
from dynamo_snapshot.fileio import write_atomic
from dynamo_snapshot.fileio.beneath import lstat_beneath, opened_dir, read_json_beneath

__all__ = [
    "present",
    "ready_json",
    "ready_lists",
    "regular_present",
    "write_sentinel",
    "write_sentinel_bytes",
]

# Far above any ready file a worker writes (this SDK's is a few hundred bytes).
_READY_MAX = 1 << 20


def write_sentinel(path: Path, doc: dict[str, Any]) -> None:
    write_sentinel_bytes(path, json.dumps(doc, sort_keys=True).encode())


def write_sentinel_bytes(path: Path, data: bytes) -> None:
    # Not durable: the control directory does not outlive its pod, and the worker polls for the name.
    write_atomic(path, data, mode=0o644, durable=False)


def ready_json(control_dir: Path) -> Any:
    """The JSON of the first ready file in ``control_dir`` that holds JSON (this SDK's; Dynamo's is the
    text "ready"), read as any file the worker wrote; None where none does."""
    for name in protocol.FILES_READY:
        with contextlib.suppress(OSError, ValueError):
            return read_json_beneath(control_dir / name, _READY_MAX, what="worker file")
    return None


def ready_lists(doc: Any, feature: str) -> bool:
    """Whether a ready file's JSON (``ready_json``) lists ``feature`` among its features."""
    features = doc.get(protocol.READY_FEATURES) if isinstance(doc, dict) else None
    return isinstance(features, list) and feature in features


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
