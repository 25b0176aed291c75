"""Bulk hashing in a helper process gives what hashing in the caller gives, errors included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.artifact import isolated
from dynamo_snapshot.fileio import HashJob, hash_files
from dynamo_snapshot.fileio import hashing as io


def _file(path: Path, nbytes: int) -> Path:
    path.write_bytes(os.urandom(nbytes))
    return path


def test_helper_is_another_process() -> None:
    assert isolated.warm_up().result(timeout=60) != os.getpid()


def test_big_jobs_hash_in_a_helper_with_the_same_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = [
        HashJob(src=_file(tmp_path / "a", 3 << 20), size=3 << 20, chunk_bytes=1 << 20),
        HashJob(src=_file(tmp_path / "b", 12345), size=12345, chunk_bytes=None),
    ]
    here = hash_files(jobs, parallel=4)

    def not_here(*args: object, **kwargs: object) -> None:
        raise AssertionError("hashed in the calling process")

    # The spawned helper imports io afresh: only hashing in this process meets the patch.
    monkeypatch.setattr(io, "_range_task", not_here)
    there = isolated.hash_files_isolated(jobs, parallel=4, min_bytes=0)
    assert [r.digests for r in there] == [r.digests for r in here]
    assert [r.stats.bytes for r in there] == [3 << 20, 12345]


def test_errors_come_back_from_the_helper(tmp_path: Path) -> None:
    jobs = [HashJob(src=tmp_path / "missing", size=4096, chunk_bytes=None)]
    with pytest.raises(FileNotFoundError):
        isolated.hash_files_isolated(jobs, min_bytes=0)


def test_small_jobs_stay_in_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pool() -> None:
        raise AssertionError("a small job must not start a helper")

    monkeypatch.setattr(isolated, "_get_pool", no_pool)
    jobs = [HashJob(src=_file(tmp_path / "s", 4096), size=4096, chunk_bytes=None)]
    assert isolated.hash_files_isolated(jobs)[0].stats.bytes == 4096


def test_a_dead_helper_falls_back_to_the_caller(tmp_path: Path) -> None:
    pool = isolated._get_pool()
    dying = pool.submit(os._exit, 1)  # kills its helper: the pool is broken from here on
    with pytest.raises(BrokenProcessPool):
        dying.result(timeout=60)  # once the pool knows it; before, another helper may still take a job
    jobs = [HashJob(src=_file(tmp_path / "d", 1 << 20), size=1 << 20, chunk_bytes=None)]
    want = hash_files(jobs)[0].digests
    assert isolated.hash_files_isolated(jobs, min_bytes=0)[0].digests == want
    assert isolated._get_pool() is not pool  # the next call gets a fresh one
    assert isolated.hash_files_isolated(jobs, min_bytes=0)[0].digests == want


def test_helpers_exit_when_their_process_is_killed() -> None:
    script = (
        "import time\n"
        "from dynamo_snapshot.artifact import isolated\n"
        "print(isolated.warm_up().result(timeout=60), flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        helper = int(parent.stdout.readline())
        assert Path(f"/proc/{helper}").exists()
    finally:
        parent.kill()  # SIGKILL: no atexit, no pool shutdown
        parent.wait()
    deadline = time.monotonic() + 15
    while pid_running(helper):
        assert time.monotonic() < deadline, "the helper outlived the process that started it"
        time.sleep(0.1)
