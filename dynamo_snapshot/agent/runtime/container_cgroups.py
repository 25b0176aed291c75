"""A container's cgroups as a restore into it needs them, on cgroup v1 and v2: the directories its restored
tasks must start in, the host directory behind its /sys/fs/cgroup, and its cgroup namespace.

Pure functions of what /proc shows (the container's /proc/<pid>/cgroup, the agent's mountinfo, namespace
inodes), so both cgroup versions are tested on either (tests/agent/test_container_cgroups.py).

On v1 a container has no cgroup namespace and its /sys/fs/cgroup/<hierarchy> are binds of the host's
hierarchies; on v2 (containerd, unprivileged) it has its own cgroup namespace and /sys/fs/cgroup is a cgroup2
mount rooted at its own cgroup, which a restore maps onto the restore container's cgroup directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONTAINER_CGROUP_MOUNT = "/sys/fs/cgroup"


class CgroupError(RuntimeError):
    """The container's cgroups cannot be told from where the agent stands; the message says why."""


@dataclass(frozen=True)
class CgroupMount:
    """One mount of a cgroup hierarchy: v1 names its controllers (or name=...), v2 has none."""

    mountpoint: str
    root: str
    v2: bool
    controllers: frozenset[str]

    def holds(self, controllers: str) -> bool:
        """Whether this is the hierarchy of a /proc/<pid>/cgroup line's controllers field."""
        if self.v2 or not controllers:
            return self.v2 and not controllers
        return set(controllers.split(",")) <= self.controllers


@dataclass(frozen=True)
class ContainerCgroups:
    # Each hierarchy's directory of the container's cgroup: its tasks' cgroup.procs are there.
    dirs: tuple[Path, ...]
    # The directory in the cgroup2 hierarchy (v2, or a v1 host's unified one), if any.
    unified: Path | None


def cgroup_mounts(mountinfo: str) -> list[CgroupMount]:
    """The cgroup and cgroup2 mounts of a mountinfo, in its order."""
    found = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, info = head.split(" "), tail.split(" ")
        if not sep or len(fields) < 5 or len(info) < 3 or info[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].encode().decode("unicode_escape")
        options = frozenset(info[2].split(","))
        found.append(CgroupMount(point, fields[3], info[0] == "cgroup2", options))
    return found


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` when it lies beneath it (or is it), else None."""
    root = root.rstrip("/")
    if path == root or path.startswith(root + "/"):
        return path[len(root) :].lstrip("/")
    return None


def container_cgroups(proc_cgroup: str, mountinfo: str, cgroup_root: Path) -> ContainerCgroups:
    """Where, in the agent's mounts below ``cgroup_root``, the process whose /proc/<pid>/cgroup is
    ``proc_cgroup`` lives. Hierarchies where it sits at the root (ones the runtime does not use) and ones
    the agent has not mounted are left out: a restored task keeps the agent's there, as it would."""
    mounts = [m for m in cgroup_mounts(mountinfo) if _under(m.mountpoint, str(cgroup_root)) is not None]
    dirs: list[Path] = []
    unified = None
    for line in proc_cgroup.splitlines():
        _id, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or path in ("", "/"):
            continue
        if path.startswith("/.."):
            raise CgroupError(
                f"the container's cgroup {path} lies outside the agent's cgroup namespace: the agent "
                "must share the host's cgroup namespace (run it privileged, as the chart does)"
            )
        # The last mount of the hierarchy wins: it hides earlier ones at the same place.
        found = None
        for m in mounts:
            rel = _under(path, m.root)
            if m.holds(controllers) and rel is not None:
                found = (m, Path(m.mountpoint) / rel if rel else Path(m.mountpoint))
        if found is None:
            continue
        dirs.append(found[1])
        if found[0].v2:
            unified = found[1]
    if not dirs:
        raise CgroupError("none of its cgroups is mounted where the agent looks (" + str(cgroup_root) + ")")
    return ContainerCgroups(tuple(dict.fromkeys(dirs)), unified)


def is_external_cgroup_mount(mountpoint: str, fstype: str) -> bool:
    """Whether a container's mount is one of its cgroup mounts that a checkpoint leaves outside (its
    restore maps it onto the restore container's own cgroup): v1's per-hierarchy binds, and v2's one
    cgroup2 mount at /sys/fs/cgroup. (A hybrid host's cgroup2 at /sys/fs/cgroup/unified stays CRIU's.)"""
    return fstype == "cgroup" or (fstype == "cgroup2" and mountpoint == CONTAINER_CGROUP_MOUNT)


def restore_cgroup_source(
    dest: str, cgroups: ContainerCgroups, cgroup_root: Path, cgroups_path: str
) -> str | None:
    """The host directory a checkpoint's external cgroup mount at ``dest`` becomes in the restore
    container, or None where ``dest`` is no cgroup mount.

    v1: the restore container's directory in that hierarchy (from its OCI cgroupsPath, as runc made it).
    v2: its directory in the unified hierarchy, which its own cgroup2 mount shows as the root.
    """
    if dest == CONTAINER_CGROUP_MOUNT:
        if cgroups.unified is None:
            raise CgroupError("the checkpoint has a cgroup2 mount, the restore container no cgroup2 cgroup")
        return str(cgroups.unified)
    hierarchy = _under(dest, CONTAINER_CGROUP_MOUNT)
    if not hierarchy:
        return None
    return str(cgroup_root / hierarchy / cgroups_path.lstrip("/"))


def cgroupns_args(target_pid: int, target_ns: int, own_ns: int) -> list[str]:
    """nsenter's option to enter the container's cgroup namespace where it has its own (v2): the restored
    tasks then see their cgroup as the container's processes do (``0::/``). None on v1, where containers
    share the host's."""
    return [] if target_ns == own_ns else [f"--cgroup=/proc/{target_pid}/ns/cgroup"]
