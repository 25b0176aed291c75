"""Small file helpers of the checkpoint and restore procedures: sentinel files written whole, and staging
directories of agent processes that died mid-restore."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dynamo_snapshot.agent.runtime.base import pid_running

__all__ = ["remove_abandoned", "write_atomic"]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def remove_abandoned(base: Path) -> None:
    """Staging images directories under ``base`` whose agent process is gone (killed mid-restore)."""
    for entry in base.iterdir():
        owner = entry.name.split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not pid_running(int(owner)):
            shutil.rmtree(entry, ignore_errors=True)
