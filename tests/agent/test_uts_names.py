"""Setting a restored worker's host and domain name in its UTS namespace, from a thread of its own."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from dynamo_snapshot.agent.runtime.base import WorkloadRuntimeError
from dynamo_snapshot.agent.runtime.uts_names import set_uts_names, uts_names

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a UTS namespace of its own needs root")


@pytest.fixture
def in_own_uts() -> Iterator[int]:
    proc = subprocess.Popen(["unshare", "--uts", "sleep", "60"])
    try:
        # unshare execs sleep once the namespace is made: wait for that.
        for _ in range(200):
            if os.readlink(f"/proc/{proc.pid}/ns/uts") != os.readlink("/proc/self/ns/uts"):
                break
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _names(pid: int) -> list[str]:
    names = ["/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname"]
    argv = ["nsenter", f"--uts=/proc/{pid}/ns/uts", "cat", *names]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_names_are_set_in_the_target_namespace_only(in_own_uts: int) -> None:
    ours = _names(os.getpid())
    set_uts_names(in_own_uts, "restore-pod-7", "example.internal")
    assert _names(in_own_uts) == ["restore-pod-7", "example.internal"]
    assert uts_names(in_own_uts) == ("restore-pod-7", "example.internal")
    assert list(uts_names(os.getpid())) == ours
    assert _names(os.getpid()) == ours
    # Again from the same process: no thread of it stayed in the other namespace.
    set_uts_names(in_own_uts, "restore-pod-8", "(none)")
    assert _names(in_own_uts) == ["restore-pod-8", "(none)"]
    assert _names(os.getpid()) == ours


def test_a_process_gone_is_a_clear_error() -> None:
    with pytest.raises(WorkloadRuntimeError, match=r"host name \(pid 999999999\): .*No such file"):
        set_uts_names(999_999_999, "x", "y")
    with pytest.raises(WorkloadRuntimeError, match=r"No such file"):
        uts_names(999_999_999)
