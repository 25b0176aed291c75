"""Small host helpers the GPU benchmarks share (they run as scripts on the device, beside this file)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self


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


# Whole disks only (a partition's reads are counted in its disk's too).
_DISK = re.compile(r"^(nvme\d+n\d+|[sv]d[a-z]+|xvd[a-z]+)$")


def _disk_read_bytes() -> int:
    total = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if len(f) > 5 and _DISK.match(f[2]):
            total += int(f[5]) * 512  # sectors read
    return total


def _major_faults() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("pgmajfault "):
            return int(line.split()[1])
    return 0


class _Poller:
    """A daemon thread that calls `_poll()` every `period` seconds while in the `with`, until it
    returns True."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _poll(self) -> bool:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            if self._poll():
                return

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()


class IoSampler(_Poller):
    """Disk bytes read and major page faults, machine-wide, every `period` seconds while in the `with`:
    which phase of a restore reads the disk, and how much beyond the artifact it reads."""

    def __init__(self, period: float = 0.05) -> None:
        super().__init__(period)
        self.samples: list[tuple[float, int, int]] = []

    def _poll(self) -> bool:
        self.samples.append((time.time(), _disk_read_bytes(), _major_faults()))
        return False

    def __enter__(self) -> Self:
        self._poll()
        return super().__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        self._poll()

    def timeline(self, since: float) -> list[list[float]]:
        """[seconds since `since`, MB read so far, major faults so far], every sample."""
        if not self.samples:
            return []
        _, b0, f0 = self.samples[0]
        return [[round(t - since, 3), round((b - b0) / 1e6, 1), f - f0] for t, b, f in self.samples]


def zero_page_fraction(path: Path, page: int = 4096) -> float:
    """How much of a file is all-zero pages: what punching holes into a CRIU pages image would save."""
    zero_page = bytes(page)
    total = zero = 0
    with path.open("rb") as f:
        while block := f.read(64 << 20):
            for i in range(0, len(block), page):
                part = block[i : i + page]
                total += 1
                zero += part == zero_page[: len(part)]
    return zero / total if total else 0.0


class FileWatch(_Poller):
    """When a file first appears (polled every `period` s) and when it was last written: for CRIU's
    log, when CRIU had started up and when it was done, against the agent's own phase times."""

    def __init__(self, path: Path, period: float = 0.005) -> None:
        super().__init__(period)
        self.path = path
        self.first_seen: float | None = None

    def _poll(self) -> bool:
        if self.path.exists():
            self.first_seen = time.time()
        return self.first_seen is not None

    def last_written(self) -> float | None:
        try:
            return self.path.stat().st_mtime_ns / 1e9
        except OSError:
            return None


def criu_log_times(watch: FileWatch, t0: float, phases: dict[str, float]) -> dict[str, float | None]:
    """Where the agent's CRIU phase went: until CRIU opened its log (exec, loading, options), CRIU's
    logged work, and after its last log line (exit, pidfile, the agent noticing). Seconds; the phase
    start is taken as t0 + the verify phase."""
    start = t0 + phases.get("verify", 0.0)
    end = start + phases.get("criu_restore", 0.0)
    opened, last = watch.first_seen, watch.last_written()
    return {
        "before_log_s": round(opened - start, 3) if opened else None,
        "logged_s": round(last - opened, 3) if opened and last else None,
        "after_log_s": round(end - last, 3) if last else None,
    }
