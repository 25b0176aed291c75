"""Blocking waits for what another process or thread makes happen: a file appearing, a condition."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], within: float = 30.0, what: str = "condition", every: float = 0.2) -> T:
    """Poll ``cond`` until it returns something truthy, and return that; fail naming ``what``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {within}s waiting for {what}")


def wait_file(path: Path, within: float = 30.0, settle: float = 0.0) -> str:
    """``path``'s text once it exists (after ``settle`` more seconds, for a writer that does not write
    the file whole and rename it); fails if it does not appear within ``within`` seconds."""
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    time.sleep(settle)
    return path.read_text()


async def await_json(path: Path, within: float = 30.0, settle: float = 0.0) -> dict[str, Any]:
    """``wait_file``'s text as a JSON object, waited for without blocking the event loop."""
    return dict(json.loads(await asyncio.to_thread(wait_file, path, within, settle)))


async def cancel_and_settle(task: asyncio.Task[Any], directory: Path, quiet: float = 0.3) -> list[str]:
    """Cancel ``task``, which must still run and must end cancelled, then the names in ``directory``
    once nothing writes there any more: no file appears, goes or changes size over ``quiet`` seconds."""
    assert not task.done(), "finished before the cancel: give it more work"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the task ignored the cancel")

    def listing() -> list[tuple[str, int]]:
        return sorted((e.name, e.stat().st_size) for e in os.scandir(directory))

    left = await asyncio.to_thread(listing)
    await asyncio.sleep(quiet)
    assert await asyncio.to_thread(listing) == left, "still written after the cancel"
    return [name for name, _ in left]
