"""The agent's start-up check of its own privileges: the capabilities CRIU needs and the node's PIDs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dynamo_snapshot.agent.privileges import (
    CAPABILITY_BITS,
    OTHER_USER_CAPABILITIES,
    REQUIRED_CAPABILITIES,
    PrivilegeError,
    check_privileges,
    missing_capabilities,
    sees_host_pids,
    worker_needs,
)
from dynamo_snapshot.agent.runtime.base import proc_stat

ALL = (1 << (max(CAPABILITY_BITS.values()) + 1)) - 1


def _status(tmp_path: Path, cap_eff: int, uid: int = 0) -> Path:
    path = tmp_path / "status"
    path.write_text(
        f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        f"CapPrm:\t{ALL:016x}\nCapEff:\t{cap_eff:016x}\nCapBnd:\t{ALL:016x}\n"
    )
    return path


def _without(*names: str) -> int:
    mask = ALL
    for name in names:
        mask &= ~(1 << CAPABILITY_BITS[name])
    return mask


def _runc_state(root: Path, ident: str, pid: int, start: int) -> None:
    (root / ident).mkdir(parents=True)
    (root / ident / "state.json").write_text(
        json.dumps({"id": ident, "init_process_pid": pid, "init_process_start": start})
    )


def test_root_on_this_machine_holds_the_set() -> None:
    # The host-process agents of the other tests run as root here; /proc/self/status is the real one.
    # Raises when root here lacks a required capability; the rest is what it lacks for other users.
    assert set(check_privileges(runc_root=None)) <= set(OTHER_USER_CAPABILITIES)


def test_every_capability_asked_for_is_a_linux_one() -> None:
    assert set(REQUIRED_CAPABILITIES) | set(OTHER_USER_CAPABILITIES) <= set(CAPABILITY_BITS)
    assert not set(REQUIRED_CAPABILITIES) & set(OTHER_USER_CAPABILITIES)
    assert missing_capabilities(ALL) == []


def test_a_missing_capability_is_named_with_its_use_and_the_whole_set(tmp_path: Path) -> None:
    assert missing_capabilities(_without("SYS_TIME", "NET_ADMIN", "KILL")) == ["NET_ADMIN", "SYS_TIME"]
    with pytest.raises(PrivilegeError) as e:
        check_privileges(runc_root=None, status_path=_status(tmp_path, _without("SYS_TIME")))
    message = str(e.value)
    assert "CAP_SYS_TIME (" in message
    assert "time namespace" in message
    assert "CAP_KILL" not in message
    assert json.dumps(list(REQUIRED_CAPABILITIES)) in message


def test_capabilities_for_other_users_workers_are_only_a_warning(tmp_path: Path) -> None:
    status = _status(tmp_path, _without("SYS_RESOURCE", "SYS_PTRACE", "SYS_MODULE", "BPF"))
    assert check_privileges(runc_root=None, status_path=status) == ["SYS_RESOURCE", "SYS_PTRACE"]
    only_required = sum(1 << CAPABILITY_BITS[name] for name in REQUIRED_CAPABILITIES)
    lacking = check_privileges(runc_root=None, status_path=_status(tmp_path, only_required))
    assert lacking == list(OTHER_USER_CAPABILITIES)


def test_a_container_of_this_pid_namespace_proves_the_node_pids_are_seen(tmp_path: Path) -> None:
    me = proc_stat(os.getpid())
    assert me is not None
    _runc_state(tmp_path, "a" * 64, 999_999_999, 1)  # a container gone or of another namespace
    _runc_state(tmp_path, "b" * 64, os.getpid(), me.start_time)
    assert sees_host_pids(tmp_path) is True
    check_privileges(runc_root=tmp_path, status_path=_status(tmp_path, ALL))


def test_containers_whose_processes_are_not_here_mean_no_host_pid(tmp_path: Path) -> None:
    me = proc_stat(os.getpid())
    assert me is not None
    # The same pid with another start time: what a pod's own PID namespace shows for a node pid.
    _runc_state(tmp_path, "c" * 64, os.getpid(), me.start_time + 1)
    _runc_state(tmp_path, "d" * 64, 999_999_999, 1)
    assert sees_host_pids(tmp_path) is False
    with pytest.raises(PrivilegeError, match="hostPID: true") as e:
        check_privileges(runc_root=tmp_path, status_path=_status(tmp_path, _without("SYS_TIME")))
    assert "CAP_SYS_TIME" in str(e.value)  # every problem at once


def test_no_container_to_tell_by_is_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "e" / "state.json").parent.mkdir()
    (tmp_path / "e" / "state.json").write_text("{not json")
    assert sees_host_pids(tmp_path) is None
    assert sees_host_pids(tmp_path / "absent") is None
    check_privileges(runc_root=tmp_path, status_path=_status(tmp_path, ALL))


def _held(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("CapPrm:"))
    return int(line.split()[1], 16)


def test_a_worker_holding_no_more_than_the_agent_can_be_checkpointed(tmp_path: Path) -> None:
    # This test's own process as the worker, an agent of the same user holding at least as much.
    me = os.getpid()
    assert worker_needs([me], _status(tmp_path, _held(me) | 1 << CAPABILITY_BITS["SYS_ADMIN"])) is None
    assert worker_needs([999_999_999]) is None  # a process gone is CRIU's to report


def test_a_worker_holding_a_capability_the_agent_lacks_is_refused_by_name(tmp_path: Path) -> None:
    me = os.getpid()
    held = _held(me)
    assert held >> CAPABILITY_BITS["MKNOD"] & 1, "the test needs a process holding CAP_MKNOD (root)"
    why = worker_needs([me], _status(tmp_path, held & ~(1 << CAPABILITY_BITS["MKNOD"])))
    assert why is not None
    assert "holds CAP_MKNOD, which the agent lacks" in why
    assert "agent.capabilities" in why


def test_another_users_worker_needs_what_the_kernel_asks(tmp_path: Path) -> None:
    me, uid = os.getpid(), os.getuid()
    agent = _status(tmp_path, ALL & ~(1 << CAPABILITY_BITS["SYS_RESOURCE"]), uid=uid + 1)
    why = worker_needs([me], agent)
    assert why is not None
    assert f"runs as uid {uid}, not the agent's {uid + 1}" in why
    assert "CAP_SYS_RESOURCE (CRIU reads and sets the resource limits" in why
    assert worker_needs([me], _status(tmp_path, ALL, uid=uid + 1)) is None
