"""What a process tree holds, read from the real /proc of processes started here: the files CRIU opens
again at restore, so a container's writable layer writes them first."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime.held_files import held_paths, mapped_paths

HOLDER = """
import ctypes, mmap, os, sys
mapped = open(sys.argv[1], "rb")
view = mmap.mmap(mapped.fileno(), 0, prot=mmap.PROT_READ)
mapped.close()
kept = open(sys.argv[2], "a")
os.chdir(sys.argv[3])
os.unlink(sys.argv[4])  # open, then deleted: CRIU carries it in its images
if sys.argv[5] == "watch":
    ctypes.CDLL(None, use_errno=True).inotify_init()
print("ready", flush=True)
sys.stdin.read()
"""


Holder = Callable[[str], "subprocess.Popen[str]"]
FILES = ("mapped.so", "log.txt", "work", "gone.txt")


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    """A process holding a mapped file, an open one, a working directory and a deleted file."""
    started: list[subprocess.Popen[str]] = []

    def start(mode: str) -> subprocess.Popen[str]:
        for name in ("mapped.so", "log.txt", "gone.txt"):
            (tmp_path / name).write_text(name)
        (tmp_path / "work").mkdir(exist_ok=True)
        ghost = open(tmp_path / "gone.txt")  # noqa: SIM115 (inherited by the holder, closed below)
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, *(str(tmp_path / n) for n in FILES), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=[ghost.fileno()],
        )  # fmt: skip
        ghost.close()
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_trees_mapped_and_open_files_and_its_directory(holder: Holder, tmp_path: Path) -> None:
    proc = holder("plain")
    held = held_paths([proc.pid])
    assert held is not None
    assert {str(tmp_path / "mapped.so"), str(tmp_path / "log.txt"), str(tmp_path / "work")} <= held
    assert str(Path(sys.executable).resolve()) in held
    assert not any("gone.txt" in p for p in held)
    assert not any(p.startswith(("pipe:", "socket:", "[")) for p in held)


def test_a_watch_makes_every_file_needed(holder: Holder) -> None:
    proc = holder("watch")
    assert held_paths([proc.pid]) is None


def test_a_process_that_ended_holds_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    assert held_paths([int(done.stdout)]) == set()


def test_maps_lines() -> None:
    maps = (
        "55d0c000-55d0d000 r--p 00000000 08:01 1234   /usr/bin/python3.11\n"
        "7f00-7f01 r-xp 00001000 00:2a 99   /app/cache/k1/launcher with space.so\n"
        "7f01-7f02 rw-p 00000000 00:00 0 \n"
        "7f02-7f03 rw-s 00000000 00:05 77   /dev/zero (deleted)\n"
        "7ffd-7ffe rw-p 00000000 00:00 0   [stack]\n"
    )
    assert list(mapped_paths(maps)) == ["/usr/bin/python3.11", "/app/cache/k1/launcher with space.so"]


def test_a_mapped_path_with_a_newline_is_given_back_whole(tmp_path: Path) -> None:
    odd = tmp_path / "kernel\nlauncher.so"
    odd.write_bytes(b"\x7fELF")
    mapper = (
        "import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
        "f.close(); print('ready', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", mapper, str(odd)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        held = held_paths([proc.pid])
        assert held is not None
        assert str(odd) in held
    finally:
        proc.kill()
        proc.wait()
