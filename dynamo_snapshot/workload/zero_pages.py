"""Giving the kernel back the all-zero pages of the host copy the CUDA checkpoint makes of GPU memory.

Why: the driver's checkpoint copies every byte of the process's GPU memory into new host memory, and a
CUDA context's own reserves are mostly zeros (on the H200 a bare torch context held ~0.65 GB of zero
pages after the copy, the reference worker ~1 GB). CRIU dumps every present page, zeros included, and a
restore reads them all back. A page given back with MADV_DONTNEED is no longer present, so CRIU neither
writes nor reads it; in private anonymous memory it reads as zero again, exactly what it held.

Only the process itself may do that (process_madvise refuses MADV_DONTNEED for another process), so the
node agent asks: after the checkpoint call it names the memory ranges the driver mapped during it, and
this process scans them and drops their zero pages before CRIU dumps it. Nothing else in the process
writes to that memory while the CUDA state is checkpointed, so a page seen zero stays zero until it is
dropped. A range that is not wholly inside one of this process's own private anonymous writable
mappings is refused, not scanned: a wrong address would otherwise crash the process.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_snapshot.api.protocol import FILE_ZERO_PAGES_RELEASED, FILE_ZERO_PAGES_REQUEST
from dynamo_snapshot.fileio import write_atomic

__all__ = [
    "Mapping",
    "ReleaseStats",
    "ZeroPageServer",
    "answer_request",
    "private_anonymous",
    "read_maps",
    "release_zero_pages",
]

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_CHUNK = 256 * PAGE
_MADV_DONTNEED = 4
_WORDS_PER_PAGE = PAGE // 8
# Words of a page looked at before the page is compared whole: its first and last and six between.
_SAMPLED_WORDS = tuple(i * (_WORDS_PER_PAGE - 1) // 7 for i in range(8))
# mincore sets only the low bit of a page's byte; the others are reserved.
_LOW_BIT = bytes(b & 1 for b in range(256))
_ZERO_BYTES = re.compile(rb"\x00{8,}")
# A CUDA checkpoint maps its host copy in one or a few mappings; a request naming more is not the agent's.
_MAX_RANGES = 4096


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    name: str

    @property
    def private_anonymous_writable(self) -> bool:
        # Named anonymous memory ([heap], [anon:...]) counts; files, [stack] and special mappings do not.
        anonymous = self.inode == 0 and not self.name.startswith("/") and self.name not in _SPECIAL
        return self.perms.startswith("rw") and self.perms[3] == "p" and anonymous


_SPECIAL = frozenset({"[stack]", "[vvar]", "[vdso]", "[vsyscall]", "[vvar_vclock]", "[uprobes]"})


def _parse(line: str) -> Mapping | None:
    fields = line.split(maxsplit=5)
    if len(fields) < 5 or "-" not in fields[0]:
        return None
    lo, _, hi = fields[0].partition("-")
    try:
        name = fields[5].strip() if len(fields) > 5 else ""
        return Mapping(int(lo, 16), int(hi, 16), fields[1], int(fields[2], 16), int(fields[4]), name)
    except ValueError:
        return None


def read_maps(pid: int | str = "self", proc: Path = Path("/proc")) -> list[Mapping]:
    """The mappings of process ``pid``; unparsable lines are skipped."""
    text = (proc / str(pid) / "maps").read_text()
    return [m for m in map(_parse, text.splitlines()) if m is not None]


def private_anonymous(maps: Iterable[Mapping]) -> list[tuple[int, int]]:
    return [(m.start, m.end) for m in maps if m.private_anonymous_writable]


@dataclass
class ReleaseStats:
    scanned_bytes: int = 0
    released_bytes: int = 0
    refused: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    runs: int = 0
    madvise_seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "scannedBytes": self.scanned_bytes,
            "releasedBytes": self.released_bytes,
            "refused": [[lo, hi] for lo, hi in self.refused],
            "seconds": round(self.seconds, 4),
            "runs": self.runs,
            "madviseSeconds": round(self.madvise_seconds, 4),
        }


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.memcmp = libc.memcmp
        self.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.memcmp.restype = ctypes.c_int
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.madvise.restype = ctypes.c_int
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self.mincore.restype = ctypes.c_int
        self.zero = ctypes.create_string_buffer(_CHUNK)
        self.zero_addr = ctypes.addressof(self.zero)


def _candidates(addr: int, size: int) -> Iterator[tuple[int, int]]:
    """Runs [first, end) of the pages of a chunk whose sampled words are all zero, read in place.

    A few words of every page are sampled at once (strided views, no copy): a page with one of them not
    zero is not a zero page. The host copy holds much data rich in zero bytes, where searching a copy of
    the chunk for a zero page is slow; and much all-zero memory around a few pages of data, where looking
    at every page on its own is."""
    words = memoryview((ctypes.c_char * size).from_address(addr)).cast("B").cast("Q")
    sampled = 0
    for k in _SAMPLED_WORDS:
        sampled |= int.from_bytes(words[k::_WORDS_PER_PAGE].tobytes(), "little")
    # A page is a candidate where its 8 bytes of the OR of the samples are all zero.
    for match in _ZERO_BYTES.finditer(sampled.to_bytes(size // PAGE * 8, "little")):
        first, end = -(-match.start() // 8), match.end() // 8
        if first < end:
            yield first, end


def _zero_pages_in(libc: _Libc, addr: int, size: int) -> Iterator[tuple[int, int]]:
    """Runs [first, end) of the all-zero pages of a chunk that is not all zero: each run of candidates
    compared whole at once, and page by page only where that finds data."""
    for first, end in _candidates(addr, size):
        if libc.memcmp(addr + first * PAGE, libc.zero_addr, (end - first) * PAGE) == 0:
            yield first, end
            continue
        for i in range(first, end):
            if libc.memcmp(addr + i * PAGE, libc.zero_addr, PAGE) == 0:
                yield i, i + 1


def _zero_runs(libc: _Libc, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """Runs [start, end) of all-zero pages in [lo, hi): a chunk compared in place at once, and the pages
    of a chunk that is not all zero looked at more closely; a run goes on across chunks."""
    run = None
    addr = lo
    while addr < hi:
        size = min(_CHUNK, hi - addr)
        if libc.memcmp(addr, libc.zero_addr, size) == 0:
            run = run if run is not None else addr
            addr += size
            continue
        expected = addr  # where the run goes on, if it does
        for first, end in _zero_pages_in(libc, addr, size):
            if run is not None and addr + first * PAGE != expected:
                yield run, expected
                run = None
            run = run if run is not None else addr + first * PAGE
            expected = addr + end * PAGE
        if run is not None and expected != addr + size:
            yield run, expected
            run = None
        addr += size
    if run is not None:
        yield run, hi


def _residency(libc: _Libc, lo: int, hi: int) -> bytes:
    """A byte per page of [lo, hi), 1 where the page is in memory (a page never touched was never there
    to give back), else 0; all 0 where the kernel will not say."""
    vec = ctypes.create_string_buffer((hi - lo) // PAGE)
    return vec.raw.translate(_LOW_BIT) if libc.mincore(lo, hi - lo, vec) == 0 else bytes(len(vec))


def _inside(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(r_lo <= lo and hi <= r_hi for r_lo, r_hi in ranges)


def release_zero_pages(ranges: Iterable[tuple[int, int]], maps: list[Mapping] | None = None) -> ReleaseStats:
    """Drop the all-zero pages of ``ranges`` of this process's memory (MADV_DONTNEED).

    A range that is not page-aligned or not wholly inside one private anonymous writable mapping of
    ``maps`` (this process's own, read now, by default) is refused and left alone.
    """
    started = time.monotonic()
    allowed = private_anonymous(maps if maps is not None else read_maps())
    libc = _Libc()
    stats = ReleaseStats()
    for lo, hi in ranges:
        if lo % PAGE or hi % PAGE or hi <= lo or not _inside(allowed, lo, hi):
            stats.refused.append((lo, hi))
            continue
        stats.scanned_bytes += hi - lo
        # Before the scan: reading a page never touched maps the kernel's zero page, which counts as present.
        present = _residency(libc, lo, hi)
        for run_lo, run_hi in _zero_runs(libc, lo, hi):
            advised = time.monotonic()
            done = libc.madvise(run_lo, run_hi - run_lo, _MADV_DONTNEED) == 0
            stats.madvise_seconds += time.monotonic() - advised
            stats.runs += 1
            if done:
                first, last = (run_lo - lo) // PAGE, (run_hi - lo) // PAGE
                stats.released_bytes += present.count(1, first, last) * PAGE
    stats.seconds = time.monotonic() - started
    return stats


def _ranges(value: object) -> list[tuple[int, int]]:
    if not isinstance(value, list) or len(value) > _MAX_RANGES:
        raise ValueError(f"ranges must be a list of at most {_MAX_RANGES} [start, end] pairs")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int and v >= 0 for v in item)):
            raise ValueError(f"not a [start, end] pair of addresses: {item!r}")
        out.append((item[0], item[1]))
    return out


def answer_request(request: bytes, pid: int | None = None) -> dict[str, object] | None:
    """This process's answer to the agent's request (``protocol.FILE_ZERO_PAGES_REQUEST``), or None when
    the request is for another process of the tree. A request that does not parse is answered with its
    error, so the agent need not wait out its timeout."""
    pid = os.getpid() if pid is None else pid
    try:
        doc = json.loads(request)
        if not isinstance(doc, dict) or type(doc.get("pid")) is not int:
            raise ValueError('the request is not a JSON object with an integer "pid"')
        if doc["pid"] != pid:
            return None
        ranges = _ranges(doc.get("ranges"))
    except ValueError as e:
        return {"pid": pid, "error": str(e)}
    return {"pid": pid, **release_zero_pages(ranges).to_dict()}


class ZeroPageServer:
    """A daemon thread that answers the agent's one request, from the moment the worker says it is ready
    until it is dumped and resumed (``finished()`` true) or has answered."""

    def __init__(self, control_dir: Path, finished: Callable[[], bool], poll_interval: float = 0.005) -> None:
        self.control_dir = control_dir
        self.finished = finished
        self.poll_interval = poll_interval
        self.thread = threading.Thread(target=self._run, name="zero-page-server", daemon=True)
        self._stopped = threading.Event()  # its wait is also the poll's sleep

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """No request is coming (the wait for the checkpoint gave up): end the thread."""
        self._stopped.set()

    def _run(self) -> None:
        request = self.control_dir / FILE_ZERO_PAGES_REQUEST
        while not (self._stopped.is_set() or self.finished()):
            try:
                data = request.read_bytes()
            except OSError:
                self._stopped.wait(self.poll_interval)
                continue
            answer = answer_request(data)
            if answer is None:
                self._stopped.wait(self.poll_interval)
                continue
            if "error" in answer:
                log.warning("refused the agent's zero-page request: %s", answer["error"])
            try:
                write_atomic(
                    self.control_dir / FILE_ZERO_PAGES_RELEASED, json.dumps(answer).encode(), durable=False
                )
            except OSError as e:
                log.warning("could not answer the agent's zero-page request: %s", e)
            return
