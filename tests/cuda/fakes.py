"""Stand-ins for `cuda.bindings.driver` and `pynvml`: the same names, returning what they return.

Only the error-mapping and argument-building logic is tested with them; the real driver is exercised
by tests/gpu on the H200.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class CUresult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500


class CUprocessState(IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


class _Args:
    def __init__(self) -> None:
        self.timeoutMs = 0


class CUuuid:
    """Like cuda-bindings: CUuuid(address) wraps 16 bytes at `address`; here they are copied at once."""

    def __init__(self, address: int = 0) -> None:
        self.bytes = ctypes.string_at(address, 16) if address else bytes(16)


class CUcheckpointGpuPair:
    def __init__(self) -> None:
        self.oldUuid = CUuuid()
        self.newUuid = CUuuid()


# The class below re-exports these under the driver's names; annotations use the aliases.
_Result = CUresult
_State = CUprocessState


class FakeDriver:
    """A driver with a per-pid state machine; `results` forces a CUresult per function name."""

    CUresult = CUresult
    CUprocessState = CUprocessState
    CUcheckpointLockArgs = _Args
    CUcheckpointCheckpointArgs = _Args
    CUcheckpointRestoreArgs = _Args
    CUcheckpointUnlockArgs = _Args
    CUcheckpointGpuPair = CUcheckpointGpuPair
    CUuuid = CUuuid

    def __init__(self, version: int = 13000) -> None:
        self.version = version
        self.states: dict[int, _State] = {}
        self.results: dict[str, _Result] = {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _forced(self, name: str, args: tuple[Any, ...]) -> _Result | None:
        self.calls.append((name, args))
        return self.results.get(name)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def cuInit(self, flags: int) -> tuple[_Result]:
        return (self._forced("cuInit", (flags,)) or CUresult.CUDA_SUCCESS,)

    def cuDriverGetVersion(self) -> tuple[_Result, int]:
        return (self._forced("cuDriverGetVersion", ()) or CUresult.CUDA_SUCCESS, self.version)

    def cuGetErrorString(self, err: _Result) -> tuple[_Result, bytes]:
        return (CUresult.CUDA_SUCCESS, f"description of {err.name}".encode())

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[_Result, Any]:
        forced = self._forced("cuCheckpointProcessGetState", (pid,))
        if forced:
            return (forced, 32718)  # garbage, as the real binding returned for a bad pid
        if pid not in self.states:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        return (CUresult.CUDA_SUCCESS, self.states[pid])

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int) -> tuple[_Result, int]:
        forced = self._forced("cuCheckpointProcessGetRestoreThreadId", (pid,))
        if forced:
            return (forced, 0)
        if pid not in self.states:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        return (CUresult.CUDA_SUCCESS, pid + 7)

    def _step(self, name: str, pid: int, args: Any, want: _State, to: _State) -> tuple[_Result]:
        forced = self._forced(name, (pid, args))
        if forced:
            return (forced,)
        if self.states.get(pid) is not want:
            return (CUresult.CUDA_ERROR_ILLEGAL_STATE,)
        self.states[pid] = to
        return (CUresult.CUDA_SUCCESS,)

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[_Result]:
        S = CUprocessState
        return self._step(
            "cuCheckpointProcessLock", pid, args, S.CU_PROCESS_STATE_RUNNING, S.CU_PROCESS_STATE_LOCKED
        )

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[_Result]:
        S = CUprocessState
        return self._step(
            "cuCheckpointProcessCheckpoint",
            pid,
            args,
            S.CU_PROCESS_STATE_LOCKED,
            S.CU_PROCESS_STATE_CHECKPOINTED,
        )

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[_Result]:
        S = CUprocessState
        return self._step(
            "cuCheckpointProcessRestore",
            pid,
            args,
            S.CU_PROCESS_STATE_CHECKPOINTED,
            S.CU_PROCESS_STATE_LOCKED,
        )

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[_Result]:
        S = CUprocessState
        return self._step(
            "cuCheckpointProcessUnlock", pid, args, S.CU_PROCESS_STATE_LOCKED, S.CU_PROCESS_STATE_RUNNING
        )


def make_proc(
    root: Path,
    pid: int,
    *,
    ppid: int = 1,
    tgid: int | None = None,
    fds: dict[int, str] | None = None,
    tasks: dict[int, list[int]] | None = None,
    children_files: bool = True,
) -> Path:
    """Lay out /proc/<pid> under `root`: status (Tgid), stat (ppid), fd/ links, task/<tid>/children."""
    d = root / str(pid)
    (d / "fd").mkdir(parents=True, exist_ok=True)
    (d / "status").write_text(f"Name:\tfake\nTgid:\t{tgid or pid}\nPid:\t{pid}\nPPid:\t{ppid}\n")
    (d / "stat").write_text(f"{pid} (fake (name) x) S {ppid} {pid} {pid} 0 -1\n")
    for fd, target in (fds or {}).items():
        (d / "fd" / str(fd)).symlink_to(target)
    for tid, kids in (tasks or {pid: []}).items():
        t = d / "task" / str(tid)
        t.mkdir(parents=True, exist_ok=True)
        if children_files:
            (t / "children").write_text("".join(f"{k} " for k in kids))
    return d


class _Memory(SimpleNamespace):
    total: int
    free: int


class FakeNvml:
    """pynvml's functions over a list of (name, uuid, total MiB, free MiB)."""

    def __init__(
        self,
        gpus: list[tuple[Any, str, int, int]],
        driver: Any = "580.159.04",
        cuda: int = 13000,
        procs: dict[int, list[tuple[int, int | None]]] | None = None,
        init_error: Exception | None = None,
    ):
        self.gpus = gpus
        self.driver = driver
        self.cuda = cuda
        self.procs = procs or {}
        self.init_error = init_error
        self.open = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> Any:
        return self.gpus[h][0]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h][1]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Memory:
        return _Memory(total=self.gpus[h][2] << 20, free=self.gpus[h][3] << 20)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=None if mib is None else mib << 20)
            for pid, mib in self.procs.get(h, [])
        ]
