"""A restore container found under runc's state before the kubelet reports it: by its pod's UID and its name,
started, and only inside that pod's cgroup (a pod annotation naming another pod's UID does not count)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime.runc_index import RuncContainer, RuncIndex, in_pod_cgroup, parse_state

UID = "0f7c1e52-3d4b-4a8e-9c1d-2b6f8e9a7c10"
UID_ = UID.replace("-", "_")  # as the systemd cgroup driver writes it
OTHER = "7d2e9a41-8b3c-4f5d-a6e7-1c9b0d2f3e48"


def _cid(n: int) -> str:
    return f"{n:064x}"


def _containerd_labels(uid: str, name: str, kind: str = "container") -> list[str]:
    return [
        f"io.kubernetes.cri.sandbox-uid={uid}",
        f"io.kubernetes.cri.container-name={name}",
        f"io.kubernetes.cri.container-type={kind}",
        "bundle=/run/containerd/io.containerd.runtime.v2.task/k8s.io/x",
    ]


def _state(labels: list[str], pid: int) -> str:
    return json.dumps({"id": "x", "init_process_pid": pid, "config": {"labels": labels, "rootfs": "/r"}})


def test_containerd_and_cri_o_states_name_the_pod_and_container() -> None:
    assert parse_state(_cid(1), _state(_containerd_labels(UID, "main"), 42)) == RuncContainer(
        _cid(1), UID, "main", 42
    )
    crio = [f"io.kubernetes.pod.uid={UID}", "io.kubernetes.container.name=engine-0"]
    assert parse_state(_cid(2), _state(crio, 7)) == RuncContainer(_cid(2), UID, "engine-0", 7)


@pytest.mark.parametrize(
    "text",
    [
        _state(_containerd_labels(UID, "main", kind="sandbox"), 42),  # containerd's pause container
        _state([f"io.kubernetes.pod.uid={UID}", "io.kubernetes.container.name=POD"], 42),  # CRI-O's
        _state(["bundle=/somewhere"], 42),  # not made by a CRI runtime
        "{not json",
        json.dumps({"config": None}),
    ],
)
def test_sandboxes_foreign_containers_and_garbage_name_nothing(text: str) -> None:
    assert parse_state(_cid(3), text) is None


@pytest.mark.parametrize(
    ("cgroup", "inside"),
    [
        (
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
            f"cri-containerd-{_cid(1)}.scope\n",
            True,
        ),
        (f"0::/kubepods/burstable/pod{UID}/{_cid(1)}\n", True),
        (f"12:memory:/kubepods/pod{UID}/{_cid(1)}\n0::/\n", True),
        (f"0::/kubepods/burstable/pod{OTHER}/{_cid(1)}\n", False),
        (f"0::/kubepods/burstable/pod{UID}x/{_cid(1)}\n", False),
        ("0::/system.slice/containerd.service\n", False),
    ],
)
def test_the_pod_cgroup_is_read_as_the_kubelet_names_it(cgroup: str, inside: bool) -> None:
    assert in_pod_cgroup(cgroup, UID) is inside


class _Node:
    """A runc root and a /proc with the containers' init processes and their cgroups."""

    def __init__(self, tmp: Path) -> None:
        self.root, self.proc = tmp / "runc", tmp / "proc"
        self.root.mkdir()
        self.proc.mkdir()

    def container(self, n: int, labels: list[str], pid: int, cgroup_uid: str, *, started: bool = True) -> str:
        cid = _cid(n)
        (self.root / cid).mkdir()
        (self.root / cid / "state.json").write_text(_state(labels, pid))
        if not started:
            os.mkfifo(self.root / cid / "exec.fifo")
        (self.proc / str(pid)).mkdir()
        (self.proc / str(pid) / "cgroup").write_text(f"0::/kubepods/besteffort/pod{cgroup_uid}/{cid}\n")
        return cid


def test_the_started_container_of_the_pod_is_found(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    index = RuncIndex(node.root, node.proc)
    assert index.started(UID, "main") is None
    node.container(1, _containerd_labels(UID, "sidecar"), 101, UID)
    node.container(2, _containerd_labels(OTHER, "main"), 102, OTHER)
    assert index.started(UID, "main") is None
    cid = node.container(3, _containerd_labels(UID, "main"), 103, UID)
    found = index.started(UID, "main")
    assert found is not None
    assert (found.id, found.init_pid) == (cid, 103)


def test_a_created_container_counts_once_runc_started_it(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    index = RuncIndex(node.root, node.proc)
    cid = node.container(1, _containerd_labels(UID, "main"), 101, UID, started=False)
    assert index.started(UID, "main") is None
    (node.root / cid / "exec.fifo").unlink()  # what `runc start` does
    found = index.started(UID, "main")
    assert found is not None
    assert found.id == cid


def test_a_state_file_written_after_the_first_look_is_read(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    index = RuncIndex(node.root, node.proc)
    cid = _cid(1)
    (node.root / cid).mkdir()  # runc made the directory, its state file comes next
    assert index.started(UID, "main") is None
    (node.root / cid / "state.json").write_text(_state(_containerd_labels(UID, "main"), 101))
    (node.proc / "101").mkdir()
    (node.proc / "101" / "cgroup").write_text(f"0::/kubepods/pod{UID}/{cid}\n")
    found = index.started(UID, "main")
    assert found is not None
    assert found.id == cid


def test_the_spent_container_and_a_dead_one_are_passed_over(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    index = RuncIndex(node.root, node.proc)
    spent = node.container(1, _containerd_labels(UID, "main"), 101, UID)
    assert index.started(UID, "main", spent=spent) is None
    dead = node.container(2, _containerd_labels(UID, "main"), 102, UID)
    (node.proc / "102" / "cgroup").unlink()  # its init process is gone
    (node.proc / "102").rmdir()
    assert index.started(UID, "main", spent=spent) is None
    fresh = node.container(3, _containerd_labels(UID, "main"), 103, UID)
    found = index.started(UID, "main", spent=spent)
    assert found is not None
    assert found.id == fresh != dead


def test_annotations_naming_another_pods_uid_do_not_make_its_container(tmp_path: Path) -> None:
    """A tenant's container whose annotations claim the victim pod's UID (a runtime passing pod annotations
    on) lives in the tenant's pod cgroup: it is not taken for the victim's restore container."""
    node = _Node(tmp_path)
    index = RuncIndex(node.root, node.proc)
    node.container(1, _containerd_labels(UID, "main"), 101, OTHER)
    assert index.started(UID, "main") is None


def test_a_removed_container_is_forgotten(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    index = RuncIndex(node.root, node.proc)
    cid = node.container(1, _containerd_labels(UID, "main"), 101, UID)
    assert index.started(UID, "main") is not None
    for child in (node.root / cid).iterdir():
        child.unlink()
    (node.root / cid).rmdir()
    assert index.started(UID, "main") is None
    assert not index._known


def test_no_runc_root_finds_nothing(tmp_path: Path) -> None:
    assert RuncIndex(tmp_path / "absent", tmp_path).started(UID, "main") is None
