"""Small host helpers the GPU benchmarks share (they run as scripts on the device, beside this file)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import re
import resource
import subprocess
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from dynamo_snapshot.cuda.processes import children, process_tree


def emit(result: Any, out: Path | None) -> None:
    """A benchmark's result as JSON: printed, and written to `out` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


def drop_caches() -> None:
    """Empty the page cache (root), so the next read of a file comes from the disk."""
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)


def cpu_seconds(*, own: bool = True) -> float:
    """User + system CPU seconds so far of the reaped children (CRIU, cuda-checkpoint) and, with `own`,
    of this process too (an agent running in it, with the benchmark's own samplers)."""
    total = 0.0
    for who in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF) if own else (resource.RUSAGE_CHILDREN,):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its reaped children so far (0 when it is gone): what
    a child of this process adds to cpu_seconds() once it is reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def helpers_cpu_seconds() -> float:
    """CPU seconds of this process's live children: helper processes that are never reaped (this agent
    hashes in a pool of them) and a source worker not dumped yet (reaped once dumped, it moves into
    cpu_seconds(), so a sum of both taken before and after a checkpoint counts it once)."""
    return sum(process_cpu_seconds(p) for p in children(os.getpid()))


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of the process tree under `root`. A tree CRIU has just restored starts counting from
    zero, so this is the restore's own work inside it: the restorer reading the pages, the CUDA restore's
    driver thread."""
    try:
        return sum(process_cpu_seconds(p) for p in process_tree(root))
    except ProcessLookupError:
        return 0.0


async def wait_gone(pid: int, within: float = 15) -> None:
    """Until `pid` is free again, reaping it where it is this process's child (a zombie keeps its pid):
    CRIU restores a tree with its original pids, so the next restore of a checkpoint needs that very pid."""
    deadline = time.monotonic() + within
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # noqa: ASYNC240 - procfs
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
        await asyncio.sleep(0.05)


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@contextlib.contextmanager
def thp_mode(mode: str | None) -> Any:
    """The host's transparent huge page mode set to ``mode`` (always, madvise, never) inside the ``with``,
    then set back; ``None`` leaves it alone. A restore faults its memory in as the mode says: CRIU reads
    the pages into anonymous memory that is only advised for huge pages after the read."""
    if mode is None:
        yield
        return
    before = re.search(r"\[(\w+)\]", THP_ENABLED.read_text())
    THP_ENABLED.write_text(mode)
    try:
        yield
    finally:
        if before is not None:
            THP_ENABLED.write_text(before.group(1))


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


def _disk_inflight_reads() -> int:
    total = 0
    for inflight in Path("/sys/block").glob("*/inflight"):
        if _DISK.match(inflight.parent.name):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(inflight.read_text().split()[0])
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
        self.samples: list[tuple[float, int, int, int]] = []

    def _poll(self) -> bool:
        self.samples.append((time.time(), _disk_read_bytes(), _major_faults(), _disk_inflight_reads()))
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
        """[seconds since `since`, MB read so far, major faults so far, disk reads in flight], every
        sample: the last says how deep the queue a small synchronous read waits behind is."""
        if not self.samples:
            return []
        _, b0, f0, _ = self.samples[0]
        return [[round(t - since, 3), round((b - b0) / 1e6, 1), f - f0, q] for t, b, f, q in self.samples]


def page_stats(path: Path, page: int = 4096, sample_every: int = 8) -> dict[str, float]:
    """How much of a CRIU pages image is all-zero pages (what dropping them saves), how its 1 MiB blocks
    split into all-zero, zero-free and mixed ones (the zero-page rewrite looks at each page of a mixed
    block only), and how well the rest compresses (zlib level 1 over every `sample_every`-th 1 MiB of
    non-zero pages)."""
    zero_page = bytes(page)
    total = zero = 0
    blocks = {"zero": 0, "none": 0, "mixed": 0}
    raw = packed = 0
    with path.open("rb") as f:
        for n, block in enumerate(iter(lambda: f.read(1 << 20), b"")):
            nonzero = bytearray()
            zeros_here = 0
            for i in range(0, len(block), page):
                part = block[i : i + page]
                total += 1
                if part == zero_page[: len(part)]:
                    zeros_here += 1
                else:
                    nonzero += part
            zero += zeros_here
            pages_here = -(-len(block) // page)
            blocks["zero" if zeros_here == pages_here else "none" if not zeros_here else "mixed"] += 1
            if n % sample_every == 0 and nonzero:
                raw += len(nonzero)
                packed += len(zlib.compress(nonzero, 1))
    return {
        "zero_fraction": round(zero / total, 4) if total else 0.0,
        "blocks_all_zero": blocks["zero"],
        "blocks_zero_free": blocks["none"],
        "blocks_mixed": blocks["mixed"],
        "nonzero_zlib1_ratio": round(raw / packed, 3) if packed else 0.0,
    }


_LOG_LINE = re.compile(r"^\((\d+\.\d+)\)\s?(.*)$")


def _stamped(log: Path) -> list[tuple[float, str]]:
    """CRIU's log lines with their timestamps (seconds since CRIU started); none where it is unreadable."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [(float(m.group(1)), m.group(2)) for line in lines if (m := _LOG_LINE.match(line))]


def log_span(log: Path) -> float | None:
    """Seconds from CRIU's first logged line to its last; None for a log without any."""
    stamped = _stamped(log)
    return round(stamped[-1][0] - stamped[0][0], 3) if stamped else None


def log_gaps(log: Path, top: int = 8) -> list[list[Any]]:
    """The longest waits inside CRIU's own log: [seconds before the line, the line], longest first."""
    stamped = _stamped(log)
    gaps = [[round(b[0] - a[0], 4), b[1][:160]] for a, b in itertools.pairwise(stamped)]
    return sorted(gaps, key=lambda g: -g[0])[:top]


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


class LoopLag:
    """How late the event loop wakes a 5 ms sleep while in the `async with`: a starved loop (the GIL,
    a blocking call) delays every phase boundary the agent measures, CRIU's end among them."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.worst = 0.0
        self.total_late = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.period)
            late = loop.time() - before - self.period
            self.worst = max(self.worst, late)
            self.total_late += max(0.0, late)

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def to_dict(self) -> dict[str, float]:
        return {"worst_s": round(self.worst, 4), "total_late_s": round(self.total_late, 3)}


def host_facts() -> dict[str, str]:
    """What changes how fast a restore goes: the kernel, transparent huge pages, CPUs (and whether
    SHA-256 has instructions of its own), one core's SHA-256 speed, the disk queues."""
    facts = {"kernel": os.uname().release, "cpus": str(os.cpu_count())}
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        facts["cpu_model"] = model.group(1) if model else "?"
        flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
        facts["sha_ni"] = str(bool(flags and " sha_ni" in f" {flags.group(1)} "))
    block = bytes(64 << 20)
    started = time.monotonic()
    hashlib.sha256(block).digest()
    facts["sha256_gbps_one_core"] = f"{len(block) / (time.monotonic() - started) / 1e9:.2f}"
    for name in ("enabled", "defrag"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / name
        facts[f"thp_{name}"] = p.read_text().strip() if p.exists() else "absent"
    # How the disk orders a restore's small synchronous reads against the bulk verification reads.
    for queue in sorted(Path("/sys/block").glob("*/queue")):
        if not queue.parent.name.startswith(("loop", "ram", "zram")):
            for knob in ("scheduler", "nr_requests", "read_ahead_kb", "max_sectors_kb", "rotational"):
                with contextlib.suppress(OSError):
                    facts[f"{queue.parent.name}_{knob}"] = (queue / knob).read_text().strip()
    with contextlib.suppress(OSError):
        facts["mounts"] = " | ".join(
            line for line in Path("/proc/mounts").read_text().splitlines() if line.startswith("/dev/")
        )
    return facts


def http(port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, Any]:
    """A JSON call to the worker on 127.0.0.1:`port` (of the calling thread's network namespace)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method="POST" if data else "GET"
    )
    req.add_header("Content-Type", "application/json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
