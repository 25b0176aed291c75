"""What the machine offers a node, read off it at start so that nobody has to say it: the cgroup version,
whether iptables is there, whether it has NVIDIA GPUs.

Read from /proc/self/mountinfo, /dev and PATH; each reader takes its inputs as arguments, so the decisions
are tested from fake trees (tests/localcluster/test_realnode_facts.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_MOUNT = "/sys/fs/cgroup"
# The first GPU's device node: NVIDIA's driver makes /dev/nvidia<N> per GPU beside nvidiactl.
GPU_DEVICE = Path("/dev/nvidia0")
IPTABLES_TOOLS = ("iptables", "iptables-save")


@dataclass(frozen=True)
class HostFacts:
    # The unified hierarchy alone at /sys/fs/cgroup (cgroup v2); otherwise v1 (hybrid counts as v1).
    cgroup_v2: bool
    # iptables and iptables-save on PATH: kube-proxy and the kubelet's own chains need them.
    iptables: bool
    # An NVIDIA GPU's device node.
    gpu_devices: bool

    @property
    def cgroup_version(self) -> int:
        return 2 if self.cgroup_v2 else 1


def mount_fstype(mountinfo: str, mountpoint: str) -> str | None:
    """The file system type of the last mount at exactly ``mountpoint`` (the one on top), if any."""
    found = None
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split(" ")
        if sep and len(fields) > 4 and fields[4].encode().decode("unicode_escape") == mountpoint:
            found = tail.split(" ", 1)[0]
    return found


def cgroup_v2(mountinfo: str) -> bool:
    """Whether /sys/fs/cgroup is the cgroup2 file system itself (not a tmpfs of v1 hierarchies)."""
    return mount_fstype(mountinfo, CGROUP_MOUNT) == "cgroup2"


def iptables_present(which: Callable[[str], str | None] = shutil.which) -> bool:
    return all(which(tool) is not None for tool in IPTABLES_TOOLS)


def read_host_facts(
    mountinfo: Path = Path("/proc/self/mountinfo"),
    gpu_device: Path = GPU_DEVICE,
    which: Callable[[str], str | None] = shutil.which,
) -> HostFacts:
    return HostFacts(
        cgroup_v2=cgroup_v2(mountinfo.read_text()),
        iptables=iptables_present(which),
        gpu_devices=gpu_device.exists(),
    )
