"""Find the processes of a process tree that use an NVIDIA GPU, from /proc alone.

"Uses the GPU" means "has a /dev/nvidia* device open": every process with a CUDA context holds
/dev/nvidiactl and a /dev/nvidiaN (and usually /dev/nvidia-uvm). A process whose CUDA state has
been checkpointed holds none of them any more (measured on the H200: no /dev/nvidia fds left after
cuCheckpointProcessCheckpoint), so to find processes that are already suspended ask the driver
(CudaCheckpointer.state) for each pid of process_tree() instead.

Every function takes `proc_root`, so tests can point it at a directory laid out like /proc. Reading
another user's /proc/<pid>/fd needs root or CAP_SYS_PTRACE: PermissionError is raised, never
hidden, because "no GPU fds" would then be a guess.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

__all__ = [
    "GPU_DEVICE_PREFIX",
    "PROC",
    "children",
    "find_cuda_pids",
    "gpu_device_fds",
    "pid_exists",
    "ppid_from_stat",
    "process_tree",
    "thread_group_id",
    "uses_gpu",
]

PROC = Path("/proc")
GPU_DEVICE_PREFIX = "/dev/nvidia"


def pid_exists(pid: int, proc_root: Path = PROC) -> bool:
    return (proc_root / str(pid)).is_dir()


def thread_group_id(pid: int, proc_root: Path = PROC) -> int | None:
    """The Tgid of `pid` (the pid itself for a process, its process for a thread); None if unreadable."""
    try:
        text = (proc_root / str(pid) / "status").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Tgid:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def ppid_from_stat(stat: str) -> int | None:
    """The parent pid in the text of /proc/PID/stat; None where it is not well formed."""
    # comm (field 2) may hold spaces and parentheses; everything after the last ')' is well formed.
    rest = stat[stat.rfind(")") + 1 :].split()
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return None


def _children_by_scan(pid: int, proc_root: Path) -> list[int]:
    found = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue  # exited while scanning
        if ppid_from_stat(stat) == pid:
            found.append(int(entry.name))
    return sorted(found)


def children(pid: int, proc_root: Path = PROC) -> list[int]:
    """Direct children of `pid`, from every thread's task/<tid>/children.

    Kernels built without CONFIG_PROC_CHILDREN have no such file: then /proc is scanned for
    processes whose parent is `pid`. Returns [] when `pid` has exited.
    """
    task_dir = proc_root / str(pid) / "task"
    try:
        tasks = list(task_dir.iterdir())
    except FileNotFoundError:
        return []
    kids: set[int] = set()
    have_children_files = False
    for task in tasks:
        try:
            text = (task / "children").read_text(encoding="ascii")
        except FileNotFoundError:
            continue
        have_children_files = True
        kids.update(int(k) for k in text.split())
    if not have_children_files and tasks:
        return _children_by_scan(pid, proc_root)
    return sorted(kids)


def process_tree(root_pid: int, proc_root: Path = PROC) -> list[int]:
    """`root_pid` and all its descendants, parents before children.

    Raises ProcessLookupError when `root_pid` does not exist. The tree can change while it is read;
    callers that need a stable answer freeze it first (CRIU does).
    """
    if not pid_exists(root_pid, proc_root):
        raise ProcessLookupError(f"no process {root_pid} in {proc_root}")
    order: list[int] = []
    seen = {root_pid}
    queue = deque([root_pid])
    while queue:
        pid = queue.popleft()
        order.append(pid)
        for child in children(pid, proc_root):
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return order


def gpu_device_fds(pid: int, proc_root: Path = PROC) -> list[str]:
    """The /dev/nvidia* devices `pid` has open (sorted, each once); [] when it has exited."""
    fd_dir = proc_root / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except FileNotFoundError:
        return []
    devices = set()
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
        except FileNotFoundError:
            continue  # closed while listing
        if target.startswith(GPU_DEVICE_PREFIX):
            devices.add(target)
    return sorted(devices)


def uses_gpu(pid: int, proc_root: Path = PROC) -> bool:
    return bool(gpu_device_fds(pid, proc_root))


def find_cuda_pids(root_pid: int, proc_root: Path = PROC) -> list[int]:
    """The processes of the tree under `root_pid` (itself included) that have a GPU device open."""
    return [pid for pid in process_tree(root_pid, proc_root) if uses_gpu(pid, proc_root)]
