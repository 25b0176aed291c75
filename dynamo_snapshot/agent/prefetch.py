"""Node files a restored worker will touch, read ahead while its artifact is verified.

A restored process comes back with its anonymous memory from the CRIU image, but its code and
read-only data stay in the node's files (python, libtorch, libcuda, the CUDA libraries): CRIU re-maps
them, copies the dirty private pages over them (which reads the file page first), and the worker's
first steps after the resume fault the rest in, one synchronous read at a time. On the H200 a restore
read ~0.8 GB beyond its artifact that way, late (after the verification) and slowly.

At checkpoint time the agent records which pages of which mapped files the frozen tree has in its
page tables (``/proc/PID/pagemap``, present bit), as byte ranges per file with the file's size and
mtime (``prefetch.json`` in the artifact). At restore time those ranges are handed to the kernel
with ``POSIX_FADV_WILLNEED`` as the very first step, so the reads run in parallel, at the disk's queue
depth, beside the artifact's verification instead of after it. It is only a hint: a file that is
missing or differs on this node (size or mtime) is skipped, and a failed prefetch never fails a
restore.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dynamo_snapshot.fileio.beneath import open_regular_beneath
from dynamo_snapshot.workload.zero_pages import read_maps

log = logging.getLogger(__name__)

PREFETCH_FILE = "prefetch.json"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Runs of present pages closer than this are read as one range: a few extra pages cost less than
# another request, and the plan stays short.
MERGE_GAP = 128 << 10
# A plan reads at most this much: a worker that maps a huge file (a dataset, a model it reads through
# mmap) must not turn every restore into reading all of it. Largest files are left out first.
MAX_PLAN_BYTES = 8 << 30
# Mappings that are not files on the node's disk.
_NOT_FILES = ("/dev/", "/proc/", "/sys/", "/memfd:", "/SYSV", "/dmabuf")
_PRESENT_RUN = re.compile(rb"1+")
# pagemap entries are 64-bit little-endian; bit 63 (the top bit of the 8th byte) is "present".
_PRESENT_BYTE = bytes(ord("1") if b & 0x80 else ord("0") for b in range(256))


class PrefetchFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="absolute path on the node (host view)")
    size: int = Field(ge=0)
    mtimeNs: int
    ranges: list[tuple[int, int]] = Field(description="[offset, length] byte ranges, sorted, disjoint")


class PrefetchPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    files: list[PrefetchFile] = Field(default_factory=list)
    # Mapped files the plan leaves out because the node's path is not the worker's (a container
    # image's own root filesystem): counted so that an empty plan explains itself.
    unresolved: int = 0
    # Bytes of mapped files left out to keep the plan under MAX_PLAN_BYTES.
    omittedBytes: int = 0

    @property
    def bytes(self) -> int:
        return sum(map(_plan_bytes, self.files))


@dataclass(frozen=True)
class PrefetchStats:
    files: int
    bytes: int
    skipped: int
    seconds: float


@dataclass(frozen=True)
class _Vma:
    start: int
    end: int
    offset: int
    path: str


def _file_vmas(pid: int) -> list[_Vma]:
    return [
        _Vma(m.start, m.end, m.offset, m.name)
        for m in read_maps(pid)
        if m.name.startswith("/") and not m.name.endswith(" (deleted)") and not m.name.startswith(_NOT_FILES)
    ]


def _present_runs(pagemap: int, vma: _Vma) -> Iterable[tuple[int, int]]:
    """(first page, page count) of every run of present pages in ``vma``, relative to its start."""
    pages = (vma.end - vma.start) // PAGE
    data = os.pread(pagemap, pages * 8, vma.start // PAGE * 8)
    flags = data[7::8].translate(_PRESENT_BYTE)
    for m in _PRESENT_RUN.finditer(flags):
        yield m.start(), m.end() - m.start()


def _host_path(pid: int, path: str) -> str | None:
    """``path`` as the node sees it, when it is the very file the worker maps; else None. The worker's
    side is resolved beneath its root without following a link (a link it swapped in after the mapping
    would otherwise lead the agent to the node's files); the runtime's mounts in its root are crossed."""
    try:
        # The magic link /proc/PID/root is followed on purpose: its target is the worker's root.
        root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            handle = open_regular_beneath(
                root, path.lstrip("/"), what="mapped file", single_link=False, cross_mounts=True
            )
        finally:
            os.close(root)
        try:
            inside = os.fstat(handle)
        finally:
            os.close(handle)
        outside = os.stat(path)
    except OSError:
        return None
    return path if (inside.st_dev, inside.st_ino) == (outside.st_dev, outside.st_ino) else None


def _merge(ranges: list[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for off, length in sorted(ranges):
        if merged and off <= merged[-1][0] + merged[-1][1] + gap:
            start, prev = merged[-1]
            merged[-1] = (start, max(prev, off + length - start))
        else:
            merged.append((off, length))
    return merged


def plan_for_tree(pids: Iterable[int], *, max_bytes: int = MAX_PLAN_BYTES) -> PrefetchPlan:
    """The file pages the processes ``pids`` have mapped (root only: pagemap of another process), at
    most ``max_bytes`` of them (the largest files are dropped first)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    unresolved: set[str] = set()
    for pid in pids:
        try:
            vmas = _file_vmas(pid)
            pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
        except OSError as e:
            log.warning("no prefetch plan for a process", extra={"pid": pid, "error": str(e)})
            continue
        try:
            for vma in vmas:
                host = _host_path(pid, vma.path)
                if host is None:
                    unresolved.add(vma.path)
                    continue
                with contextlib.suppress(OSError):  # a mapping that went away meanwhile
                    ranges.setdefault(host, []).extend(
                        (vma.offset + first * PAGE, count * PAGE)
                        for first, count in _present_runs(pagemap, vma)
                    )
        finally:
            os.close(pagemap)
    files = []
    for path, found in sorted(ranges.items()):
        if not found:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        clipped = [(off, min(length, st.st_size - off)) for off, length in _merge(found) if off < st.st_size]
        files.append(PrefetchFile(path=path, size=st.st_size, mtimeNs=st.st_mtime_ns, ranges=clipped))
    omitted = 0
    by_size = sorted(files, key=_plan_bytes)
    while by_size and sum(map(_plan_bytes, by_size)) > max_bytes:
        omitted += _plan_bytes(by_size.pop())
    kept = {f.path for f in by_size}
    return PrefetchPlan(
        files=[f for f in files if f.path in kept], unresolved=len(unresolved), omittedBytes=omitted
    )


def _plan_bytes(entry: PrefetchFile) -> int:
    return sum(length for _, length in entry.ranges)


def write_plan(plan: PrefetchPlan, directory: Path) -> Path:
    path = directory / PREFETCH_FILE
    path.write_text(plan.model_dump_json())
    return path


def read_plan(path: Path) -> PrefetchPlan:
    """The plan at ``path``; ValueError when it is not one."""
    return PrefetchPlan.model_validate_json(path.read_bytes())


def _advise(entry: PrefetchFile) -> int:
    """Ask the kernel to read ``entry``'s ranges; bytes asked for, or -1 when the file is not the one
    recorded (missing, other size or mtime)."""
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        st = os.fstat(fd)
        if st.st_size != entry.size or st.st_mtime_ns != entry.mtimeNs:
            return -1
        for off, length in entry.ranges:
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
        return sum(length for _, length in entry.ranges)
    finally:
        os.close(fd)


def prefetch(plan: PrefetchPlan, *, parallel: int = 8) -> PrefetchStats:
    """Start reading the plan's ranges into the page cache (the kernel finishes them asynchronously)."""
    started = time.monotonic()
    # Largest files first, so that one big library does not start last.
    entries = sorted(plan.files, key=_plan_bytes, reverse=True)
    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="prefetch") as pool:
        asked = list(pool.map(_advise, entries))
    return PrefetchStats(
        files=sum(1 for a in asked if a >= 0),
        bytes=sum(a for a in asked if a > 0),
        skipped=sum(1 for a in asked if a < 0),
        seconds=time.monotonic() - started,
    )


def read_whole(paths: Iterable[Path]) -> PrefetchStats:
    """Read small files (the tools a restore runs) into the page cache now, before the bulk reads
    start: behind a saturated disk, a program's start-up reads each wait for the queue."""
    started = time.monotonic()
    done = total = skipped = 0
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(1 << 20):
                    total += len(chunk)
            done += 1
        except OSError:
            skipped += 1
    return PrefetchStats(files=done, bytes=total, skipped=skipped, seconds=time.monotonic() - started)
