"""A restore container's cgroups on cgroup v1 and v2, from what /proc shows: its /proc/<pid>/cgroup and the
agent's mountinfo. Fake inputs as each machine has them (the 2-core VM: v1 with a hybrid unified; the GPU
machine: v2 alone, nsdelegate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime.container_cgroups import (
    CgroupError,
    ContainerCgroups,
    cgroup_mounts,
    cgroupns_args,
    container_cgroups,
    is_external_cgroup_mount,
    restore_cgroup_source,
)

ROOT = Path("/sys/fs/cgroup")
CID = "c" * 64
POD = "/kubepods/besteffort/pod0f1e2d3c-aaaa-bbbb-cccc-123456789abc"
CGROUPS_PATH = f"{POD}/{CID}"

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# The placeholder's /proc/<pid>/cgroup on v1: runc put it in every hierarchy but one (misc: at the root).
V1_PROC = f"""\
10:misc:/
9:name=systemd:{CGROUPS_PATH}
8:pids:{CGROUPS_PATH}
4:memory:{CGROUPS_PATH}
2:cpuacct:{CGROUPS_PATH}
1:cpu:{CGROUPS_PATH}
0::{CGROUPS_PATH}
"""
V2_MOUNTS = (
    "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)
V2_PROC = f"0::{CGROUPS_PATH}\n"


def test_v1_one_dir_per_hierarchy_it_is_in() -> None:
    found = container_cgroups(V1_PROC, V1_MOUNTS, ROOT)
    rel = CGROUPS_PATH.lstrip("/")
    assert found.dirs == tuple(
        ROOT / h / rel for h in ("systemd", "pids", "memory", "cpuacct", "cpu", "unified")
    ), "hierarchies in /proc's order; misc (at the root) left out"
    assert found.unified == ROOT / "unified" / rel


def test_v1_co_mounted_controllers_are_one_hierarchy() -> None:
    mounts = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    found = container_cgroups(f"3:cpu,cpuacct:{CGROUPS_PATH}\n", mounts, ROOT)
    assert found == ContainerCgroups((ROOT / "cpu,cpuacct" / CGROUPS_PATH.lstrip("/"),), None)


def test_v2_is_the_one_unified_dir() -> None:
    found = container_cgroups(V2_PROC, V2_MOUNTS, ROOT)
    assert found == ContainerCgroups((ROOT / CGROUPS_PATH.lstrip("/"),), ROOT / CGROUPS_PATH.lstrip("/"))


def test_v2_with_the_systemd_driver_too() -> None:
    path = (
        "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e.slice/cri-containerd-c0.scope"
    )
    found = container_cgroups(f"0::{path}\n", V2_MOUNTS, ROOT)
    assert found.dirs == (ROOT / path.lstrip("/"),)


def test_a_mount_rooted_below_the_hierarchy_maps_what_lies_under_it() -> None:
    # An agent whose /sys/fs/cgroup is its own pod's cgroup2 (a cgroup namespace's view) sees only that.
    mounts = f"30 22 0:26 {POD} /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert container_cgroups(V2_PROC, mounts, ROOT).dirs == (ROOT / CID,)
    with pytest.raises(
        CgroupError, match=r"none of its cgroups is mounted where the agent looks \(/sys/fs/cgroup\)"
    ):
        container_cgroups("0::/kubepods/burstable/pod9/x\n", mounts, ROOT)


def test_an_agent_in_its_own_cgroup_namespace_is_told_to_share_the_hosts() -> None:
    with pytest.raises(CgroupError, match="must share the host's cgroup namespace"):
        container_cgroups("0::/../../kubepods/besteffort/pod9/x\n", V2_MOUNTS, ROOT)


def test_mounts_elsewhere_than_the_cgroup_root_are_not_used() -> None:
    mounts = "50 22 0:26 / /host/sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    with pytest.raises(CgroupError, match="none of its cgroups"):
        container_cgroups(V2_PROC, mounts, ROOT)
    assert container_cgroups(V2_PROC, mounts, Path("/host/sys/fs/cgroup")).dirs == (
        Path("/host/sys/fs/cgroup") / CGROUPS_PATH.lstrip("/"),
    )


def test_mountinfo_cgroup_mounts_are_parsed_with_their_controllers() -> None:
    mounts = cgroup_mounts(V1_MOUNTS)
    assert [m.mountpoint for m in mounts][:2] == ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpuacct"]
    assert mounts[-1].v2
    assert mounts[3].holds("name=systemd") is False
    assert mounts[4].holds("name=systemd")
    assert not mounts[-1].holds("memory")
    assert mounts[-1].holds("")


@pytest.mark.parametrize(
    ("mountpoint", "fstype", "external"),
    [
        ("/sys/fs/cgroup/memory", "cgroup", True),  # v1: a bind of the host's hierarchy
        ("/sys/fs/cgroup", "cgroup2", True),  # v2: the container's own cgroup2 mount
        ("/sys/fs/cgroup/unified", "cgroup2", False),  # a v1 host's unified: CRIU dumps it as before
        ("/sys/fs/cgroup", "tmpfs", False),
        ("/etc/hosts", "ext4", False),
    ],
)
def test_which_cgroup_mounts_a_checkpoint_leaves_outside(
    mountpoint: str, fstype: str, external: bool
) -> None:
    assert is_external_cgroup_mount(mountpoint, fstype) is external


def test_a_checkpoints_cgroup_mounts_map_onto_the_restore_containers_cgroup() -> None:
    v1 = container_cgroups(V1_PROC, V1_MOUNTS, ROOT)
    rel = CGROUPS_PATH.lstrip("/")
    source = restore_cgroup_source("/sys/fs/cgroup/memory", v1, ROOT, CGROUPS_PATH)
    assert source == str(ROOT / "memory" / rel)
    v2 = container_cgroups(V2_PROC, V2_MOUNTS, ROOT)
    assert restore_cgroup_source("/sys/fs/cgroup", v2, ROOT, CGROUPS_PATH) == str(ROOT / rel)
    assert restore_cgroup_source("/etc/hosts", v2, ROOT, CGROUPS_PATH) is None
    with pytest.raises(CgroupError, match="no cgroup2 cgroup"):
        restore_cgroup_source("/sys/fs/cgroup", ContainerCgroups((ROOT / "memory" / rel,), None), ROOT, "")


def test_the_cgroup_namespace_is_entered_only_where_the_container_has_its_own() -> None:
    assert cgroupns_args(4242, target_ns=4026531835, own_ns=4026531835) == []
    assert cgroupns_args(4242, target_ns=4026532999, own_ns=4026531835) == ["--cgroup=/proc/4242/ns/cgroup"]
