"""A Python script as the subject of a real dump: run in a session of its own (CRIU restores the tree with
its session), and every process group it or its restores lead killed at the end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path


async def start_script(script: str, work: Path) -> asyncio.subprocess.Process:
    """``python -c script work`` in a new session, ``work`` made first."""
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(work), stdin=asyncio.subprocess.DEVNULL, start_new_session=True
    )


def kill_groups(*leaders: int | None) -> None:
    """SIGKILL to the process group of each leader given (None: none was started)."""
    for pid in set(leaders) - {None}:
        assert pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
