"""The CUDA stage of a checkpoint and a restore across a worker's processes (a tensor-parallel worker's
ranks), against a stand-in for the driver that records the order of the calls. Pure logic; the real
driver: tests/gpu/cuda_scenarios.py two_processes."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import pytest

from dynamo_snapshot.agent.cuda_processes import resume_cuda, suspend_cuda
from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.cuda import CudaCheckpointer, CudaError, ProcessState


class Driver:
    """Per-process states as the driver keeps them; ``together`` makes each checkpoint and restore wait
    until every process is in the same call, so a test fails if the calls run one after another."""

    def __init__(self, pids: list[int], *, failing: int | None = None) -> None:
        self.states = dict.fromkeys(pids, ProcessState.RUNNING)
        self.calls: list[tuple[str, int]] = []
        self.failing = failing
        self.together = threading.Barrier(len(pids), timeout=5)
        self.remaps: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _record(self, op: str, pid: int) -> None:
        with self._lock:
            self.calls.append((op, pid))

    def state(self, pid: int) -> ProcessState:
        return self.states[pid]

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._record("lock", pid)
        self.states[pid] = ProcessState.LOCKED

    def checkpoint(self, pid: int) -> None:
        self._record("checkpoint", pid)
        if pid == self.failing:
            raise CudaError("cuCheckpointProcessCheckpoint", pid, "CUDA_ERROR_OUT_OF_MEMORY")
        self.together.wait()
        self.states[pid] = ProcessState.CHECKPOINTED

    def restore(self, pid: int, remap: Any) -> None:
        self._record("restore", pid)
        self.remaps[pid] = remap
        if self.failing is None:
            self.together.wait()
        self.states[pid] = ProcessState.LOCKED

    def unlock(self, pid: int) -> None:
        self._record("unlock", pid)
        self.states[pid] = ProcessState.RUNNING


def _cuda(driver: Driver) -> CudaCheckpointer:
    return cast(CudaCheckpointer, driver)


def test_every_rank_is_locked_before_any_is_checkpointed_and_they_checkpoint_at_once() -> None:
    driver = Driver([11, 12, 13])
    asyncio.run(suspend_cuda(_cuda(driver), [11, 12, 13], 1000))
    ops = [op for op, _ in driver.calls]
    assert ops[:3] == ["lock"] * 3
    assert sorted(ops[3:]) == ["checkpoint"] * 3  # the barrier passed: all three in the call together
    assert set(driver.states.values()) == {ProcessState.CHECKPOINTED}

    remap = {"GPU-a": "GPU-b"}
    asyncio.run(resume_cuda(_cuda(driver), [11, 12, 13], remap))
    assert driver.remaps == dict.fromkeys([11, 12, 13], remap)
    assert set(driver.states.values()) == {ProcessState.RUNNING}


def test_one_rank_failing_its_checkpoint_gives_every_rank_its_gpu_back() -> None:
    driver = Driver([21, 22], failing=22)
    driver.together = threading.Barrier(1)  # the failing rank never reaches it
    with pytest.raises(AgentError, match=r"CUDA checkpoint failed: .*pid 22.*OUT_OF_MEMORY"):
        asyncio.run(suspend_cuda(_cuda(driver), [21, 22], 1000))
    assert driver.states == {21: ProcessState.RUNNING, 22: ProcessState.RUNNING}
    assert ("restore", 21) in driver.calls
    assert ("restore", 22) not in driver.calls  # it was only locked
    assert ("unlock", 22) in driver.calls


def test_a_rank_failing_its_restore_is_named_once_all_have_ended() -> None:
    driver = Driver([31, 32])
    asyncio.run(suspend_cuda(_cuda(driver), [31, 32], 1000))
    driver.failing = 32

    def restore(pid: int, remap: Any) -> None:
        driver._record("restore", pid)
        if pid == 32:
            raise CudaError("cuCheckpointProcessRestore", pid, "CUDA_ERROR_INVALID_DEVICE")
        driver.states[pid] = ProcessState.LOCKED

    driver.restore = restore  # type: ignore[method-assign]
    with pytest.raises(AgentError, match=r"CUDA restore of pid 32 failed"):
        asyncio.run(resume_cuda(_cuda(driver), [31, 32], {}))
    assert driver.states[31] is ProcessState.RUNNING  # the other rank was restored and unlocked


def test_a_restore_maps_the_checkpointed_gpus_onto_the_ones_it_was_checked_against() -> None:
    """resume_process restores CUDA onto the GPUs check_before_reading resolved for the restore, every
    checkpointed UUID paired with one of them in order."""
    import os
    from types import SimpleNamespace

    from dynamo_snapshot.agent.restore import RestoreRun
    from dynamo_snapshot.artifact.manifest import GpuInfo

    def gpus(*uuids: str) -> GpuInfo:
        return GpuInfo(product="NVIDIA-H200", cuda_driver_major="580", count=len(uuids), uuids=list(uuids))

    me = os.getpid()
    driver = _TreeDriver([me])
    driver.states[me] = ProcessState.CHECKPOINTED
    node = SimpleNamespace(cuda=driver, gpus=gpus("GPU-n0", "GPU-n1", "GPU-n2", "GPU-n3"))
    artifact = SimpleNamespace(key="k", manifest=SimpleNamespace(gpus=gpus("GPU-a", "GPU-b")))
    run = RestoreRun(
        cast(Any, node),
        "w",
        cast(Any, artifact),
        cast(Any, SimpleNamespace(phase=_no_phase)),
        cast(Any, None),
        None,
        gpus("GPU-n2", "GPU-n3"),
    )
    asyncio.run(run.resume_process(cast(Any, SimpleNamespace(pid=me, visible_gpus=None))))
    assert driver.remaps == {me: {"GPU-a": "GPU-n2", "GPU-b": "GPU-n3"}}
    assert driver.states[me] is ProcessState.RUNNING


class _TreeDriver(Driver):
    """The driver as it answers for a whole process tree: processes without CUDA are not its own."""

    def state(self, pid: int) -> ProcessState:
        if pid not in self.states:
            raise CudaError("cuCheckpointProcessGetState", pid, "CUDA_ERROR_NOT_INITIALIZED")
        return super().state(pid)


def _no_phase(*_: str) -> Any:
    import contextlib

    return contextlib.nullcontext()
