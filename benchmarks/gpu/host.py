"""Small host helpers the GPU benchmarks share (they run as scripts on the device, beside this file)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any


def drop_caches() -> None:
    """Empty the page cache (root), so the next read of a file comes from the disk."""
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)


async def wait_json(path: Path, within: float) -> dict[str, Any]:
    """The JSON object a worker writes (atomically) at `path`, once it is there."""
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(path.exists):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {within}s")
        await asyncio.sleep(0.01)
    return dict(json.loads(await asyncio.to_thread(path.read_text)))
