"""A container's processes as /proc shows them on the host: a process's children and descendants, killing
what a restore put under a placeholder, and whether a placeholder is an inert one."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

__all__ = ["children", "descendants", "inert_placeholder", "kill_descendants", "restored_child"]

# Programs that do nothing: what the snapshot project's restore-pod contract has a producer run in a
# destination container instead of a standby entrypoint (`exec sleep infinity`).
INERT_PROGRAMS = frozenset({"sleep", "pause"})


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def descendants(pid: int) -> Iterator[int]:
    for child in children(pid):
        yield from descendants(child)
        yield child


def kill_descendants(pid: int) -> None:
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def restored_child(placeholder: int) -> int | None:
    """The restored worker under a placeholder: its first child (the placeholder starts none)."""
    found = children(placeholder)
    return found[0] if found else None


def inert_placeholder(pid: int) -> bool:
    """Whether ``pid`` (a container's first process) is an inert placeholder: a program that does nothing
    (sleep, pause), alone (no child)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return False
    return bool(argv0) and Path(argv0).name in INERT_PROGRAMS and not children(pid)
