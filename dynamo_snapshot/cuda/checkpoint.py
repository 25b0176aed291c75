"""A typed wrapper over the CUDA driver's process checkpoint API (cuCheckpointProcess*).

The caller is a different process from the one checkpointed (the node agent, or a test): every call
takes the *target* pid, and the caller only needs cuInit, not a CUDA context. The state machine:

    lock()          checkpoint()             restore()          unlock()
    RUNNING ------> LOCKED ------> CHECKPOINTED ------> LOCKED ------> RUNNING

cuda-python (`cuda.bindings.driver`) is imported lazily, so this module imports on machines without
it; every call then raises CudaUnavailableError.

Version floor: r550 drivers had only the `cuda-checkpoint` binary; the CUDA driver interfaces came
with r570 / CUDA 12.8 (NVIDIA/cuda-checkpoint README, "570 Features"; cuda-python's own
cuda.core.checkpoint also requires 12.8). So the floor is cuDriverGetVersion 12080, not r550.

Errors, and why each is chosen:
- Before any transition the target's state is read (cuCheckpointProcessGetState), so a call in the
  wrong state raises WrongStateError naming the current state whatever code the driver would give.
- When GetState fails, the pid is classified: no such process, or a thread id rather than a process
  id, or a CUresult that the driver documents for a pid it has no CUDA state for
  (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED - ai-dynamo/snapshot's helper reads both as
  "live pid that owns no CUDA checkpoint state" - and CUDA_ERROR_NOT_FOUND), or any other code for a
  process that has no /dev/nvidia* open: all NotCudaProcessError, carrying the driver's code in
  `.result`. Anything else is a CudaError.
- CUDA_ERROR_ILLEGAL_STATE from a transition (a race with another caller) is a WrongStateError.
"""

from __future__ import annotations

import ctypes
import importlib
import string
import threading
import time
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from dynamo_snapshot.cuda import processes
from dynamo_snapshot.cuda.errors import (
    INSTALL_HINT,
    CudaError,
    CudaUnavailableError,
    DriverTooOldError,
    NotCudaProcessError,
    WrongStateError,
    describe_result,
)

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_MS",
    "MIN_CUDA_DRIVER_VERSION",
    "CudaCheckpointer",
    "ProcessState",
    "cuda_available",
    "format_gpu_uuid",
    "parse_gpu_uuid",
]

MIN_CUDA_DRIVER_VERSION: Final = 12080
_MIN_DRIVER_BRANCH: Final = 570
DEFAULT_LOCK_TIMEOUT_MS: Final = 10_000

_REQUIRED_SYMBOLS: Final = (
    "cuInit",
    "cuDriverGetVersion",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "CUcheckpointLockArgs",
    "CUcheckpointCheckpointArgs",
    "CUcheckpointRestoreArgs",
    "CUcheckpointUnlockArgs",
)
_REMAP_SYMBOLS: Final = ("CUcheckpointGpuPair", "CUuuid")

_SUCCESS: Final = "CUDA_SUCCESS"
_ILLEGAL_STATE: Final = "CUDA_ERROR_ILLEGAL_STATE"
_NOT_CUDA_RESULTS: Final = frozenset(
    {"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_NOT_FOUND"}
)


class ProcessState(StrEnum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


_STATE_BY_DRIVER_NAME: Final = {
    "CU_PROCESS_STATE_RUNNING": ProcessState.RUNNING,
    "CU_PROCESS_STATE_LOCKED": ProcessState.LOCKED,
    "CU_PROCESS_STATE_CHECKPOINTED": ProcessState.CHECKPOINTED,
    "CU_PROCESS_STATE_FAILED": ProcessState.FAILED,
}
# The values in cuda.h, for drivers objects that give a bare int.
_STATE_BY_VALUE: Final = {
    0: ProcessState.RUNNING,
    1: ProcessState.LOCKED,
    2: ProcessState.CHECKPOINTED,
    3: ProcessState.FAILED,
}


# --- GPU UUIDs -----------------------------------------------------------------------------------


def parse_gpu_uuid(text: str) -> bytes:
    """The 16 bytes of a GPU UUID as NVML and nvidia-smi print it ("GPU-5f3c0e5e-...") or bare.

    The bytes are in the order the hex digits are written, which is the order of CUuuid.bytes: NVML
    and cuDeviceGetUuid name the same GPU with the same 16 bytes.
    """
    body = text.strip()
    if body[:4].upper() == "GPU-":
        body = body[4:]
    hex_digits = body.replace("-", "")
    if len(hex_digits) != 32 or any(c not in string.hexdigits for c in hex_digits):
        raise ValueError(f"not a GPU UUID (want 32 hex digits, optionally after 'GPU-'): {text!r}")
    return bytes.fromhex(hex_digits)


def format_gpu_uuid(raw: bytes) -> str:
    """NVML's spelling of a GPU UUID: "GPU-" and the 16 bytes as lower-case 8-4-4-4-12 hex."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# --- the driver ----------------------------------------------------------------------------------


def import_driver() -> Any:
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError:
        raise CudaUnavailableError(f"cuda-python is not installed ({INSTALL_HINT})") from None


def result_name(result: Any) -> str:
    name = getattr(result, "name", None)
    return name if isinstance(name, str) else str(result)


def _kernel_driver_version() -> str | None:
    # The NVIDIA kernel module's own version (e.g. "580.159.04"), for error messages only.
    try:
        return Path("/sys/module/nvidia/version").read_text(encoding="ascii").strip() or None
    except OSError:
        return None


def _cuda_version_text(version: int) -> str:
    return f"CUDA {version // 1000}.{version % 1000 // 10}"


class CudaCheckpointer:
    """Lock, checkpoint, restore and unlock the CUDA state of *other* processes, by pid.

    Construction is cheap and never fails; the first call imports cuda-python, runs cuInit(0) once and
    checks the driver version. `driver` replaces `cuda.bindings.driver` (tests pass a stand-in with
    the same function names returning (CUresult, ...) tuples). Thread-safe: the calls themselves are
    independent driver requests, and initialisation is guarded.
    """

    def __init__(self, driver: Any | None = None, *, proc_root: Path = processes.PROC) -> None:
        self._driver = driver
        self._proc_root = proc_root
        self._ready = False
        self._version = 0
        self._lock = threading.Lock()

    # ---- initialisation ----

    def _ensure(self) -> Any:
        if self._ready:
            return self._driver
        with self._lock:
            if self._ready:
                return self._driver
            driver = self._driver if self._driver is not None else import_driver()
            missing = [s for s in _REQUIRED_SYMBOLS if not hasattr(driver, s)]
            if missing:
                raise DriverTooOldError(
                    "this cuda-python has no process checkpoint API (missing "
                    f"{', '.join(missing)}): install cuda-python >= 12.8 ({INSTALL_HINT})"
                )
            err = result_name(self._raw(driver, "cuInit", 0)[0])
            if err != _SUCCESS:
                raise CudaUnavailableError(f"no NVIDIA driver: cuInit failed with {err}")
            err_v, *rest = self._raw(driver, "cuDriverGetVersion")
            version = int(rest[0]) if result_name(err_v) == _SUCCESS and rest else 0
            if version < MIN_CUDA_DRIVER_VERSION:
                kernel = _kernel_driver_version()
                found = f"{_cuda_version_text(version)} (cuDriverGetVersion {version})"
                if kernel:
                    found += f", kernel module {kernel}"
                raise DriverTooOldError(
                    f"the NVIDIA driver is too old for the CUDA checkpoint API: it provides {found}; "
                    f"the API needs {_cuda_version_text(MIN_CUDA_DRIVER_VERSION)} "
                    f"(cuDriverGetVersion >= {MIN_CUDA_DRIVER_VERSION}), i.e. driver >= {_MIN_DRIVER_BRANCH}"
                )
            self._driver = driver
            self._version = version
            self._ready = True
            return driver

    @staticmethod
    def _raw(driver: Any, op: str, *args: Any) -> tuple[Any, ...]:
        """Call driver.op(*args) and return the result as a tuple (CUresult first)."""
        try:
            result = getattr(driver, op)(*args)
        except RuntimeError as e:
            # cuda-bindings resolves entry points lazily and raises RuntimeError('Function "X" not
            # found') when libcuda does not export X: that is an old driver, not a failed call.
            if "not found" in str(e):
                raise DriverTooOldError(
                    f"the NVIDIA driver's libcuda does not export {op}: the CUDA checkpoint API needs "
                    f"driver >= {_MIN_DRIVER_BRANCH} ({e})"
                ) from e
            raise
        return result if isinstance(result, tuple) else (result,)

    def driver_version(self) -> int:
        """cuDriverGetVersion of the loaded driver, e.g. 13000 for CUDA 13.0."""
        self._ensure()
        return self._version

    def _describe(self, driver: Any, result: Any) -> str:
        return describe_result(driver, result)

    # ---- target checks ----

    def _check_target(self, op: str, pid: int) -> None:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid must be a positive int, got {pid!r}")
        tgid = processes.thread_group_id(pid, self._proc_root)
        if tgid is not None and tgid != pid:
            # The driver accepts any task id under /proc and acts on its process, which would checkpoint
            # a process nobody named (https://github.com/NVIDIA/cuda-checkpoint/issues/41).
            raise NotCudaProcessError(op, pid, "not a process", f"{pid} is a thread of process {tgid}")

    def _classify_unknown_target(self, op: str, pid: int, result: str, detail: str) -> CudaError:
        if not processes.pid_exists(pid, self._proc_root):
            return NotCudaProcessError(op, pid, result, "no such process")
        if result in _NOT_CUDA_RESULTS:
            return NotCudaProcessError(op, pid, result, "the driver has no CUDA state for this process")
        try:
            fds = processes.gpu_device_fds(pid, self._proc_root)
        except PermissionError:
            fds = None
        if fds == []:
            return NotCudaProcessError(op, pid, result, "it has no /dev/nvidia* device open")
        return CudaError(op, pid, result, detail)

    # ---- the API ----

    def state(self, pid: int) -> ProcessState:
        """The target's CUDA checkpoint state; NotCudaProcessError when it has no CUDA context."""
        op = "cuCheckpointProcessGetState"
        self._check_target(op, pid)
        driver = self._ensure()
        try:
            err, *rest = self._raw(driver, op, pid)
        except ValueError as e:
            # cuda-bindings before the fix of NVIDIA/cuda-python#561 turned the garbage output of a
            # failed call into a CUprocessState and raised ValueError, hiding the CUresult.
            raise self._classify_unknown_target(op, pid, "unknown CUresult", str(e)) from e
        name = result_name(err)
        if name != _SUCCESS:
            raise self._classify_unknown_target(op, pid, name, self._describe(driver, err))
        return self._to_state(driver, op, pid, rest[0] if rest else None)

    @staticmethod
    def _to_state(driver: Any, op: str, pid: int, value: Any) -> ProcessState:
        by_name = _STATE_BY_DRIVER_NAME.get(result_name(value))
        if by_name is not None:
            return by_name
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise CudaError(op, pid, "CUDA_SUCCESS", f"unknown CUprocessState {value!r}") from None
        enum = getattr(driver, "CUprocessState", None)
        for driver_name, state in _STATE_BY_DRIVER_NAME.items():
            member = getattr(enum, driver_name, None)
            if member is not None and int(member) == number:
                return state
        if enum is None and number in _STATE_BY_VALUE:
            return _STATE_BY_VALUE[number]
        raise CudaError(op, pid, "CUDA_SUCCESS", f"unknown CUprocessState {value!r}")

    def restore_thread_id(self, pid: int) -> int:
        """The tid of the driver's restore thread in the target (CRIU must not freeze it on restore)."""
        op = "cuCheckpointProcessGetRestoreThreadId"
        self._check_target(op, pid)
        driver = self._ensure()
        err, *rest = self._raw(driver, op, pid)
        name = result_name(err)
        if name != _SUCCESS:
            # Same classification as GetState: this call also has to find the target's CUDA state.
            raise self._classify_unknown_target(op, pid, name, self._describe(driver, err))
        return int(rest[0])

    def _transition(
        self,
        op: str,
        pid: int,
        expected: ProcessState,
        make_args: Callable[[Any], Any],
    ) -> None:
        current = self.state(pid)  # validates pid, initialises, raises NotCudaProcessError
        if current is not expected:
            raise WrongStateError(op, pid, current.value, expected.value)
        driver = self._ensure()
        err, *_ = self._raw(driver, op, pid, make_args(driver))
        name = result_name(err)
        if name == _SUCCESS:
            return
        detail = self._describe(driver, err)
        if name == _ILLEGAL_STATE:
            try:
                now = self.state(pid).value
            except CudaError:
                now = "unknown"
            raise WrongStateError(op, pid, now, expected.value, result=name)
        raise CudaError(op, pid, name, detail)

    def lock(self, pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
        """Block the target's CUDA API calls and wait for its submitted work (RUNNING -> LOCKED).

        `timeout_ms` bounds the wait for in-flight work; 0 means no timeout (can hang forever).
        """
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 0:
            raise ValueError(f"timeout_ms must be an int >= 0, got {timeout_ms!r}")

        def args(driver: Any) -> Any:
            a = driver.CUcheckpointLockArgs()
            a.timeoutMs = timeout_ms
            return a

        self._transition("cuCheckpointProcessLock", pid, ProcessState.RUNNING, args)

    def checkpoint(self, pid: int) -> None:
        """Copy the target's GPU memory to host memory and release its GPUs (LOCKED -> CHECKPOINTED)."""
        self._transition(
            "cuCheckpointProcessCheckpoint",
            pid,
            ProcessState.LOCKED,
            lambda driver: driver.CUcheckpointCheckpointArgs(),
        )

    def restore(self, pid: int, gpu_remap: Mapping[str, str] | None = None) -> None:
        """Re-acquire GPUs and copy memory back (CHECKPOINTED -> LOCKED).

        `gpu_remap` maps each checkpointed GPU's UUID to the UUID to restore onto; when given it must
        name every GPU the process had (the driver's rule). The pid must be the restored process's pid
        as the caller sees it.
        """
        remap = dict(gpu_remap or {})
        pairs = [(parse_gpu_uuid(old), parse_gpu_uuid(new)) for old, new in remap.items()]

        def args(driver: Any) -> Any:
            a = driver.CUcheckpointRestoreArgs()
            if pairs:
                _set_gpu_pairs(driver, a, pairs)
            return a

        self._transition("cuCheckpointProcessRestore", pid, ProcessState.CHECKPOINTED, args)

    def unlock(self, pid: int) -> None:
        """Let the target call CUDA again (LOCKED -> RUNNING)."""
        self._transition(
            "cuCheckpointProcessUnlock",
            pid,
            ProcessState.LOCKED,
            lambda driver: driver.CUcheckpointUnlockArgs(),
        )

    def suspend(self, pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> dict[str, float]:
        """lock + checkpoint; seconds per step as {"cuda_lock": s, "cuda_checkpoint": s}.

        When checkpoint fails the process is unlocked again, so a failed suspend leaves it running.
        """
        timings: dict[str, float] = {}
        t = time.perf_counter()
        self.lock(pid, timeout_ms)
        timings["cuda_lock"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            self.checkpoint(pid)
        except Exception:
            try:
                if self.state(pid) is ProcessState.LOCKED:
                    self.unlock(pid)
            except CudaError:
                pass  # the checkpoint error is the one worth reporting
            raise
        timings["cuda_checkpoint"] = time.perf_counter() - t
        return timings

    def resume(self, pid: int, gpu_remap: Mapping[str, str] | None = None) -> dict[str, float]:
        """restore + unlock; seconds per step as {"cuda_restore": s, "cuda_unlock": s}."""
        timings: dict[str, float] = {}
        t = time.perf_counter()
        self.restore(pid, gpu_remap)
        timings["cuda_restore"] = time.perf_counter() - t
        t = time.perf_counter()
        self.unlock(pid)
        timings["cuda_unlock"] = time.perf_counter() - t
        return timings


def _set_gpu_pairs(driver: Any, args: Any, pairs: list[tuple[bytes, bytes]]) -> None:
    """Fill CUcheckpointRestoreArgs.gpuPairs the way cuda-python's own cuda.core.checkpoint does.

    cuda-bindings' CUuuid wraps a pointer to 16 bytes (CUuuid(address)); assigning it to
    CUcheckpointGpuPair.oldUuid/newUuid copies those bytes into the pair, and assigning a list of
    pairs to gpuPairs copies them into memory the args object owns. So the ctypes buffers only need to
    live until the assignment.
    """
    missing = [s for s in _REMAP_SYMBOLS if not hasattr(driver, s)]
    if missing:
        raise DriverTooOldError(
            f"this cuda-python cannot remap GPUs on restore (missing {', '.join(missing)}): "
            f"upgrade cuda-python ({INSTALL_HINT})"
        )
    built = []
    for old, new in pairs:
        pair = driver.CUcheckpointGpuPair()
        old_buf = ctypes.create_string_buffer(old, 16)
        new_buf = ctypes.create_string_buffer(new, 16)
        pair.oldUuid = driver.CUuuid(ctypes.addressof(old_buf))
        pair.newUuid = driver.CUuuid(ctypes.addressof(new_buf))
        built.append(pair)
    args.gpuPairs = built
    args.gpuPairsCount = len(built)


def cuda_available() -> bool:
    """True when cuda-python imports and cuInit(0) succeeds, i.e. a driver and a GPU are there.

    Says nothing about the checkpoint API: a driver too old for it makes the first call raise
    DriverTooOldError, which is more useful to see than a skipped test.
    """
    try:
        driver = import_driver()
        err = CudaCheckpointer._raw(driver, "cuInit", 0)[0]
    except Exception:
        return False
    return result_name(err) == _SUCCESS
