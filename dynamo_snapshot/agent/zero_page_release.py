"""Asking the worker to drop the zero pages of the CUDA checkpoint's host copy before CRIU dumps it.

The driver's checkpoint copies the process's GPU memory into host memory it maps during the call, much
of it zeros (a CUDA context's reserves). Only the process itself may drop its own pages, so for a worker
whose ready-for-snapshot offers it (the SDK's ``workload.zero_pages``) the agent notes the process's
mappings before the checkpoint, names the private anonymous ones the call added, and waits a bounded time
for the answer. Whatever the worker does or answers, the dump stays right: a page it drops reads as zero,
which is what it held; no answer, a refusal or a hostile answer only leaves the zeros in the dump (and
the agent's own zero-page drop, where on, takes them out later). The answer is read for the record only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from dynamo_snapshot.agent.metrics import ZERO_PAGES_RELEASED
from dynamo_snapshot.agent.runtime.base import namespace_pid
from dynamo_snapshot.agent.sentinels import present, ready_json, ready_lists, write_sentinel
from dynamo_snapshot.api import protocol
from dynamo_snapshot.fileio.beneath import read_json_beneath
from dynamo_snapshot.workload.zero_pages import private_anonymous, read_maps

__all__ = ["ZeroPageRelease", "ZeroPagesReleased", "agent_drops_zero_pages"]

log = logging.getLogger(__name__)

# A worker scans about 1 GB of host copy in 0.15 s on the H200; an answer this late is not coming.
ANSWER_TIMEOUT_S = 5.0
_POLL_S = 0.005
# The ready file and the answer are the worker's to write: read no more of them than they need.
_MAX_JSON_BYTES = 64 * 1024


class ZeroPagesReleased(BaseModel):
    """The worker's answer (``protocol.FILE_ZERO_PAGES_RELEASED``)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    pid: int
    scanned_bytes: int = Field(0, alias="scannedBytes", ge=0)
    released_bytes: int = Field(0, alias="releasedBytes", ge=0)
    seconds: float = Field(0.0, ge=0)
    runs: int = Field(0, ge=0)
    madvise_seconds: float = Field(0.0, alias="madviseSeconds", ge=0)
    error: str | None = None

    def account(self) -> dict[str, JsonValue]:
        """What the manifest keeps of the worker's answer: how long its scan took, and the part of that
        spent giving pages back (a syscall per run of zero pages)."""
        return self.model_dump(by_alias=True, include={"scanned_bytes", "seconds", "runs", "madvise_seconds"})


def agent_drops_zero_pages(setting: str, released: ZeroPagesReleased | None) -> bool:
    """Whether the agent takes the dump's zero pages out itself (`--drop-zero-pages`): `auto` leaves that to
    a worker that dropped some before the dump (cheaper, and most of a GPU worker's zeros are the host
    copy's), and does it for every other worker: a stock engine, a CPU worker, a failed or empty answer."""
    if setting != "auto":
        return setting == "on"
    return released is None or released.error is not None or released.released_bytes == 0


def offering_pid(control_dir: Path) -> int | None:
    """The pid (as the worker sees it) of the process whose ready file offers to drop its zero pages."""
    doc = ready_json(control_dir)
    if not ready_lists(doc, protocol.FEATURE_RELEASE_ZERO_PAGES):
        return None
    pid = doc.get("pid")
    return pid if type(pid) is int else None


@dataclass
class ZeroPageRelease:
    """One request to one process of the tree: ``before`` are its mappings ahead of the checkpoint."""

    control_dir: Path
    host_pid: int
    worker_pid: int
    before: list[tuple[int, int]]

    @classmethod
    def prepare(cls, control_dir: Path, cuda_pids: list[int]) -> ZeroPageRelease | None:
        """For the CUDA process that offered it, with its mappings now; None when none did."""
        wanted = offering_pid(control_dir)
        if wanted is None:
            return None
        for pid in cuda_pids:
            if namespace_pid(pid) == wanted:
                with contextlib.suppress(OSError):
                    return cls(control_dir, pid, wanted, private_anonymous(read_maps(pid)))
        return None

    def added_ranges(self) -> list[tuple[int, int]]:
        """Address space of private anonymous memory the process has now and had not before the
        checkpoint. Only the new part of a mapping: the kernel may have merged the driver's new mapping
        with an old neighbour, whose pages the process's other threads may be writing."""
        return _subtract(private_anonymous(read_maps(self.host_pid)), self.before)

    async def ask(self, wait_s: float = ANSWER_TIMEOUT_S) -> ZeroPagesReleased | None:
        """Name the added mappings and wait for the answer; None without one (the dump keeps the zeros)."""
        try:
            ranges = await asyncio.to_thread(self.added_ranges)
        except OSError as e:
            log.warning("cannot read the worker's mappings", extra={"pid": self.host_pid, "error": str(e)})
            return None
        if not ranges:
            return None
        request = {"pid": self.worker_pid, "ranges": [list(r) for r in ranges]}
        try:
            doc = await asyncio.to_thread(_exchange, self.control_dir, request, wait_s)
        except (OSError, ValueError) as e:
            log.warning("the worker's zero-page answer cannot be read", extra={"error": str(e)[:500]})
            return None
        if doc is None:
            log.warning("no answer to the zero-page request", extra={"pid": self.host_pid, "wait_s": wait_s})
            return None
        try:
            got = ZeroPagesReleased.model_validate(doc)
        except ValidationError as e:
            # Without the input: the answer is the tenant's, and logs are not the place for what it holds.
            problems = [f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors(include_input=False)]
            log.warning("the worker's zero-page answer does not parse", extra={"problems": problems[:10]})
            return None
        if got.error is not None:
            log.warning("the worker refused the zero-page request", extra={"error": got.error[:500]})
        else:
            ZERO_PAGES_RELEASED.inc(got.released_bytes)
        return got


def _subtract(ranges: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` outside every range of ``taken`` (each list sorted, none overlapping)."""
    out = []
    for lo, hi in ranges:
        for t_lo, t_hi in taken:
            if t_hi <= lo or t_lo >= hi:
                continue
            if t_lo > lo:
                out.append((lo, t_lo))
            lo = max(lo, t_hi)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out


def _exchange(control_dir: Path, doc: dict[str, object], wait_s: float) -> object:
    """Write the request, poll for the answer; its JSON, or None when none came within ``wait_s``.
    Neither file outlives the exchange."""
    request = control_dir / protocol.FILE_ZERO_PAGES_REQUEST
    answer = control_dir / protocol.FILE_ZERO_PAGES_RELEASED
    answer.unlink(missing_ok=True)
    write_sentinel(request, doc)
    try:
        deadline = time.monotonic() + wait_s
        while not present(answer):
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)
        return read_json_beneath(answer, _MAX_JSON_BYTES, what="worker file")
    finally:
        for path in (request, answer):
            path.unlink(missing_ok=True)
