"""Several restored copies of one checkpoint on one host, for the burst benchmark.

The agent's process runtime restores a tree with its original pids into the host's namespaces, so one
copy per host. Here each restore gets what a pod would give it: a placeholder as PID 1 of its own pid,
mount and network namespaces (loopback up), its own /dev/shm (CRIU recreates the worker's deleted
semaphore files there), and the copy's own control dir bind-mounted over the path the worker was
checkpointed with; CRIU enters them (as the containerd runtime enters a pod's) and
restores the tree as the placeholder's child. The worker listens only after the handshake, so each copy
opens its port in its own network namespace; `NetnsHttp` talks to it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import sys
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.agent_variants import continue_tree
from benchmarks.gpu.host import http
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.agent.runtime.base import Workload, WorkloadRuntimeError
from dynamo_snapshot.criu import CriuError
from dynamo_snapshot.cuda import process_tree

# PID 1 of a copy's namespaces: the copy's control dir over the checkpointed path, a /dev/shm of its own,
# loopback up, then it
# reaps what is reparented to it (the restored root, once CRIU exits) until it is killed.
_PLACEHOLDER = r"""
import fcntl, os, socket, struct, subprocess, sys, time
own, seen = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "--bind", own, seen], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "shm", "/dev/shm"], check=True)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", 0x1 | 0x40).ljust(40, b"\0"))  # SIOCSIFFLAGS up
s.close()
print("ready", flush=True)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.2)
"""

_CLONE_NEWNET = 0x40000000


class IsolatedRuntime(ProcessRuntime):
    """Restores into namespaces of their own; stopped ones too (benchmarks.agent_variants.StoppedRestores)."""

    name = "local-isolated"

    def __init__(self, control_root: Path, criu: Any) -> None:
        super().__init__(control_root, criu)
        self.placeholders: dict[str, tuple[asyncio.subprocess.Process, int]] = {}

    def restore_target(self, key: str) -> Workload | None:
        return None  # the restore makes it

    async def prepare_restore(self, key: str, images_dir: Path) -> None:
        return None  # the tree comes back onto the host's own files

    async def restore(self, key: str, images_dir: Path, source_control_dir: str | None) -> Workload:
        return await self._restore(key, images_dir, source_control_dir, stopped=False)

    async def restore_stopped(self, key: str, images_dir: Path, source_control_dir: str | None) -> Workload:
        return await self._restore(key, images_dir, source_control_dir, stopped=True)

    async def resume(self, workload: Workload) -> None:
        await continue_tree(workload.pid)

    async def _restore(
        self, key: str, images_dir: Path, source_control_dir: str | None, *, stopped: bool
    ) -> Workload:
        if not source_control_dir:
            raise WorkloadRuntimeError("artifact does not record the source control dir")
        seen, own = Path(source_control_dir), self.control_dir(key)
        if key not in self.placeholders:
            await self.prepare(key, seen)
        init = self.placeholders[key][1]
        wrapper = [
            "nsenter", f"--target={init}", "--pid", "--mount", "--net", "--",
            "unshare", "--mount", "--propagation", "private", "--mount-proc",
        ]  # fmt: skip
        try:
            result = await self.criu.restore(
                images_dir,
                detach=True,
                pidfile=own / ".criu-restore.pid",
                log_dir=own,
                leave_stopped=stopped,
                wrapper=wrapper,
            )
        except CriuError as e:
            raise WorkloadRuntimeError(str(e)) from None
        host_pid = await _host_pid(init, result.pid)
        return Workload(key, host_pid, own, worker_control_dir=str(seen))

    async def prepare(self, key: str, seen: Path) -> None:
        """The copy's placeholder, as a pod's exists before its restore begins."""
        own = self.control_dir(key)
        for d in (seen, own):
            d.mkdir(parents=True, exist_ok=True)
        (own / "worker.log").touch()
        proc = await asyncio.create_subprocess_exec(
            "unshare", "--pid", "--net", "--mount", "--propagation", "private", "--fork",
            sys.executable, "-c", _PLACEHOLDER, str(own), str(seen),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None
        if (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() != b"ready":
            raise WorkloadRuntimeError(f"placeholder of {key} did not start")
        (init,) = _children(proc.pid)
        self.placeholders[key] = (proc, init)

    def tool_files(self) -> list[Path]:
        # Exec'd before CRIU, while the restore's bulk reads fill the disk's queue.
        found = (shutil.which(t) for t in ("nsenter", "unshare"))
        return [Path(p) for p in found if p]

    async def stop(self, key: str) -> None:
        held = self.placeholders.pop(key, None)
        if held is not None:
            proc, init = held
            # PID 1 of the copy's pid namespace: its end kills every process in it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)
            await proc.wait()
        await asyncio.to_thread(shutil.rmtree, self.control_dir(key), ignore_errors=True)

    def netns(self, key: str) -> int:
        return self.placeholders[key][1]


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _find(init: int, ns_pid: int) -> int | None:
    for pid in process_tree(init)[1:]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and int(line.split()[-1]) == ns_pid:
                    return pid
    return None


async def _host_pid(init: int, ns_pid: int, within: float = 5.0) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = await asyncio.to_thread(_find, init, ns_pid)
        if found is not None:
            return found
        await asyncio.sleep(0.01)
    raise WorkloadRuntimeError(f"restored pid {ns_pid} not found under placeholder {init}")


class NetnsHttp:
    """HTTP to 127.0.0.1 inside the network namespace of process `pid`, from one thread that joined it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pool = ThreadPoolExecutor(max_workers=1, initializer=self._join)

    def _join(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/proc/{self.pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)

    async def call(self, port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, http, port, path, body, 60)

    async def wait_serving(self, port: int, within: float, worker_pid: int | None = None) -> float:
        """When `/health` first answered 200; fails at once if `worker_pid` (host pid) has exited."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, urllib.error.URLError):
                status, _ = await self.call(port, "/health")
                if status == 200:
                    return time.time()
            if worker_pid is not None and not await asyncio.to_thread(os.path.exists, f"/proc/{worker_pid}"):
                raise RuntimeError(f"worker {worker_pid} on port {port} exited before it served")
            await asyncio.sleep(0.01)
        raise TimeoutError(f"worker on port {port} in netns of {self.pid} did not serve within {within}s")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
