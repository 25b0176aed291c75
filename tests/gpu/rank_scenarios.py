"""The ranks of a multi-GPU worker against the real driver, CRIU and NCCL: several CUDA
processes in one tree through one CRIU dump, and a torch NCCL worker's communicator around the
checkpoint. Run by name through `python -m tests.gpu.cuda_scenarios WORKDIR NAME...`; the ones in
SCENARIOS and CRIU_SCENARIOS are also tests (test_cuda_checkpoint.py)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynamo_snapshot.cuda import CudaCheckpointer
from tests.gpu.cuda_scenarios import (
    FINISH_TIMEOUT_S,
    START_TIMEOUT_S,
    WORKER,
    WORKER_MIB,
    ScenarioError,
    Worker,
    check,
    worker,
)

_PR_SET_CHILD_SUBREAPER = 36


def _reap(pids: list[int], within: float = 30.0) -> None:
    """Wait until each of ``pids`` is gone, reaping those that became this process's children."""
    deadline = time.monotonic() + within
    for pid in pids:
        while os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            check(time.monotonic() < deadline, f"process {pid} still there after the dump")
            time.sleep(0.02)


def two_processes_criu(workdir: Path) -> dict[str, Any]:
    """Two CUDA processes in one tree, as a tensor-parallel worker's ranks under its launcher: the
    agent's suspend_cuda on both, one CRIU dump of the tree (which ends it), a restore of the tree as new
    processes, resume_cuda on the CUDA processes found in it; both ranks bit-exact after."""
    import asyncio

    from dynamo_snapshot.agent.cuda_processes import checkpointed_pids, resume_cuda, suspend_cuda
    from dynamo_snapshot.criu import Criu

    cp, criu = CudaCheckpointer(), Criu()
    # The ranks outlive their launcher for a moment once the dump kills the tree; as a subreaper this
    # process reaps them, so that their pids are free for the restore (CRIU restores the same pids).
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    ranks = [workdir / "rank0", workdir / "rank1"]
    for d in ranks:
        d.mkdir(parents=True, exist_ok=True)
    launcher = " & ".join(f"{sys.executable} {WORKER} {d} {WORKER_MIB} > {d}/worker.log 2>&1" for d in ranks)
    report: dict[str, Any] = {}
    root = subprocess.Popen(
        ["sh", "-c", f"{launcher} & wait"], stdin=subprocess.DEVNULL, start_new_session=True
    )
    restored = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all((d / "ready.json").exists() for d in ranks):
            check(root.poll() is None and time.monotonic() < deadline, "the ranks did not start")
            time.sleep(0.05)
        pids = [json.loads((d / "ready.json").read_text())["pid"] for d in ranks]
        t = time.perf_counter()
        asyncio.run(suspend_cuda(cp, pids, 10_000))
        report["suspend_s"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        dumped = asyncio.run(criu.dump(root.pid, workdir / "images", log_dir=workdir / "logs"))
        report["dump_s"] = round(time.perf_counter() - t, 4)
        report["image_bytes"] = dumped.image_bytes
        root.wait(30)
        _reap(pids)
        t = time.perf_counter()
        restored = asyncio.run(criu.restore(workdir / "images", log_dir=workdir / "logs"))
        found = asyncio.run(checkpointed_pids(cp, restored.pid))
        check(sorted(found) == sorted(pids), f"CUDA processes in the restored tree: {found}, not {pids}")
        asyncio.run(resume_cuda(cp, found, {}))
        report["restore_s"] = round(time.perf_counter() - t, 4)
        for d in ranks:
            (d / "go").write_text("go")
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while not all((d / "result.json").exists() for d in ranks):
            check(time.monotonic() < deadline, "no verdict from the restored ranks")
            time.sleep(0.05)
        verdicts = [json.loads((d / "result.json").read_text()) for d in ranks]
        report["verdicts"] = verdicts
        check(all(all(v.values()) for v in verdicts), f"ranks after the restore: {verdicts}")
        return report
    finally:
        for pid in (root.pid, restored.pid if restored else None):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


NCCL_WORKER = Path(__file__).with_name("nccl_worker.py")
# What upstream runs multi-GPU workers under a checkpoint with (docs/workload-contract.md).
NCCL_ENV = {"NCCL_CUMEM_HOST_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _prepare(w: Worker, mode: str, report: dict[str, Any]) -> None:
    """The NCCL worker ready; in ``teardown`` mode also its group destroyed, as before ready-for-snapshot.
    ``report`` gets what it said and the sockets it holds then."""
    report["worker"] = json.loads((w.workdir / "ready.json").read_text())
    report["sockets_live"] = _sockets(w.pid)
    if mode != "teardown":
        return
    (w.workdir / "prepare").write_text("")
    deadline = time.monotonic() + 60
    while not (w.workdir / "prepared.json").exists():
        check(w.proc.poll() is None, f"worker exited tearing down:\n{w.log_tail()}")
        check(time.monotonic() < deadline, f"no teardown in 60 s:\n{w.log_tail()}")
        time.sleep(0.02)
    report["teardown"] = json.loads((w.workdir / "prepared.json").read_text())
    report["sockets_after_teardown"] = _sockets(w.pid)


def _recreated(report: dict[str, Any], failed: str) -> dict[str, Any]:
    """``report`` when the checkpoint went through (no ``failed`` entry) and the re-created group's
    all-reduce and the data were right after the restore; ScenarioError otherwise."""
    check(failed not in report, f"checkpoint after the teardown failed: {report}")
    check("verdict" in report, f"no verdict after the restore: {report}")
    verdict = report["verdict"]
    check(verdict["all_reduce_ok"] and verdict["data_ok"], f"after restore: {verdict}")
    return report


def _nccl_cycle(workdir: Path, mode: str) -> dict[str, Any]:
    """A one-rank NCCL worker through the agent's suspend_cuda and resume_cuda, its communicator torn
    down before (``teardown``) or left as it is (``live``)."""
    import asyncio

    from dynamo_snapshot.agent.cuda_processes import resume_cuda, suspend_cuda

    cp = CudaCheckpointer()
    report: dict[str, Any] = {}
    with worker(workdir, script=NCCL_WORKER, args=[mode], env=NCCL_ENV) as w:
        _prepare(w, mode, report)
        t = time.perf_counter()
        try:
            asyncio.run(suspend_cuda(cp, [w.pid], 10_000))
        except Exception as e:
            report["suspend_error"] = f"{type(e).__name__}: {e}"
            return report
        report["suspend_s"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        asyncio.run(resume_cuda(cp, [w.pid], {}))
        report["resume_s"] = round(time.perf_counter() - t, 4)
        try:
            report["verdict"] = w.finish(timeout=60)
        except ScenarioError as e:
            report["verdict_error"] = str(e)[-1500:]
    return report


def _nccl_criu_cycle(workdir: Path, mode: str) -> dict[str, Any]:
    """_nccl_cycle through CRIU, as the agent checkpoints a worker: CUDA suspended, the process dumped
    (and gone), restored from the images as a new process, CUDA resumed in it."""
    import asyncio

    from dynamo_snapshot.agent.cuda_processes import resume_cuda, suspend_cuda
    from dynamo_snapshot.criu import Criu

    cp, criu = CudaCheckpointer(), Criu()
    report: dict[str, Any] = {}
    restored_pid = None
    try:
        with worker(workdir, script=NCCL_WORKER, args=[mode], env=NCCL_ENV) as w:
            _prepare(w, mode, report)
            asyncio.run(suspend_cuda(cp, [w.pid], 10_000))
            t = time.perf_counter()
            try:
                asyncio.run(criu.dump(w.pid, workdir / "images", log_dir=workdir / "logs"))
            except Exception as e:
                report["dump_error"] = f"{type(e).__name__}: {e}"[-1500:]
                return report
            report["dump_s"] = round(time.perf_counter() - t, 4)
            w.proc.wait(30)
        t = time.perf_counter()
        restored = asyncio.run(criu.restore(workdir / "images", log_dir=workdir / "logs"))
        restored_pid = restored.pid
        asyncio.run(resume_cuda(cp, [restored_pid], {}))
        report["restore_s"] = round(time.perf_counter() - t, 4)
        (workdir / "go").write_text("go")
        deadline = time.monotonic() + 60
        while not (workdir / "result.json").exists():
            if time.monotonic() > deadline or not os.path.exists(f"/proc/{restored_pid}"):
                report["verdict_error"] = (workdir / "worker.log").read_text(errors="replace")[-1500:]
                return report
            time.sleep(0.05)
        report["verdict"] = json.loads((workdir / "result.json").read_text())
        return report
    finally:
        if restored_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(restored_pid, signal.SIGKILL)


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def _sockets(pid: int) -> list[str]:
    """The process's open sockets: protocol, and for TCP the state and addresses (what CRIU must dump)."""
    tcp: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                tcp[f[9]] = f"{_TCP_STATES.get(f[3], f[3])} {f[1]} -> {f[2]}"
    found = []
    for fd in sorted(Path(f"/proc/{pid}/fd").iterdir(), key=lambda p: int(p.name)):
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:"):
                proto = os.getxattr(fd, "system.sockprotoname").decode().rstrip("\0")
                found.append(f"{fd.name} {proto} {tcp.get(target[8:-1], '')}".rstrip())
    return found


def nccl_recreated_criu(workdir: Path) -> dict[str, Any]:
    """nccl_recreated through a CRIU dump and restore: the restored process re-creates its group."""
    return _recreated(_nccl_criu_cycle(workdir, "teardown"), "dump_error")


def nccl_recreated(workdir: Path) -> dict[str, Any]:
    """The multi-GPU contract on one rank: the worker destroys its NCCL process group before the CUDA
    checkpoint and re-creates it on a fresh store after the restore; its collectives and data are right."""
    return _recreated(_nccl_cycle(workdir, "teardown"), "suspend_error")


def nccl_live(workdir: Path) -> dict[str, Any]:
    """What the CUDA checkpoint makes of a live NCCL communicator (one rank): reported, not judged."""
    return _nccl_cycle(workdir, "live")


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {"nccl_recreated": nccl_recreated}
# These need CRIU too (test_cuda_checkpoint.py skips them without one).
CRIU_SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {"two_processes_criu": two_processes_criu}
# Run by name only: they report, they do not judge (nccl_recreated_criu needs a CRIU that dumps TCP
# sockets on the kernel it runs on, see docs/workload-contract.md).
EXPLORATIONS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "nccl_live": nccl_live,
    "nccl_live_criu": lambda workdir: _nccl_criu_cycle(workdir, "live"),
    "nccl_recreated_criu": nccl_recreated_criu,
}
