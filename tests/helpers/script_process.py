"""A Python script as the subject of a real dump: run in a session of its own (CRIU restores the tree with
its session), and every process group it or its restores lead killed at the end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path


async def start_script(script: str, work: Path) -> asyncio.subprocess.Process:
    """``python -c script work`` in a new session, ``work`` made first."""
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(work), stdin=asyncio.subprocess.DEVNULL, start_new_session=True
    )


def smaps_field(pid: int, address: int, field: str) -> str:
    """The value of ``field`` (``VmFlags``, ``AnonHugePages``, ...) of ``pid``'s mapping that holds
    ``address``, from /proc/PID/smaps."""
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no mapping holds {address:#x} in /proc/{pid}/smaps, or it has no {field}")


def kill_groups(*leaders: int | None) -> None:
    """SIGKILL to the process group of each leader given (None: none was started)."""
    for pid in set(leaders) - {None}:
        assert pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
