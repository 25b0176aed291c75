"""The real node decides from the machine's own facts: its cgroup version (mountinfo), iptables (PATH) and
GPUs (/dev/nvidia0), and finds the kubepods cgroups of either cgroup version. Fake trees, no root."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster.realnode.facts import (
    cgroup_v2,
    iptables_present,
    mount_fstype,
    read_host_facts,
)
from dynamo_snapshot_dev.localcluster.realnode.traces import cgroup_hierarchies, kubepods_cgroups, propagation

# /proc/self/mountinfo lines as the two machines have them.
V2_ONLY = (
    "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)
V1_HYBRID = (
    "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "25 22 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755\n"
    "26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n"
    "27 25 0:24 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory\n"
    "28 25 0:25 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,cpu,cpuacct\n"
)


def test_cgroup_v2_is_the_unified_hierarchy_alone_at_sys_fs_cgroup() -> None:
    assert cgroup_v2(V2_ONLY)
    assert not cgroup_v2(V1_HYBRID), "a hybrid's unified mount below /sys/fs/cgroup is still v1"
    assert not cgroup_v2("22 1 254:0 / / rw - ext4 /dev/vda rw\n"), "no cgroup mount at all"
    assert mount_fstype(V1_HYBRID, "/sys/fs/cgroup/unified") == "cgroup2"
    # The mount on top wins: a cgroup2 mounted over a v1 tmpfs.
    assert cgroup_v2(V1_HYBRID + "40 25 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")


def test_iptables_needs_both_tools() -> None:
    assert iptables_present(lambda tool: f"/usr/sbin/{tool}")
    assert not iptables_present(lambda tool: None)
    assert not iptables_present(lambda tool: "/usr/sbin/iptables" if tool == "iptables" else None)


@pytest.mark.parametrize(("mountinfo", "version"), [(V2_ONLY, 2), (V1_HYBRID, 1)])
def test_host_facts_read_from_the_given_files(tmp_path: Path, mountinfo: str, version: int) -> None:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "nvidia0").touch()
    facts = read_host_facts(tmp_path / "mountinfo", tmp_path / "nvidia0", which=lambda tool: None)
    assert (facts.cgroup_version, facts.iptables, facts.gpu_devices) == (version, False, True)
    facts = read_host_facts(tmp_path / "mountinfo", tmp_path / "absent", which=lambda t: f"/sbin/{t}")
    assert (facts.iptables, facts.gpu_devices) == (True, False)


def _cgroup(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "cgroup.procs").touch()
    return path


def test_kubepods_on_cgroup_v2_is_the_one_tree_at_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    _cgroup(root / "process_api" / "0770b35b")  # the launcher's own cgroup: never touched
    _cgroup(root / "process_api" / "kubepods")  # not ours: only the root's kubepods is
    pod = _cgroup(root / "kubepods" / "besteffort" / "pod1234" / "c0ffee")
    assert cgroup_hierarchies(root) == [root]
    found = kubepods_cgroups(root)
    assert found[0] == pod, "deepest first, so each rmdir finds its children gone"
    assert found[-1] == root / "kubepods"
    assert set(found) == {pod, pod.parent, pod.parent.parent, root / "kubepods"}
    assert all("process_api" not in str(p) for p in found)


def test_kubepods_on_cgroup_v1_is_one_tree_per_hierarchy(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    for hierarchy in ("memory", "cpu,cpuacct", "unified"):
        _cgroup(root / hierarchy / "kubepods" / "pod1234")
    (root / "cpu").symlink_to("cpu,cpuacct")  # v1's controller links count once
    found = kubepods_cgroups(root)
    assert len(found) == 6
    assert {p.relative_to(root).parts[0] for p in found} == {"memory", "cpu,cpuacct", "unified"}
    assert [len(p.parts) for p in found] == sorted((len(p.parts) for p in found), reverse=True)
    assert kubepods_cgroups(tmp_path / "none") == []


def test_the_cgroup_mount_propagation_is_read_on_either_version() -> None:
    assert propagation("/sys/fs/cgroup", V2_ONLY) == "shared"
    assert propagation("/sys/fs/cgroup", V2_ONLY.replace(" shared:9", "")) == "private"
    assert propagation("/sys/fs/cgroup", V1_HYBRID) == "private", "v1: the tmpfs holding the hierarchies"
    assert (
        propagation("/sys/fs/cgroup", V1_HYBRID.replace("noexec - tmpfs", "noexec master:3 - tmpfs"))
        == "slave"
    )
