"""CudaCheckpointer's logic against a stand-in driver: state checks, error mapping, argument building."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_snapshot.cuda import (
    CudaCheckpointer,
    CudaError,
    CudaUnavailableError,
    DriverTooOldError,
    NotCudaProcessError,
    ProcessState,
    WrongStateError,
    parse_gpu_uuid,
)
from tests.cuda.fakes import CUprocessState, CUresult, FakeDriver, make_proc

PID = 4242
UUID_A = "GPU-5f3c0e5e-1c2d-3e4f-5a6b-7c8d9e0f1a2b"
UUID_B = "GPU-00112233-4455-6677-8899-aabbccddeeff"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    make_proc(root, PID, fds={3: "/dev/nvidiactl", 4: "/dev/nvidia0"})
    return root


@pytest.fixture
def driver() -> FakeDriver:
    d = FakeDriver()
    d.states[PID] = CUprocessState.CU_PROCESS_STATE_RUNNING
    return d


@pytest.fixture
def cp(driver: FakeDriver, proc: Path) -> CudaCheckpointer:
    return CudaCheckpointer(driver, proc_root=proc)


def test_full_cycle_and_states(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    assert cp.state(PID) is ProcessState.RUNNING
    cp.lock(PID, timeout_ms=1234)
    lock_args = next(args for name, args in driver.calls if name == "cuCheckpointProcessLock")[1]
    assert lock_args.timeoutMs == 1234
    assert cp.state(PID) is ProcessState.LOCKED
    cp.checkpoint(PID)
    assert cp.state(PID) is ProcessState.CHECKPOINTED
    cp.restore(PID)
    assert cp.state(PID) is ProcessState.LOCKED
    cp.unlock(PID)
    assert cp.state(PID) is ProcessState.RUNNING
    assert driver.names().count("cuInit") == 1
    assert cp.driver_version() == 13000


def test_suspend_resume_report_seconds_per_step(cp: CudaCheckpointer) -> None:
    suspended = cp.suspend(PID)
    assert set(suspended) == {"cuda_lock", "cuda_checkpoint"}
    assert all(v >= 0 for v in suspended.values())
    assert cp.state(PID) is ProcessState.CHECKPOINTED
    resumed = cp.resume(PID)
    assert set(resumed) == {"cuda_restore", "cuda_unlock"}
    assert cp.state(PID) is ProcessState.RUNNING


def test_suspend_unlocks_again_when_checkpoint_fails(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    driver.results["cuCheckpointProcessCheckpoint"] = CUresult.CUDA_ERROR_OPERATING_SYSTEM
    with pytest.raises(CudaError, match="CUDA_ERROR_OPERATING_SYSTEM") as e:
        cp.suspend(PID)
    assert e.value.op == "cuCheckpointProcessCheckpoint"
    assert driver.states[PID] is CUprocessState.CU_PROCESS_STATE_RUNNING


def test_checkpoint_without_lock_is_wrong_state_and_never_reaches_the_driver(
    cp: CudaCheckpointer, driver: FakeDriver
) -> None:
    with pytest.raises(WrongStateError) as e:
        cp.checkpoint(PID)
    assert e.value.state == "running"
    assert e.value.expected == "locked"
    assert "running" in str(e.value)
    assert "cuCheckpointProcessCheckpoint" not in driver.names()


@pytest.mark.parametrize(
    ("state", "call"),
    [
        (CUprocessState.CU_PROCESS_STATE_RUNNING, "unlock"),
        (CUprocessState.CU_PROCESS_STATE_RUNNING, "restore"),
        (CUprocessState.CU_PROCESS_STATE_LOCKED, "lock"),
        (CUprocessState.CU_PROCESS_STATE_CHECKPOINTED, "checkpoint"),
        (CUprocessState.CU_PROCESS_STATE_FAILED, "lock"),
    ],
)
def test_every_transition_checks_the_state(
    cp: CudaCheckpointer, driver: FakeDriver, state: CUprocessState, call: str
) -> None:
    driver.states[PID] = state
    with pytest.raises(WrongStateError) as e:
        getattr(cp, call)(PID)
    assert e.value.state == ProcessState[state.name.removeprefix("CU_PROCESS_STATE_")].value


def test_illegal_state_from_the_driver_is_wrong_state(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    # Another caller moved the process between our state check and the call.
    driver.results["cuCheckpointProcessLock"] = CUresult.CUDA_ERROR_ILLEGAL_STATE
    with pytest.raises(WrongStateError) as e:
        cp.lock(PID)
    assert e.value.result == "CUDA_ERROR_ILLEGAL_STATE"
    assert e.value.state == "running"


def test_other_failures_are_cuda_errors_with_the_drivers_words(
    cp: CudaCheckpointer, driver: FakeDriver
) -> None:
    driver.states[PID] = CUprocessState.CU_PROCESS_STATE_CHECKPOINTED
    driver.results["cuCheckpointProcessRestore"] = CUresult.CUDA_ERROR_OPERATING_SYSTEM
    with pytest.raises(CudaError) as e:
        cp.restore(PID)
    assert type(e.value) is CudaError
    assert (e.value.op, e.value.pid, e.value.result) == (
        "cuCheckpointProcessRestore",
        PID,
        "CUDA_ERROR_OPERATING_SYSTEM",
    )
    assert "description of CUDA_ERROR_OPERATING_SYSTEM" in str(e.value)


@pytest.mark.parametrize(
    "result",
    [CUresult.CUDA_ERROR_INVALID_VALUE, CUresult.CUDA_ERROR_NOT_INITIALIZED, CUresult.CUDA_ERROR_NOT_FOUND],
)
def test_no_cuda_state_in_a_live_process_is_not_cuda(tmp_path: Path, result: CUresult) -> None:
    proc = tmp_path / "proc"
    make_proc(proc, PID, fds={3: "/dev/nvidiactl"})  # even with a GPU device open: NVML-only processes
    driver = FakeDriver()
    driver.results["cuCheckpointProcessGetState"] = result
    driver.results["cuCheckpointProcessGetRestoreThreadId"] = result
    cp = CudaCheckpointer(driver, proc_root=proc)
    for call in (cp.state, cp.lock, cp.checkpoint, cp.restore_thread_id):
        with pytest.raises(NotCudaProcessError) as e:
            call(PID)
        assert e.value.result == result.name
    assert "cuCheckpointProcessLock" not in driver.names()


def test_other_getstate_failure_is_not_cuda_only_without_gpu_fds(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    make_proc(proc, 10, fds={3: "/dev/nvidia0"})
    make_proc(proc, 11, fds={3: "/tmp/x"})
    driver = FakeDriver()
    driver.results["cuCheckpointProcessGetState"] = CUresult.CUDA_ERROR_OPERATING_SYSTEM
    cp = CudaCheckpointer(driver, proc_root=proc)
    with pytest.raises(CudaError) as e:
        cp.state(10)
    assert type(e.value) is CudaError
    with pytest.raises(NotCudaProcessError, match="no /dev/nvidia"):
        cp.state(11)


def test_old_bindings_raising_on_a_failed_getstate(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    make_proc(proc, 12)
    driver = FakeDriver()

    def raising(pid: int) -> tuple[CUresult, int]:
        raise ValueError("32718 is not a valid CUprocessState")

    driver.cuCheckpointProcessGetState = raising  # type: ignore[method-assign]
    with pytest.raises(NotCudaProcessError, match="no /dev/nvidia"):
        CudaCheckpointer(driver, proc_root=proc).state(12)


def test_missing_pid_and_thread_ids_are_not_cuda_processes(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    make_proc(proc, 20, tgid=19)  # a thread of process 19
    driver = FakeDriver()
    driver.states[19] = driver.states[20] = CUprocessState.CU_PROCESS_STATE_RUNNING
    cp = CudaCheckpointer(driver, proc_root=proc)
    with pytest.raises(NotCudaProcessError, match="thread of process 19"):
        cp.lock(20)
    assert "cuCheckpointProcessGetState" not in driver.names()
    with pytest.raises(NotCudaProcessError, match="no such process"):
        cp.state(999)


@pytest.mark.parametrize("pid", [0, -3, True, "12"])
def test_bad_pids_are_rejected(cp: CudaCheckpointer, pid: object) -> None:
    with pytest.raises(ValueError, match="positive int"):
        cp.state(pid)  # type: ignore[arg-type]


def test_bad_lock_timeout_is_rejected(cp: CudaCheckpointer) -> None:
    with pytest.raises(ValueError, match="timeout_ms"):
        cp.lock(PID, timeout_ms=-1)


def test_restore_remap_builds_gpu_pairs(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    driver.states[PID] = CUprocessState.CU_PROCESS_STATE_CHECKPOINTED
    cp.restore(PID, {UUID_A: UUID_B, UUID_B: UUID_A.removeprefix("GPU-").upper()})
    args = next(a for name, a in driver.calls if name == "cuCheckpointProcessRestore")[1]
    assert args.gpuPairsCount == 2
    pairs = [(p.oldUuid.bytes, p.newUuid.bytes) for p in args.gpuPairs]
    assert pairs == [
        (parse_gpu_uuid(UUID_A), parse_gpu_uuid(UUID_B)),
        (parse_gpu_uuid(UUID_B), parse_gpu_uuid(UUID_A)),
    ]


def test_restore_without_remap_passes_no_pairs(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    driver.states[PID] = CUprocessState.CU_PROCESS_STATE_CHECKPOINTED
    cp.restore(PID, {})
    args = next(a for name, a in driver.calls if name == "cuCheckpointProcessRestore")[1]
    assert not hasattr(args, "gpuPairs")


def test_bad_remap_uuid_fails_before_the_driver(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    driver.states[PID] = CUprocessState.CU_PROCESS_STATE_CHECKPOINTED
    with pytest.raises(ValueError, match="not a GPU UUID"):
        cp.restore(PID, {UUID_A: "GPU-nope"})
    assert "cuCheckpointProcessRestore" not in driver.names()


def test_restore_thread_id(cp: CudaCheckpointer) -> None:
    assert cp.restore_thread_id(PID) == PID + 7


def test_state_from_bare_ints_and_unknown_values(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    driver.states[PID] = 2  # type: ignore[assignment]
    assert cp.state(PID) is ProcessState.CHECKPOINTED
    driver.states[PID] = 77  # type: ignore[assignment]
    with pytest.raises(CudaError, match="unknown CUprocessState"):
        cp.state(PID)


# ---- setup failures ----


def test_cuinit_failure_says_no_driver(proc: Path) -> None:
    driver = FakeDriver()
    driver.results["cuInit"] = CUresult.CUDA_ERROR_NO_DEVICE
    with pytest.raises(
        CudaUnavailableError, match="no NVIDIA driver: cuInit failed with CUDA_ERROR_NO_DEVICE"
    ):
        CudaCheckpointer(driver, proc_root=proc).state(PID)


def test_old_driver_version_names_both_versions(proc: Path) -> None:
    cp = CudaCheckpointer(FakeDriver(version=12040), proc_root=proc)
    with pytest.raises(DriverTooOldError) as e:
        cp.lock(PID)
    message = str(e.value)
    assert "CUDA 12.4" in message
    assert "12040" in message
    assert "12080" in message
    assert "570" in message


class _Without:
    """A driver module lacking some names, as cuda-python < 12.8 lacks the checkpoint API."""

    def __init__(self, inner: FakeDriver, *missing: str) -> None:
        self._inner = inner
        self._missing = missing

    def __getattr__(self, name: str) -> object:
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_bindings_without_checkpoint_api(proc: Path) -> None:
    driver = _Without(FakeDriver(), "cuCheckpointProcessLock", "CUcheckpointLockArgs")
    with pytest.raises(DriverTooOldError, match="cuCheckpointProcessLock, CUcheckpointLockArgs"):
        CudaCheckpointer(driver, proc_root=proc).state(PID)


def test_bindings_without_gpu_pairs_cannot_remap(proc: Path) -> None:
    inner = FakeDriver()
    inner.states[PID] = CUprocessState.CU_PROCESS_STATE_CHECKPOINTED
    cp = CudaCheckpointer(_Without(inner, "CUcheckpointGpuPair"), proc_root=proc)
    with pytest.raises(DriverTooOldError, match="CUcheckpointGpuPair"):
        cp.restore(PID, {UUID_A: UUID_B})
    cp.restore(PID)  # without a remap it needs no pairs


def test_symbol_missing_in_libcuda_is_driver_too_old(cp: CudaCheckpointer, driver: FakeDriver) -> None:
    def missing(pid: int, args: object) -> tuple[CUresult]:
        raise RuntimeError('Function "cuCheckpointProcessLock" not found')

    driver.cuCheckpointProcessLock = missing  # type: ignore[method-assign]
    with pytest.raises(DriverTooOldError, match="does not export cuCheckpointProcessLock"):
        cp.lock(PID)


def test_every_error_is_a_cuda_error() -> None:
    for cls in (CudaUnavailableError, DriverTooOldError, NotCudaProcessError, WrongStateError):
        assert issubclass(cls, CudaError)
    err = CudaUnavailableError("x")
    assert (err.op, err.pid, str(err)) == ("", None, "x")
