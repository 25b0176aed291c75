"""CudaCheckpointer against the real driver, driving a separate torch worker (cuda_worker.py).

Plain Python so it runs with or without pytest: test_cuda_checkpoint.py wraps each scenario, and
`python -m tests.gpu.cuda_scenarios [WORKDIR [NAME...]]` runs them (all without names) and prints one
JSON report per scenario. Imports only the standard library and dynamo_snapshot.cuda (cuda-python,
nvidia-ml-py), but for two_processes, which drives the agent's own cuda_processes; the worker needs torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_snapshot.cuda import (
    CudaCheckpointer,
    CudaError,
    NotCudaProcessError,
    ProcessState,
    WrongStateError,
    gpu_device_fds,
    gpu_memory_by_pid,
    list_gpus,
)

WORKER = Path(__file__).with_name("cuda_worker.py")
WORKER_MIB = int(os.environ.get("CUDA_TEST_WORKER_MIB", "1024"))
START_TIMEOUT_S = 300.0
FINISH_TIMEOUT_S = 180.0


class ScenarioError(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ScenarioError(message)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    workdir: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "worker.log").read_text(errors="replace")[-4000:]
        return ""

    def finish(self, timeout: float = FINISH_TIMEOUT_S) -> dict[str, Any]:
        """Tell the worker to verify its GPU state; its verdict."""
        tmp = self.workdir / ".go.tmp"
        tmp.write_text("go")
        os.replace(tmp, self.workdir / "go")
        result = self.workdir / "result.json"
        deadline = time.monotonic() + timeout
        while not result.exists():
            if self.proc.poll() is not None:
                raise ScenarioError(
                    f"worker exited {self.proc.returncode} before its verdict:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ScenarioError(f"no verdict from the worker in {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)
        verdict: dict[str, Any] = json.loads(result.read_text())
        return verdict


@contextlib.contextmanager
def worker(
    workdir: Path,
    mib: int = WORKER_MIB,
    *,
    script: Path = WORKER,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Worker]:
    """``script`` (cuda_worker.py with ``mib``, or another with ``args``) started in ``workdir`` and
    ready; killed on the way out."""
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("ready.json", "result.json", "go", "prepare", "prepared.json"):  # a scenario run again
        (workdir / stale).unlink(missing_ok=True)
    with (workdir / "worker.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(workdir), *(args if args is not None else [str(mib)])],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        w = Worker(proc, workdir)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not (workdir / "ready.json").exists():
                if proc.poll() is not None:
                    raise ScenarioError(f"worker exited {proc.returncode} while starting:\n{w.log_tail()}")
                if time.monotonic() > deadline:
                    raise ScenarioError(f"worker not ready in {START_TIMEOUT_S:.0f}s:\n{w.log_tail()}")
                time.sleep(0.05)
            yield w
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)


@contextlib.contextmanager
def plain_process() -> Iterator[int]:
    """A live process that never touched CUDA."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(30)
    return proc.pid


def gpu_mib(pid: int) -> int:
    """The process's GPU memory as NVML reports it (0 when not listed or not reported)."""
    return gpu_memory_by_pid().get(pid, 0)


def used_mib() -> int:
    """GPU memory in use on the whole machine: the fallback when NVML gives no per-process figure."""
    return sum(g.memory_total_mib - g.memory_free_mib for g in list_gpus())


def expect(error: type[CudaError], call: Callable[[], object], what: str) -> CudaError:
    try:
        call()
    except error as e:
        return e
    except CudaError as e:
        raise ScenarioError(f"{what}: expected {error.__name__}, got {type(e).__name__}: {e}") from e
    raise ScenarioError(f"{what}: expected {error.__name__}, but it succeeded")


# ---- scenarios ------------------------------------------------------------------------------------


def full_cycle(workdir: Path) -> dict[str, Any]:
    """lock -> checkpoint (GPU memory released) -> restore -> unlock; data and graph bit-exact."""
    cp = CudaCheckpointer()
    report: dict[str, Any] = {"driver_version": cp.driver_version()}
    with worker(workdir) as w:
        pid = w.pid
        check(cp.state(pid) is ProcessState.RUNNING, f"fresh worker is {cp.state(pid)}")
        before, machine_before = gpu_mib(pid), used_mib()
        report["gpu_mib_before"] = before
        report["machine_used_mib_before"] = machine_before
        if before:  # NVML may give no per-process figure (virtualised GPUs); the machine total still moves
            check(before >= WORKER_MIB, f"NVML shows the worker using {before} MiB, expected >= {WORKER_MIB}")
        check(bool(gpu_device_fds(pid)), "the worker has no /dev/nvidia* open")
        tid = cp.restore_thread_id(pid)
        report["restore_thread_id"] = tid
        check(
            tid > 0 and Path(f"/proc/{pid}/task/{tid}").exists(),
            f"restore thread {tid} is not a thread of {pid}",
        )

        t = time.perf_counter()
        cp.lock(pid, timeout_ms=10_000)
        report["lock_s"] = round(time.perf_counter() - t, 4)
        check(cp.state(pid) is ProcessState.LOCKED, f"after lock: {cp.state(pid)}")

        t = time.perf_counter()
        cp.checkpoint(pid)
        report["checkpoint_s"] = round(time.perf_counter() - t, 4)
        check(cp.state(pid) is ProcessState.CHECKPOINTED, f"after checkpoint: {cp.state(pid)}")
        after, machine_after = gpu_mib(pid), used_mib()
        report["gpu_mib_checkpointed"] = after
        report["machine_used_mib_checkpointed"] = machine_after
        report["gpu_fds_checkpointed"] = gpu_device_fds(pid)
        check(after < 64, f"the checkpointed worker still uses {after} MiB of GPU memory")
        released = machine_before - machine_after
        check(
            released >= WORKER_MIB * 0.9,
            f"checkpoint released only {released} MiB on the machine ({machine_before} -> {machine_after})",
        )
        check(
            report["gpu_fds_checkpointed"] == [],
            f"checkpointed worker holds {report['gpu_fds_checkpointed']}",
        )

        t = time.perf_counter()
        cp.restore(pid)
        report["restore_s"] = round(time.perf_counter() - t, 4)
        check(cp.state(pid) is ProcessState.LOCKED, f"after restore: {cp.state(pid)}")
        t = time.perf_counter()
        cp.unlock(pid)
        report["unlock_s"] = round(time.perf_counter() - t, 4)
        check(cp.state(pid) is ProcessState.RUNNING, f"after unlock: {cp.state(pid)}")
        report["gpu_mib_restored"] = gpu_mib(pid)

        verdict = w.finish()
        report["verdict"] = verdict
        check(all(verdict.values()), f"worker after restore: {verdict}\n{w.log_tail()}")
    return report


def suspend_resume_with_remap(workdir: Path) -> dict[str, Any]:
    """suspend()/resume() and a restore through CUcheckpointGpuPair: every GPU mapped onto itself."""
    cp = CudaCheckpointer()
    remap = {g.uuid: g.uuid for g in list_gpus()}
    report: dict[str, Any] = {"remap": remap}
    with worker(workdir) as w:
        report["suspend"] = cp.suspend(w.pid)
        check(cp.state(w.pid) is ProcessState.CHECKPOINTED, f"after suspend: {cp.state(w.pid)}")
        try:
            report["resume"] = cp.resume(w.pid, remap)
        except CudaError as e:
            salvage = "not tried"
            if cp.state(w.pid) is ProcessState.CHECKPOINTED:
                try:
                    cp.resume(w.pid)
                    salvage = "a plain restore then worked"
                except CudaError as e2:
                    salvage = f"a plain restore then failed too: {e2}"
            raise ScenarioError(f"restore with an identity GPU remap failed: {e}; {salvage}") from e
        check(cp.state(w.pid) is ProcessState.RUNNING, f"after resume: {cp.state(w.pid)}")
        verdict = w.finish()
        report["verdict"] = verdict
        check(all(verdict.values()), f"worker after remapped restore: {verdict}\n{w.log_tail()}")
    return report


def not_cuda(workdir: Path) -> dict[str, Any]:
    """A process without CUDA, and a pid that does not exist, are NotCudaProcessError."""
    cp = CudaCheckpointer()
    report: dict[str, Any] = {}
    with plain_process() as pid:
        for name, call in (
            ("state", lambda: cp.state(pid)),
            ("lock", lambda: cp.lock(pid)),
            ("restore_thread_id", lambda: cp.restore_thread_id(pid)),
        ):
            e = expect(NotCudaProcessError, call, f"{name} of a sleeping process")
            report[f"plain_{name}"] = e.result
    gone = dead_pid()
    e = expect(NotCudaProcessError, lambda: cp.state(gone), "state of a pid that exited")
    check("no such process" in str(e), f"unexpected reason: {e}")
    report["dead_pid_state"] = e.result
    return report


def wrong_state(workdir: Path) -> dict[str, Any]:
    """Transitions from the wrong state raise WrongStateError and leave the worker intact."""
    cp = CudaCheckpointer()
    report: dict[str, Any] = {}
    with worker(workdir) as w:
        pid = w.pid
        for name, call in (
            ("checkpoint", lambda: cp.checkpoint(pid)),
            ("restore", lambda: cp.restore(pid)),
            ("unlock", lambda: cp.unlock(pid)),
        ):
            e = expect(WrongStateError, call, f"{name} of a running worker")
            check(isinstance(e, WrongStateError) and e.state == "running", f"{name}: {e}")
        check(cp.state(pid) is ProcessState.RUNNING, f"after refused calls: {cp.state(pid)}")

        threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if int(t.name) != pid]
        if threads:
            e = expect(NotCudaProcessError, lambda: cp.lock(threads[0]), "lock of a worker thread id")
            report["thread_id"] = str(e)

        cp.lock(pid)
        for name, call in (("lock", lambda: cp.lock(pid)), ("restore", lambda: cp.restore(pid))):
            e = expect(WrongStateError, call, f"{name} of a locked worker")
            check(isinstance(e, WrongStateError) and e.state == "locked", f"{name}: {e}")
        cp.unlock(pid)
        check(cp.state(pid) is ProcessState.RUNNING, f"after lock/unlock: {cp.state(pid)}")
        verdict = w.finish()
        report["verdict"] = verdict
        check(all(verdict.values()), f"worker after refused calls: {verdict}\n{w.log_tail()}")
    return report


def _bounded(call: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Run a raw driver call; "hung" if it does not return in time (a daemon thread cannot block exit)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except Exception as e:  # old bindings raise instead of returning the CUresult
            box.append(f"raised {e!r}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else "hung"


def _name(result: Any) -> Any:
    if isinstance(result, tuple):
        return [getattr(r, "name", repr(r)) for r in result]
    return getattr(result, "name", repr(result))


def driver_answers(workdir: Path) -> dict[str, Any]:
    """Diagnostics, asserting nothing: the raw CUresults behind the mapping, to confirm it."""
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    report: dict[str, Any] = {}
    with plain_process() as pid:
        report["GetState(sleep)"] = _name(_bounded(lambda: cu.cuCheckpointProcessGetState(pid)))
        report["GetRestoreThreadId(sleep)"] = _name(
            _bounded(lambda: cu.cuCheckpointProcessGetRestoreThreadId(pid))
        )
        lock_args = cu.CUcheckpointLockArgs()
        lock_args.timeoutMs = 1000
        report["Lock(sleep)"] = _name(_bounded(lambda: cu.cuCheckpointProcessLock(pid, lock_args)))
    gone = dead_pid()
    report["GetState(dead pid)"] = _name(_bounded(lambda: cu.cuCheckpointProcessGetState(gone)))
    cp = CudaCheckpointer()
    with worker(workdir, mib=64) as w:
        pid = w.pid
        # Not tried: Checkpoint of a running process. If the driver took it as lock+checkpoint, or
        # blocked, the diagnostic would cost more than the answer is worth.
        report["Unlock(running)"] = _name(
            _bounded(lambda: cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()))
        )
        state = cp.state(pid)
        report["state_after"] = state.value
        if state is ProcessState.CHECKPOINTED:
            cp.resume(pid)
        elif state is ProcessState.LOCKED:
            cp.unlock(pid)
        try:
            report["verdict"] = w.finish(timeout=60)
        except ScenarioError as e:
            report["verdict_error"] = str(e)[-1500:]
    return report


def two_processes(workdir: Path) -> dict[str, Any]:
    """Two CUDA processes of one worker, as a tensor-parallel worker's ranks (on one GPU here): the
    agent's suspend_cuda locks both before it checkpoints either and releases the GPU memory of both;
    resume_cuda restores and unlocks both; both bit-exact after."""
    import asyncio

    from dynamo_snapshot.agent.cuda_processes import resume_cuda, suspend_cuda

    cp = CudaCheckpointer()
    report: dict[str, Any] = {}
    with worker(workdir / "rank0") as w0, worker(workdir / "rank1") as w1:
        pids = [w0.pid, w1.pid]
        machine_before = used_mib()
        t = time.perf_counter()
        asyncio.run(suspend_cuda(cp, pids, 10_000))
        report["suspend_s"] = round(time.perf_counter() - t, 4)
        states = [cp.state(pid) for pid in pids]
        check(all(s is ProcessState.CHECKPOINTED for s in states), f"after suspend_cuda: {states}")
        released = machine_before - used_mib()
        report["released_mib"] = released
        check(released >= 2 * WORKER_MIB * 0.9, f"both checkpointed released only {released} MiB")
        check(not any(gpu_device_fds(pid) for pid in pids), "a checkpointed rank holds /dev/nvidia*")
        t = time.perf_counter()
        asyncio.run(resume_cuda(cp, pids, {}))
        report["resume_s"] = round(time.perf_counter() - t, 4)
        states = [cp.state(pid) for pid in pids]
        check(all(s is ProcessState.RUNNING for s in states), f"after resume_cuda: {states}")
        verdicts = [w0.finish(), w1.finish()]
        report["verdicts"] = verdicts
        check(all(all(v.values()) for v in verdicts), f"ranks after restore: {verdicts}")
    return report


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "full_cycle": full_cycle,
    "suspend_resume_with_remap": suspend_resume_with_remap,
    "not_cuda": not_cuda,
    "wrong_state": wrong_state,
    "driver_answers": driver_answers,
    "two_processes": two_processes,
}


def _by_name() -> dict[str, Callable[[Path], dict[str, Any]]]:
    """Every scenario by name, those of rank_scenarios (the ranks of a multi-GPU worker) too."""
    from tests.gpu import rank_scenarios

    return {
        **SCENARIOS,
        **rank_scenarios.SCENARIOS,
        **rank_scenarios.CRIU_SCENARIOS,
        **rank_scenarios.EXPLORATIONS,
    }


def main(argv: list[str]) -> int:
    base = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="cuda-scenarios-"))
    known = _by_name()
    chosen = argv[2:] or list(SCENARIOS)
    failed = 0
    for name, scenario in ((n, known[n]) for n in chosen):
        t = time.perf_counter()
        try:
            report = scenario(base / name)
            status = "PASS"
        except Exception as e:
            report = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            status = "FAIL"
            failed += 1
        report["seconds"] = round(time.perf_counter() - t, 2)
        print(f"{status} {name} {json.dumps(report, default=str)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
