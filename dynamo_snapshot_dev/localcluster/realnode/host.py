"""The machine a real node runs on: the host paths it shares with other software, the binaries it needs,
and running commands there."""

from __future__ import annotations

import os
import shlex
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
from dynamo_snapshot_dev.localcluster.components import SETUP_HINT, ComponentsMissingError, cache_dir
from dynamo_snapshot_dev.localcluster.realnode.facts import iptables_present

# containerd's runc shim keeps runc state here whatever containerd's own state dir is.
RUNC_ROOT = Path("/run/containerd/runc/k8s.io")
CONTAINERD_NAMESPACE = "k8s.io"
# The system's runc and CNI plugins (Debian's paths), used where the bin dir has none of its own.
CNI_BIN_DIR = Path("/usr/lib/cni")
RUNC = Path("/usr/sbin/runc")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CNI_NETWORK = "dsnap-pods"
# Host paths the kubelet, containerd and libcni use whatever they are configured with. A stop removes
# what this node put there and each directory once it is empty (never one that holds anything else).
CNI_RESULTS = Path("/var/lib/cni/results")
KUBELET_DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
# The GPU device plugin's socket there (the kubelet's is kubelet.sock).
DEVICE_PLUGIN_SOCKET = KUBELET_DEVICE_PLUGINS / "dsnap-gpu.sock"
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
    # None where the machine has no iptables: kube-proxy cannot run there, so it is not looked for.
    kube_proxy: Path | None
    containerd: Path
    containerd_shim: Path
    ctr: Path
    criu: Path
    runc: Path = RUNC
    cni_bin_dir: Path = CNI_BIN_DIR
    # The GPU device plugin (the node binaries' `gpu-device-plugin`), where the bin dir has it.
    gpu_device_plugin: Path | None = None

    @property
    def bin_dir(self) -> Path:
        return self.kubelet.parent


def _executable(path: Path) -> bool:
    return os.access(path, os.X_OK)


def find_node_components(bin_dir: Path | None = None, *, iptables: bool | None = None) -> NodeComponents:
    """Locate the node's binaries, or raise one error naming all missing ones.

    runc and the CNI plugins come from the bin dir (``runc``, ``cni/``) or else the system's. kube-proxy is
    looked for only where ``iptables`` (default: whether the machine has it) lets it run.
    """
    base = bin_dir or cache_dir() / "bin"
    with_iptables = iptables_present() if iptables is None else iptables
    exes = ["kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "criu"]
    exes = [exe for exe in exes if with_iptables or exe != "kube-proxy"]
    missing = [str(base / exe) for exe in exes if not _executable(base / exe)]
    runc = next((p for p in (base / "runc", RUNC) if _executable(p)), None)
    if runc is None:
        missing.append(f"{base / 'runc'} (or {RUNC})")
    cni_dirs = (base / "cni", CNI_BIN_DIR)
    cni = next((d for d in cni_dirs if all(_executable(d / p) for p in CNI_PLUGINS)), None)
    if cni is None:
        missing.append(f"the CNI plugins {', '.join(CNI_PLUGINS)} (in {base / 'cni'} or {CNI_BIN_DIR})")
    if missing or runc is None or cni is None:
        raise ComponentsMissingError(f"the real node needs: {', '.join(missing)} — {SETUP_HINT}")
    plugin = base / "gpu-device-plugin"
    return NodeComponents(
        kubelet=base / "kubelet",
        kube_proxy=base / "kube-proxy" if with_iptables else None,
        containerd=base / "containerd",
        containerd_shim=base / "containerd-shim-runc-v2",
        ctr=base / "ctr",
        criu=base / "criu",
        runc=runc,
        cni_bin_dir=cni,
        gpu_device_plugin=plugin if _executable(plugin) else None,
    )


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
