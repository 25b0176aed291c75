"""Which first process of a destination container counts as an inert placeholder, read from /proc of
real processes: a program that does nothing, alone."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dynamo_snapshot.agent.runtime.process_tree import inert_placeholder


@contextmanager
def _running(*argv: str) -> Iterator[int]:
    proc = subprocess.Popen(argv)
    try:
        time.sleep(0.3)  # exec'd, and a shell's child started
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_sleep_alone_is_inert() -> None:
    with _running("sleep", "30") as pid:
        assert inert_placeholder(pid)


def test_a_shell_that_execs_sleep_is_inert_once_it_has() -> None:
    with _running("/bin/sh", "-c", "exec sleep 30") as pid:
        assert inert_placeholder(pid)


def test_a_shell_running_a_child_is_not() -> None:
    with _running("/bin/sh", "-c", "sleep 30; true") as pid:
        assert not inert_placeholder(pid)


def test_a_worker_is_not() -> None:
    with _running(sys.executable, "-c", "import time; time.sleep(30)") as pid:
        assert not inert_placeholder(pid)


def test_a_process_gone_is_not() -> None:
    with _running("sleep", "30") as pid:
        pass
    assert not inert_placeholder(pid)
