"""The machine a real node runs on: the host paths it shares with other software, the binaries it needs,
and running commands there."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_snapshot.cuda.processes import ppid_from_stat
from dynamo_snapshot.localcluster.components import SETUP_HINT, ComponentsMissingError, cache_dir

# containerd's runc shim keeps runc state here whatever containerd's own state dir is.
RUNC_ROOT = Path("/run/containerd/runc/k8s.io")
CONTAINERD_NAMESPACE = "k8s.io"
CNI_BIN_DIR = Path("/usr/lib/cni")
RUNC = Path("/usr/sbin/runc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CNI_NETWORK = "dsnap-pods"
# Host paths the kubelet, containerd and libcni use whatever they are configured with. A stop removes
# what this node put there and each directory once it is empty (never one that holds anything else).
CNI_RESULTS = Path("/var/lib/cni/results")
KUBELET_DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
CONTAINER_LOG_LINKS = Path("/var/log/containers")
SYSTEM_CONTAINERD = Path("/run/containerd")
SHIM_SOCKETS = SYSTEM_CONTAINERD / "s"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# The kubelet creates these iptables chains by itself (kube-proxy --cleanup leaves them).
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")
KUBE_PROXY_CHAINS = (
    "KUBE-PROXY-CANARY", "KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL", "KUBE-PROXY-FIREWALL",
)  # fmt: skip
# One real node per machine whatever its name: the kubelet port, /kubepods cgroups and the kubelet's
# iptables chains are machine-wide.
LOCK_PATH = Path("/run/dynamo-snapshot-real-node.lock")
# Present while the real node holds /sys/fs/cgroup as a shared mount that it found private.
CGROUP_SHARED_MARK = Path("/run/dynamo-snapshot-real-node.cgroup-shared")


class RealNodeError(RuntimeError):
    """A one-line, actionable reason the real node could not start, answer or stop cleanly."""


@dataclass(frozen=True)
class NodeComponents:
    kubelet: Path
    kube_proxy: Path
    containerd: Path
    containerd_shim: Path
    ctr: Path
    criu: Path

    @property
    def bin_dir(self) -> Path:
        return self.kubelet.parent


def find_node_components(bin_dir: Path | None = None) -> NodeComponents:
    """Locate the node's binaries (cache and Debian packages), or raise one error naming all missing ones."""
    base = bin_dir or cache_dir() / "bin"
    names = {
        "kubelet": "kubelet",
        "kube_proxy": "kube-proxy",
        "containerd": "containerd",
        "containerd_shim": "containerd-shim-runc-v2",
        "ctr": "ctr",
        "criu": "criu",
    }
    paths = {attr: base / exe for attr, exe in names.items()}
    missing = [str(paths[a]) for a in names if not os.access(paths[a], os.X_OK)]
    system = [RUNC, *(CNI_BIN_DIR / p for p in ("bridge", "host-local", "loopback"))]
    missing += [str(p) for p in system if not os.access(p, os.X_OK)]
    missing += [tool for tool in ("ip", "iptables", "iptables-save") if shutil.which(tool) is None]
    if missing:
        raise ComponentsMissingError(f"the real node needs: {', '.join(missing)} — {SETUP_HINT}")
    return NodeComponents(**paths)


def run(
    argv: list[str], *, check: bool = True, timeout: float = 60.0, **kw: Any
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    except subprocess.TimeoutExpired:
        raise RealNodeError(f"{shlex.join(argv)} did not finish in {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise RealNodeError(f"{shlex.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@dataclass(frozen=True)
class HostProcess:
    """A process of the host, as /proc shows it: what the real node's pods run, seen from outside."""

    pid: int
    ppid: int
    cmdline: str
    cgroups: str

    def in_pod(self, pod_uid: str) -> bool:
        """Whether the process is in the cgroup the kubelet names after the pod's uid: ``pod<uid>`` with
        the cgroupfs driver, ``kubepods-<class>-pod<uid with underscores>.slice`` with systemd's."""
        cgroupfs, systemd = f"pod{pod_uid}", f"-pod{pod_uid.replace('-', '_')}.slice"
        return any(
            part == cgroupfs or part.endswith(systemd)
            for line in self.cgroups.splitlines()
            for part in line.split("/")
        )


def host_processes(marker: str) -> list[HostProcess]:
    """The host's processes whose command line holds ``marker``; those gone while read are left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if marker not in cmdline:
                continue
            cgroups = (entry / "cgroup").read_text()
            ppid = ppid_from_stat((entry / "stat").read_text(errors="replace"))
        except OSError:
            continue
        if ppid is not None:
            found.append(HostProcess(int(entry.name), ppid, cmdline.strip(), cgroups))
    return found
