"""Workers as plain host processes, for local/dev nodes without a kubelet (the demo, the GPU test).

CRIU restores a tree with its original pids, so on one host only one restored copy of a checkpoint can
live at a time, and the restored process keeps the control-dir path it was started with: restores write
`restore-complete` there. For several restored replicas per host use the runc runtime (own pid and mount
namespaces per replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.agent.runtime.base import (
    Workload,
    WorkloadRuntimeError,
    WorkloadSpec,
    pid_running,
    proc_stat,
    worker_env,
)
from dynamo_snapshot.api import protocol
from dynamo_snapshot.criu import Criu, CriuError

# Per workload: its pid, its start time and the control dir it really uses (a restored one keeps its
# source's).
_STATEFILE = ".workload.json"


@dataclass(frozen=True)
class _State:
    pid: int
    control_dir: Path
    start_time: int | None  # None in statefiles of agents that did not record it


class ProcessRuntime:
    name = "local"
    streams_pages = True

    def __init__(self, control_root: Path, criu: Criu) -> None:
        self.control_root = control_root
        self.criu = criu

    def control_dir(self, key: str) -> Path:
        return self.control_root / key

    async def launch(self, spec: WorkloadSpec) -> Workload:
        ctl = self.control_dir(spec.key)
        ctl.mkdir(parents=True, exist_ok=True)
        log = (ctl / "worker.log").open("ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *spec.command,
                # The worker finds its control dir through the env; here that is a host directory.
                env={**os.environ, **worker_env(spec, str(ctl))},
                cwd=spec.workdir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                # Own session: CRIU dumps a tree that shares no terminal or process group with the agent.
                start_new_session=True,
            )
        except OSError as e:
            raise WorkloadRuntimeError(f"cannot start {spec.command[0]!r}: {e.strerror}") from None
        finally:
            log.close()
        await asyncio.to_thread(_write_state, ctl, proc.pid, ctl)
        return Workload(spec.key, proc.pid, ctl)

    async def find(self, key: str) -> Workload | None:
        state = await asyncio.to_thread(_read_state, self.control_dir(key))
        # A zombie has exited; a pid that started at another time is a later process that reuses it.
        if state is None or not pid_running(state.pid, state.start_time):
            return None
        return Workload(key, state.pid, state.control_dir)

    async def stop(self, key: str) -> None:
        state = await asyncio.to_thread(_read_state, self.control_dir(key))
        stat = None if state is None else proc_stat(state.pid)
        # The group goes even where its root is a zombie already (its children may live on), but never
        # the group of a later process that got the pid.
        if state is not None and stat is not None and state.start_time in (None, stat.start_time):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state.pid, signal.SIGKILL)
            await _reap(state.pid)
        await asyncio.to_thread(shutil.rmtree, self.control_dir(key), ignore_errors=True)

    def tool_files(self) -> list[Path]:
        return []  # CRIU only, which the executor reads ahead itself

    async def dump(self, workload: Workload, images_dir: Path) -> float:
        try:
            result = await self.criu.dump(workload.pid, images_dir)
        except CriuError as e:
            raise WorkloadRuntimeError(str(e)) from None
        await _reap(workload.pid)
        return result.seconds

    def restore_target(self, key: str) -> Workload | None:
        return None  # the restore makes it

    async def prepare_restore(self, key: str, images_dir: Path) -> None:
        return None  # the tree comes back onto the host's own files

    async def finish_restore(self, key: str) -> float | None:
        return None  # prepare_restore leaves nothing running

    async def restore(
        self, key: str, images_dir: Path, source_control_dir: str | None, *, criu: Criu | None = None
    ) -> Workload:
        if not source_control_dir:
            raise WorkloadRuntimeError("artifact does not record the source control dir")
        ctl = Path(source_control_dir)
        await asyncio.to_thread(_prepare_restored_control_dir, ctl)
        try:
            # Logs go beside the workload, not into the (shared, verified) artifact.
            result = await (criu or self.criu).restore(
                images_dir,
                detach=True,
                pidfile=ctl / ".criu-restore.pid",
                log_dir=self.control_dir(key),
            )
        except CriuError as e:
            raise WorkloadRuntimeError(str(e)) from None
        await asyncio.to_thread(_write_state, self.control_dir(key), result.pid, ctl)
        return Workload(key, result.pid, ctl)


def _prepare_restored_control_dir(ctl: Path) -> None:
    ctl.mkdir(parents=True, exist_ok=True)
    # The restored tree reopens its stdout/stderr file by path; a fresh node may not have it.
    (ctl / "worker.log").touch()
    with contextlib.suppress(FileNotFoundError):
        (ctl / protocol.FILE_RESTORE_COMPLETE).unlink()


def _write_state(own_dir: Path, pid: int, control_dir: Path) -> None:
    own_dir.mkdir(parents=True, exist_ok=True)
    path = own_dir / _STATEFILE
    stat = proc_stat(pid)
    if stat is None:
        # Gone and reaped already: there is nothing to find again, and a statefile would name whatever
        # gets the pid next.
        path.unlink(missing_ok=True)
        return
    path.write_text(json.dumps({"pid": pid, "control_dir": str(control_dir), "start_time": stat.start_time}))


def _read_state(own_dir: Path) -> _State | None:
    try:
        state = json.loads((own_dir / _STATEFILE).read_text())
        start_time = state.get("start_time")
        return _State(
            int(state["pid"]),
            Path(state["control_dir"]),
            None if start_time is None else int(start_time),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


async def _reap(pid: int, within: float = 5.0) -> None:
    """CRIU kills the dumped tree; wait until the pid is really gone so a restore can reuse it.

    Gone means gone from /proc, not just a zombie: CRIU restores the tree with the same pid and cannot
    while a zombie holds it (a restored tree is reparented to init, which reaps it a moment later).
    A zombie nobody reaps is given up on after ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
        if proc_stat(pid) is None:
            return
        await asyncio.sleep(0.02)
