"""What the executor needs from a container runtime, whatever runs the worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from dynamo_snapshot.api import protocol
from dynamo_snapshot.criu import Criu


@dataclass(frozen=True)
class WorkloadSpec:
    """The main container of a pod, as the agent launches it on a node without a kubelet."""

    key: str  # unique per pod: "<namespace>_<name>_<uid8>"
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    # A checkpoint source or restore target: the worker is told where its control dir is. Others are
    # not, as a worker that finds one waits for a restore a cold start never gets.
    snapshot: bool = True


def worker_env(spec: WorkloadSpec, control_dir: str) -> dict[str, str]:
    """The pod's environment as the worker gets it: the control-dir variables point at `control_dir`
    (where the runtime puts it) for snapshot pods, and are absent for others."""
    env = {k: v for k, v in spec.env.items() if k not in protocol.ENV_CONTROL_DIRS}
    if spec.snapshot:
        env.update({name: control_dir for name in protocol.ENV_CONTROL_DIRS})
    return env


@dataclass(frozen=True)
class Workload:
    """A running worker: its root pid on the host and the host directory behind its control dir."""

    key: str
    pid: int
    control_dir: Path
    container_id: str | None = None
    # Where the worker itself sees its control dir, where that differs from the host directory.
    worker_control_dir: str | None = None
    # The image the worker's container runs (the kubelet's imageID), where a kubelet started it.
    image_id: str | None = None
    # The GPUs the device plugin gave the worker's container (NVIDIA_VISIBLE_DEVICES: UUIDs or indices
    # of the node's GPUs); None where it does not say (all of the node's).
    visible_gpus: tuple[str, ...] | None = None


class WorkloadRuntimeError(Exception):
    """A runtime operation failed; the message is meant for a pod annotation."""


class Runtime(Protocol):
    name: str

    def control_dir(self, key: str) -> Path:
        """Host directory behind the workload's snapshot control dir."""
        ...

    async def launch(self, spec: WorkloadSpec) -> Workload: ...

    async def find(self, key: str) -> Workload | None:
        """The running workload for `key`, e.g. after an agent restart; None when there is none."""
        ...

    async def stop(self, key: str) -> None:
        """Kill the workload and forget it; a no-op when it is gone already."""
        ...

    async def dump(self, workload: Workload, images_dir: Path) -> float:
        """CRIU-dump the workload's whole process tree into `images_dir`; returns seconds. Kills it."""
        ...

    def restore_target(self, key: str) -> Workload | None:
        """The workload a restore of ``key`` goes into where it exists before CRIU runs (a restore pod's
        container, waiting in standby); None where the restore makes it."""
        ...

    async def prepare_restore(self, key: str, images_dir: Path) -> None:
        """Put into the restore's target what the dumped tree needs there besides CRIU's images (a
        container's writable layer: files the worker wrote, some of them mapped); nothing where the target
        needs none. Called once before ``restore``, on images already verified. What CRIU does not open
        may go on being written beside the restore until ``finish_restore``."""
        ...

    async def finish_restore(self, key: str) -> float | None:
        """Returns once what ``prepare_restore`` left writing is written (before the worker is told to
        go on): the seconds that writing took, None where it left none. A failure there fails the
        restore; a restore that fails or stops sooner ends that writing itself."""
        ...

    # Whether `restore` takes a `criu` of the caller's (criu.streamed_pages: pages that arrive during it).
    streams_pages: bool

    async def restore(
        self, key: str, images_dir: Path, source_control_dir: str | None, *, criu: Criu | None = None
    ) -> Workload:
        """Restore a dumped tree as workload `key`; returns once the processes exist (not yet resumed
        past the CUDA lock). `criu`: the CRIU to restore with instead of the runtime's own, where
        `streams_pages`."""
        ...

    def tool_files(self) -> list[Path]:
        """Programs a restore runs besides CRIU (runc): read ahead of the restore's bulk I/O."""
        ...


class ProcStat(NamedTuple):
    state: str  # "R", "S", "Z" (a zombie), ...
    start_time: int  # clock ticks after boot


def proc_stat(pid: int) -> ProcStat | None:
    """The state and start time of `pid` (/proc/PID/stat fields 3 and 22); None when there is none.

    Once a process is reaped its pid can go to another one, which started later: the pid and the start
    time together name one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The fields after the command name, which is in parentheses and may contain any byte.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return ProcStat(fields[0].decode(), int(fields[19]))


def pid_running(pid: int, start_time: int | None = None) -> bool:
    """Whether `pid` exists and is not a zombie (a restored tree's parent may never reap it). Given the
    start time it had when recorded, also whether it is still that process and not a later one."""
    stat = proc_stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return False
    return start_time is None or stat.start_time == start_time


def nspids(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid`'s number in each PID namespace it is in, the host's first (/proc/PID/status NSpid); empty when
    it is gone."""
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(p) for p in line.split()[1:]]
    return []


def namespace_pid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """`pid` as its own PID namespace numbers it (NSpid's last); None when it is gone."""
    ids = nspids(pid, proc)
    return ids[-1] if ids else None


async def wait_exit(pid: int) -> None:
    """Return once `pid` has terminated (a zombie counts as terminated).

    A pidfd turns readable when its process exits, so this waits on the event loop without polling, and
    works for processes that are not the agent's children (a CRIU-restored tree, a runc container's init).
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)
