"""The standby placeholder as a restore pod's container runs it: the first process of a PID namespace
(``unshare --pid``, as root), adopting the processes a restore puts into the namespace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.workload import standby_requested
from dynamo_snapshot.workload.standby import RESTORE_FAILED_EXIT
from tests.helpers.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
STANDBY = "import sys; from pathlib import Path; from dynamo_snapshot.workload.standby import run_standby; "
STANDBY += "sys.exit(run_standby(Path(sys.argv[1])))"


@pytest.fixture
def placeholder(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    if os.geteuid() != 0:
        pytest.skip("a PID namespace of its own needs root")
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", STANDBY, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(REPO), "POD_NAME": "standby-pod"},
    )
    wait_for(lambda: (tmp_path / protocol.FILE_RESTORE_STANDBY).is_file(), within=20, what="restore-standby")
    yield proc
    proc.kill()
    proc.wait()


def _first_process_of_namespace(unshare_pid: int) -> int:
    children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _put_into_namespace(standby: int, script: str) -> None:
    """Start `script` in the standby's PID namespace and leave it orphaned there, as CRIU leaves the
    restored tree: its parent exits at once, so the namespace's first process adopts it."""
    subprocess.run(
        ["nsenter", f"--pid=/proc/{standby}/ns/pid", "--", "sh", "-c", f"({script}) & exit 0"], check=True
    )


def test_standby_says_it_waits_then_ends_with_the_adopted_worker(
    placeholder: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    said = json.loads((tmp_path / protocol.FILE_RESTORE_STANDBY).read_text())
    assert said["pid"] == 1, "the placeholder is the first process of the container's PID namespace"
    context = json.loads((tmp_path / protocol.FILE_RESTORE_CONTEXT).read_text())
    assert set(context["env"]) == protocol.RESTORE_CONTEXT_ENV_NAMES
    assert context["env"]["POD_NAME"] == "standby-pod"  # this container's value
    assert context["env"]["DYN_SYSTEM_PORT"] is None  # unset here: null, so a stale value is cleared
    standby = _first_process_of_namespace(placeholder.pid)
    time.sleep(0.5)
    assert placeholder.poll() is None, "with nothing restored yet it waits"
    _put_into_namespace(standby, "sleep 0.5; exit 7")
    assert placeholder.wait(timeout=20) == 7, "it ends with the restored worker's status"


def test_sigterm_goes_to_the_restored_worker(placeholder: subprocess.Popen[bytes]) -> None:
    standby = _first_process_of_namespace(placeholder.pid)
    _put_into_namespace(standby, "exec sleep 300")
    time.sleep(0.3)
    os.kill(standby, signal.SIGTERM)
    assert placeholder.wait(timeout=20) == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({protocol.ENV_RESTORE_STANDBY: "1"}, True),
        ({protocol.ENV_RESTORE_STANDBY_DYNAMO: "1"}, True),
        ({protocol.ENV_RESTORE_STANDBY: "0"}, False),
        ({}, False),
    ],
)
def test_standby_is_asked_for_by_either_name(env: dict[str, str], expected: bool) -> None:
    assert standby_requested(env) is expected


def _standby(ctl: Path, within: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", STANDBY, str(ctl)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=within,
    )


def test_a_standby_started_after_the_pods_restore_failed_exits_saying_why(tmp_path: Path) -> None:
    """A later container of a pod whose restore failed (the agent left restore-failed in the control dir)
    waits for no restore: it exits, naming the agent's reason, and writes no restore-standby."""
    (tmp_path / protocol.FILE_RESTORE_FAILED).write_text(json.dumps({"message": "CRIU restore failed: boom"}))
    done = _standby(tmp_path, within=20)
    assert done.returncode == RESTORE_FAILED_EXIT != 0
    assert "this pod's restore failed (CRIU restore failed: boom)" in done.stdout
    assert not (tmp_path / protocol.FILE_RESTORE_STANDBY).exists()


@pytest.mark.parametrize("plant", ["fifo", "symlink", "garbage"])
def test_restore_failed_is_read_only_as_a_regular_file(tmp_path: Path, plant: str) -> None:
    """The control dir is the pod's: a fifo there must not hang the start, a link is not followed, and
    an unreadable body still counts as the agent's word (with no reason)."""
    target = tmp_path / protocol.FILE_RESTORE_FAILED
    if plant == "fifo":
        os.mkfifo(target)
    elif plant == "symlink":
        elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
        elsewhere.write_text(json.dumps({"message": "not the agent's"}))
        target.symlink_to(elsewhere)
    else:
        target.write_bytes(b"\xff not json")
    if plant == "garbage":
        done = _standby(tmp_path, within=20)
        assert done.returncode == RESTORE_FAILED_EXIT
        assert "(no reason given)" in done.stdout
        return
    # No restore-failed counts: the standby waits as usual, saying so.
    proc = subprocess.Popen(
        [sys.executable, "-c", STANDBY, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        wait_for(
            lambda: (tmp_path / protocol.FILE_RESTORE_STANDBY).is_file(), within=20, what="restore-standby"
        )
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
