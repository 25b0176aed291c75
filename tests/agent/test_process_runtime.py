"""ProcessRuntime finding its workloads again from their statefiles (as after an agent restart): real
processes, neither CRIU nor a cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.agent.runtime.base import WorkloadSpec, pid_running, proc_stat
from dynamo_snapshot.criu import Criu
from tests.controller.conftest import eventually

STATEFILE = ".workload.json"  # on disk across agent versions: old files must keep loading
SLEEP = ["sleep", "300"]
Spawn = Callable[[list[str]], "subprocess.Popen[bytes]"]


@pytest.fixture
def runtime(tmp_path: Path) -> ProcessRuntime:
    return ProcessRuntime(tmp_path / "control", Criu())


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start a process of the test's own, in its own session; one never waited for stays a zombie."""
    started: list[subprocess.Popen[bytes]] = []

    def start(command: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _record(runtime: ProcessRuntime, key: str, pid: int, *, start_time: bool) -> None:
    """A statefile as the runtime writes it, or as agents wrote it before they recorded start times."""
    state: dict[str, object] = {"pid": pid, "control_dir": str(runtime.control_dir(key))}
    if start_time:
        stat = proc_stat(pid)
        assert stat is not None
        state["start_time"] = stat.start_time
    runtime.control_dir(key).mkdir(parents=True, exist_ok=True)
    (runtime.control_dir(key) / STATEFILE).write_text(json.dumps(state))


async def _zombie(proc: subprocess.Popen[bytes]) -> bool:
    stat = proc_stat(proc.pid)
    return stat is not None and stat.state == "Z"


async def _gone(pid: int) -> bool:
    return proc_stat(pid) is None


async def _dead(pid: int) -> bool:
    return not pid_running(pid)  # an orphan's reaper may be slow to reap


async def test_a_launched_worker_is_found_until_it_exits(runtime: ProcessRuntime) -> None:
    workload = await runtime.launch(WorkloadSpec(key="w", command=SLEEP))
    try:
        assert await runtime.find("w") == workload
    finally:
        os.kill(workload.pid, signal.SIGKILL)
    await eventually(lambda: _gone(workload.pid), within=10, interval=0.02)  # asyncio reaps its child
    assert await runtime.find("w") is None


@pytest.mark.parametrize("start_time", [True, False], ids=["statefile", "old-statefile"])
async def test_a_zombie_is_not_the_live_workload(
    runtime: ProcessRuntime, spawn: Spawn, start_time: bool
) -> None:
    proc = spawn(SLEEP)
    _record(runtime, "w", proc.pid, start_time=start_time)
    # Positive control: the same statefile finds the process while it runs.
    assert await runtime.find("w") is not None
    proc.kill()  # never waited for: it stays a zombie, as a restored root whose parent does not reap it
    await eventually(lambda: _zombie(proc), within=10, interval=0.02)
    assert await runtime.find("w") is None


async def test_an_old_statefile_still_finds_its_workload(runtime: ProcessRuntime, spawn: Spawn) -> None:
    proc = spawn(SLEEP)
    _record(runtime, "w", proc.pid, start_time=False)
    found = await runtime.find("w")
    assert found is not None
    assert (found.pid, found.control_dir) == (proc.pid, runtime.control_dir("w"))


async def _reused_pid(runtime: ProcessRuntime, spawn: Spawn) -> subprocess.Popen[bytes]:
    """A launched worker that died, its pid now another process's: the workload's statefile is made to
    name a process that started later, as the kernel does when it hands the reaped pid out again."""
    workload = await runtime.launch(WorkloadSpec(key="w", command=SLEEP))
    os.kill(workload.pid, signal.SIGKILL)
    await eventually(lambda: _gone(workload.pid), within=10, interval=0.02)
    # A pid is known by its start time, counted in clock ticks (10 ms): the kernel hands a pid out again
    # only after the others, never within the tick that started the old one, and neither may this test.
    await asyncio.sleep(0.05)
    other = spawn(SLEEP)
    path = runtime.control_dir("w") / STATEFILE
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "pid": other.pid}))
    return other


async def test_a_reused_pid_is_not_the_workload(runtime: ProcessRuntime, spawn: Spawn) -> None:
    await _reused_pid(runtime, spawn)
    assert await runtime.find("w") is None


async def test_stop_leaves_a_process_that_reused_the_pid_alone(runtime: ProcessRuntime, spawn: Spawn) -> None:
    other = await _reused_pid(runtime, spawn)
    await runtime.stop("w")
    assert other.poll() is None, "stop killed an unrelated process that got the workload's old pid"
    assert not runtime.control_dir("w").exists()


@pytest.mark.parametrize("start_time", [True, False], ids=["statefile", "old-statefile"])
async def test_stop_kills_the_group_of_a_zombie_root(
    runtime: ProcessRuntime, spawn: Spawn, tmp_path: Path, start_time: bool
) -> None:
    # The root exits at once and stays a zombie; the child it leaves behind is still in its group.
    child_pidfile = tmp_path / "child.pid"
    root = spawn(["sh", "-c", f'sleep 300 & echo $! >"{child_pidfile}"'])
    await eventually(lambda: _zombie(root), within=10, interval=0.02)
    child = int(child_pidfile.read_text())
    _record(runtime, "w", root.pid, start_time=start_time)
    try:
        await runtime.stop("w")
        await eventually(lambda: _dead(child), within=10, interval=0.02)
    finally:
        if pid_running(child):
            os.kill(child, signal.SIGKILL)
