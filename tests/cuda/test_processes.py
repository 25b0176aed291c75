"""Process trees and GPU device fds, from a directory laid out like /proc and from the real /proc."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_snapshot.cuda import children, find_cuda_pids, gpu_device_fds, process_tree, uses_gpu
from dynamo_snapshot.cuda.processes import thread_group_id
from tests.cuda.fakes import make_proc


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """1 -> 100 (launcher, threads 100 and 101) -> {200 (GPU), 300 -> 400 (GPU, uvm only)}, 500 elsewhere."""
    root = tmp_path / "proc"
    make_proc(root, 1, ppid=0, tasks={1: [100, 500]})
    make_proc(root, 100, tasks={100: [200], 101: [300]}, fds={0: "/dev/null", 1: "pipe:[123]"})
    make_proc(root, 200, ppid=100, fds={3: "/dev/nvidiactl", 4: "/dev/nvidia0", 5: "/dev/nvidia0", 6: "/x/y"})
    make_proc(root, 300, ppid=100, tasks={300: [400]}, fds={0: "socket:[9]"})
    make_proc(root, 400, ppid=300, fds={7: "/dev/nvidia-uvm"})
    make_proc(root, 500, ppid=1, fds={3: "/dev/nvidia1"})
    (root / "self").mkdir()  # non-numeric entries are ignored
    return root


def test_children_merge_every_thread(tree: Path) -> None:
    assert children(100, tree) == [200, 300]
    assert children(400, tree) == []
    assert children(12345, tree) == []  # exited


def test_process_tree_is_parents_first(tree: Path) -> None:
    assert process_tree(100, tree) == [100, 200, 300, 400]
    assert process_tree(400, tree) == [400]
    with pytest.raises(ProcessLookupError):
        process_tree(12345, tree)


def test_gpu_fds_and_cuda_pids(tree: Path) -> None:
    assert gpu_device_fds(200, tree) == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert gpu_device_fds(400, tree) == ["/dev/nvidia-uvm"]
    assert gpu_device_fds(300, tree) == []
    assert gpu_device_fds(12345, tree) == []
    assert uses_gpu(200, tree)
    assert not uses_gpu(100, tree)
    assert find_cuda_pids(100, tree) == [200, 400]  # not 500: another tree


def test_children_without_proc_children_files_scans_ppids(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    for pid, ppid in ((10, 1), (11, 10), (12, 10), (13, 11), (14, 99)):
        make_proc(root, pid, ppid=ppid, children_files=False)
    assert children(10, root) == [11, 12]
    assert process_tree(10, root) == [10, 11, 12, 13]


def test_thread_group_id(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    make_proc(root, 30)
    make_proc(root, 31, tgid=30)
    assert thread_group_id(30, root) == 30
    assert thread_group_id(31, root) == 30
    assert thread_group_id(32, root) is None


@pytest.fixture
def real_tree() -> Iterator[subprocess.Popen[bytes]]:
    # A child that has a grandchild: sh -> sleep.
    p = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        yield p
    finally:
        os.killpg(p.pid, 9)
        p.wait()


def test_real_proc(real_tree: subprocess.Popen[bytes]) -> None:
    mine = process_tree(os.getpid())
    assert mine[0] == os.getpid()
    assert real_tree.pid in mine
    sub = process_tree(real_tree.pid)
    assert len(sub) == 2
    assert sub[0] == real_tree.pid
    assert real_tree.pid in children(os.getpid())
    assert thread_group_id(os.getpid()) == os.getpid()
    if not list(Path("/dev").glob("nvidia*")):
        assert find_cuda_pids(os.getpid()) == []


def test_real_proc_fds_see_an_open_file(tmp_path: Path) -> None:
    # The same readlink path the GPU check uses, on a file we know is open.
    target = tmp_path / "open-me"
    target.write_text("x")
    with target.open():
        links = {os.readlink(f) for f in Path(f"/proc/{os.getpid()}/fd").iterdir() if f.is_symlink()}
    assert str(target) in links
