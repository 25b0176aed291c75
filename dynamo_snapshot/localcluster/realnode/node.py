"""A real Kubernetes node on this machine: kubelet + containerd 2.x + runc + CNI bridge (+ kube-proxy).

It joins a running `LocalCluster` next to the kwok nodes. Pods on it are real containers (runc state under
/run/containerd/runc/k8s.io/<containerID>), addressed on a bridge that lives only on this machine; images
come from local OCI archives (`images.py`), so pods use `imagePullPolicy: Never`.

The node is tainted (`REAL_NODE_TAINT`) so that pods written for kwok nodes never land on it; pods meant for
it tolerate the taint (`pod_overrides`). One real node per machine: a lock under /run refuses a second one,
and a start after a killed run first removes what that run left (processes, mounts, cgroups, netns, the
bridge, iptables chains).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dynamo_snapshot.localcluster.components import SETUP_HINT, ComponentsMissingError, cache_dir
from dynamo_snapshot.localcluster.images import (
    ImageBuildError,
    ImageRef,
    build_busybox_rootfs,
    build_pause_rootfs,
    worker_image_archive,
    write_oci_archive,
)
from dynamo_snapshot.localcluster.pki import Pki, PkiError, make_node_certs
from dynamo_snapshot.localcluster.supervise import Proc, spawn_logged, terminate

# Test-infrastructure names (not the product's protocol): the taint that keeps kwok-bound pods off the node.
REAL_NODE_TAINT = "localcluster.dynamo-snapshot.dev/real-node"
# The seccomp profile the Helm chart installs for workers (helm/dynamo-snapshot/templates/
# seccomp-configmap.yaml): CRIU cannot dump an io_uring instance, so creating one fails with ENOSYS and
# libraries (libuv, liburing) fall back to ordinary syscalls.
NO_IO_URING_PROFILE = "profiles/dynamo-snapshot-no-io-uring.json"
NO_IO_URING_SECCOMP = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [
        {
            "names": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": 38,
        }
    ],
}
PAUSE_IMAGE = ImageRef("localhost/dynamo-snapshot/pause", "3.10")
TEST_IMAGE = ImageRef("localhost/dynamo-snapshot/busybox", "1.35")
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
_MNT_DETACH = 2


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


@dataclass(frozen=True)
class RealNodeOptions:
    name: str = "real-node"
    bridge: str = "dsnap-cni0"
    pod_subnet: str = "10.244.0.0/24"
    node_ip: str = "10.244.0.1"
    kubelet_port: int = 10250
    kube_proxy: bool = True
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def prefix_len(self) -> int:
        return int(self.pod_subnet.split("/")[1])


def _run(
    argv: list[str], *, check: bool = True, timeout: float = 60.0, **kw: Any
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    except subprocess.TimeoutExpired:
        raise RealNodeError(f"{shlex.join(argv)} did not finish in {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise RealNodeError(f"{shlex.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


class RealNode:
    """kubelet + containerd (+ kube-proxy) registered with the control plane at `server`, rooted at `workdir`.

    `pki` is the cluster's PKI (its CA signs the kubelet certs); `admin_kubeconfig` is used by kube-proxy and
    for the node's own API calls (wait for Ready, delete its pods and Node at stop).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        server: str,
        pki: Pki,
        admin_kubeconfig: Path,
        kubectl: Path,
        options: RealNodeOptions | None = None,
        components: NodeComponents | None = None,
    ) -> None:
        self.workdir = workdir
        self.server = server
        self.pki = pki
        self.admin_kubeconfig = admin_kubeconfig
        self.kubectl_bin = kubectl
        self.options = options or RealNodeOptions()
        self._components = components
        self._procs: list[Proc] = []
        self._lock: IO[str] | None = None
        self._ports: dict[str, int] = {}
        # The bridge CNI plugin (isGateway) turns IPv4 forwarding on; a stop puts back what was there.
        self._ip_forward: str | None = None
        self._worker_image: ImageRef | None = None

    # ------------------------------------------------------------------ paths
    @property
    def components(self) -> NodeComponents:
        if self._components is None:
            self._components = find_node_components()
        return self._components

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def node_ip(self) -> str:
        return self.options.node_ip

    @property
    def state_dir(self) -> Path:
        # Fixed and short: a unix socket path is limited to 108 bytes, and a later run must find what a
        # killed one left here.
        return Path("/run") / f"dsnap-{self.name}"

    @property
    def containerd_socket(self) -> Path:
        return self.state_dir / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def pod_logs_dir(self) -> Path:
        return self.workdir / "pod-logs"

    @property
    def _record(self) -> Path:
        return self.state_dir / "record.json"

    @property
    def _lock_path(self) -> Path:
        return LOCK_PATH

    @property
    def worker_image(self) -> ImageRef:
        """The CPU reference worker image this node imported (its tag hashes the files it holds)."""
        if self._worker_image is None:
            raise RealNodeError("the worker image is known once the real node has started")
        return self._worker_image

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.popen.poll() is None for p in self._procs)

    # ------------------------------------------------------------------ public surface
    def start(self, timeout: float = 120.0, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda _msg: None)
        if os.geteuid() != 0:
            raise RealNodeError("the real node needs root (bridge, mounts, cgroups): re-run with sudo")
        comps = self.components
        self._take_lock()
        deadline = time.monotonic() + timeout
        try:
            say("removing what an earlier run of the real node left behind")
            self._cleanup_leftovers()
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._ip_forward = IP_FORWARD.read_text().strip()
            self._write_record()
            self._setup_bridge()
            self._install_seccomp_profiles()
            say("building the pause and test images")
            archives = self._build_images()
            self._write_cni_config()
            say("starting containerd")
            self._start_containerd(comps, deadline)
            for archive in archives:
                self.ctr("images", "import", str(archive))
            say("starting kubelet")
            self._start_kubelet(comps)
            self._wait("node Ready", self._node_ready, deadline)
            if self.options.kube_proxy:
                say("starting kube-proxy")
                self._start_kube_proxy(comps)
                self._wait("kube-proxy", self._kube_proxy_ready, deadline)
            self._write_record()
            say(f"real node {self.name} Ready at {self.node_ip}")
        except BaseException:
            # The reason the start failed matters more than what its clean-up could not remove.
            with contextlib.suppress(RealNodeError):
                self.stop()
            raise

    def stop(self) -> None:
        """Stop everything and leave nothing behind; safe to call twice or after a failed start."""
        if self._lock is None:
            return
        errors: list[str] = []
        try:
            if self._proc("kubelet") is not None and self._api_ok():
                self._drain_pods()
            self._stop_proc("kube-proxy")
            self._stop_proc("kubelet")
            if self._proc("containerd") is not None:
                self._remove_containers()
            self._stop_proc("containerd")
            for proc in self._procs:
                proc.log_handle.close()
            self._procs.clear()
            self._cleanup_host(errors)
            self._restore_ip_forward()
            if self._api_ok():
                self.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false", check=False)
        finally:
            self._release_lock()
        if errors:
            raise RealNodeError("the real node did not stop cleanly: " + "; ".join(errors))

    def restart_kubelet(self, timeout: float = 60.0) -> None:
        """Stop the kubelet and start it again, as a node's kubelet upgrade or crash does: containers keep
        running under containerd meanwhile."""
        self._stop_proc("kubelet")
        for proc in [p for p in self._procs if p.name == "kubelet"]:
            proc.log_handle.close()
            self._procs.remove(proc)
        self._start_kubelet(self.components)
        healthz = f"http://127.0.0.1:{self._ports['kubelet-healthz']}/healthz"
        self._wait("the restarted kubelet", lambda: _http_ok(healthz), time.monotonic() + timeout)

    def ctr(self, *args: str, timeout: float = 60.0) -> str:
        argv = [
            str(self.components.ctr),
            f"--address={self.containerd_socket}",
            "-n",
            CONTAINERD_NAMESPACE,
            *args,
        ]
        return _run(argv, timeout=timeout).stdout

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return _run(
            [str(self.kubectl_bin), f"--kubeconfig={self.admin_kubeconfig}", *args],
            check=check,
            timeout=timeout,
        )

    def pod_overrides(self) -> dict[str, Any]:
        """Pod spec fields that put a pod on this node: node name, the taint's toleration, the host's DNS."""
        return {
            "nodeName": self.name,
            "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
            "dnsPolicy": "Default",
        }

    def pod(self, name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
        """A Pod manifest for this node: its overrides, a 1 s grace period, then ``spec``."""
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                **self.pod_overrides(),
                "terminationGracePeriodSeconds": 1,
                "containers": containers,
                **spec,
            },
        }

    def log_tail(self, name: str, lines: int = 20) -> str:
        log = self.workdir / "logs" / f"{name}.log"
        if not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> dict[str, bool]:
        return {p.name: p.popen.poll() is None for p in self._procs}

    def leftovers(self) -> list[str]:
        """Node traces on the host now (none after a clean stop): mounts, cgroups, shims, bridge, chains."""
        found = [f"mount {m}" for m in self._our_mounts()]
        found += [f"cgroup {c}" for c in _kubepods_cgroups()]
        found += [f"process {pid} ({_cmdline(pid)[:80]})" for pid in self._our_pids()]
        if Path(f"/sys/class/net/{self.options.bridge}").exists():
            found.append(f"bridge {self.options.bridge}")
        found += [f"iptables {c}" for c in _iptables_chains(KUBELET_CHAINS + KUBE_PROXY_CHAINS)]
        if self.state_dir.exists():
            found.append(f"dir {self.state_dir}")
        if CNI_RESULTS.is_dir():
            found += [
                f"CNI result {f}" for f in CNI_RESULTS.iterdir() if f.name.startswith(f"{CNI_NETWORK}-")
            ]
        containers = self._our_runc_containers()
        found += [f"runc state {RUNC_ROOT / c}" for c in containers]
        found += [f"shim socket {p}" for p in self._our_shim_sockets(containers)]
        if (KUBELET_DEVICE_PLUGINS / "kubelet.sock").exists():
            found.append(f"socket {KUBELET_DEVICE_PLUGINS / 'kubelet.sock'}")
        return found

    # ------------------------------------------------------------------ start pieces
    def _take_lock(self) -> None:
        if self._lock is not None:
            raise RealNodeError(f"real node {self.name} is already started by this process")
        handle = self._lock_path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise RealNodeError(
                f"a real node already runs on this machine (pid {holder}, lock {self._lock_path}): "
                "only one real node per machine; stop that test run first"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock = handle

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _write_record(self) -> None:
        record = {
            "workdir": str(self.workdir),
            "pids": {p.name: p.popen.pid for p in self._procs},
            "bridge": self.options.bridge,
            "ip_forward": self._ip_forward,
        }
        self._record.write_text(json.dumps(record))

    def _install_seccomp_profiles(self) -> None:
        """What the chart's agent init container puts on every GPU node: the workers' io_uring-blocking
        profile, for pods that name it (`localhostProfile: profiles/<name>`)."""
        path = self.kubelet_root / "seccomp" / NO_IO_URING_PROFILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(NO_IO_URING_SECCOMP, indent=1))

    def _setup_bridge(self) -> None:
        br = self.options.bridge
        _run(["ip", "link", "add", br, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.node_ip}/{self.options.prefix_len}", "dev", br])
        _run(["ip", "link", "set", br, "up"])

    def _build_images(self) -> list[Path]:
        d = self.workdir / "images"
        shutil.rmtree(d, ignore_errors=True)
        try:
            pause = write_oci_archive(
                d / "pause.tar", build_pause_rootfs(d / "pause-rootfs"), PAUSE_IMAGE, entrypoint=["/pause"]
            )
            busybox = write_oci_archive(
                d / "busybox.tar",
                build_busybox_rootfs(d / "busybox-rootfs"),
                TEST_IMAGE,
                entrypoint=["/bin/sh"],
            )
            self._worker_image, worker = worker_image_archive()
        except ImageBuildError as e:
            raise RealNodeError(str(e)) from None
        return [pause, busybox, worker]

    def _write_cni_config(self) -> None:
        net = self.workdir / "cni" / "net.d"
        net.mkdir(parents=True, exist_ok=True)
        conf = {
            "cniVersion": "0.4.0",
            "name": CNI_NETWORK,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.options.bridge,
                    "isGateway": True,
                    # No egress: pods talk only to the host and each other, so no NAT rules on the host.
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.options.pod_subnet, "gateway": self.node_ip}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.state_dir / "ipam"),
                    },
                },
                {"type": "loopback"},
            ],
        }
        (net / "10-pods.conflist").write_text(json.dumps(conf, indent=2))

    def _containerd_config(self) -> str:
        net = self.workdir / "cni" / "net.d"
        return f"""version = 3
root = "{self.workdir / "containerd"}"
state = "{self.state_dir}"
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{self.state_dir / "containerd.sock.ttrpc"}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.nri.v1.nri"]
  disable = true
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE.name}"
[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = false
  # root has no CAP_SYS_RESOURCE in this VM: lowering the pause process's oom_score_adj is refused.
  restrict_oom_score_adj = true
  enable_criu = true
  enable_experimental_restore_via_create = true
  # Pod network namespaces under our state dir, so a stop finds and unmounts every one of them.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{RUNC}"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{net}"
    max_conf_num = 1
"""

    def _start_containerd(self, comps: NodeComponents, deadline: float) -> None:
        config = self.workdir / "containerd.toml"
        config.write_text(self._containerd_config())
        # The shim and runc (spawned by it) find containerd-shim-runc-v2 and criu on PATH.
        env = {**os.environ, "PATH": f"{comps.bin_dir}:{os.environ.get('PATH', '')}"}
        self._spawn("containerd", [str(comps.containerd), f"--config={config}"], env=env)
        self._wait("containerd", self._containerd_ok, deadline)

    def _containerd_ok(self) -> bool:
        if not self.containerd_socket.exists():
            return False
        argv = [str(self.components.ctr), f"--address={self.containerd_socket}", "version"]
        return _run(argv, check=False, timeout=10).returncode == 0

    def _kubeconfig(self, path: Path, cert: Path, key: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {"server": self.server, "certificate-authority": str(self.pki.ca_cert)},
                }
            ],
            "users": [{"name": "node", "user": {"client-certificate": str(cert), "client-key": str(key)}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "node"}}],
            "current-context": "local",
        }
        path.write_text(json.dumps(config, indent=2))
        return path

    def _start_kubelet(self, comps: NodeComponents) -> None:
        try:
            certs = make_node_certs(self.pki, self.name, self.node_ip)
        except PkiError as e:
            raise RealNodeError(str(e)) from None
        kubeconfig = self._kubeconfig(
            self.workdir / "kubelet.kubeconfig", certs.client_cert, certs.client_key
        )
        self._ports["kubelet-healthz"] = healthz = _free_port()
        sock = f"unix://{self.containerd_socket}"
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # cgroup v1 only here; 1.37 refuses it unless told otherwise (then a deprecation warning only).
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "address": self.node_ip,
            "port": self.options.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "tlsCertFile": str(certs.serving_cert),
            "tlsPrivateKeyFile": str(certs.serving_key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.pki.ca_cert)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": sock,
            "imageServiceEndpoint": sock,
            "podCIDR": self.options.pod_subnet,
            "clusterDomain": "cluster.local",
            "resolvConf": "/etc/resolv.conf",
            "podLogsDir": str(self.pod_logs_dir),
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
            },
            # Local images cannot be pulled again: image GC must never remove them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "registerWithTaints": [{"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"}],
            "serializeImagePulls": False,
        }
        config_path = self.workdir / "kubelet-config.json"
        config_path.write_text(json.dumps(config, indent=2))
        labels = ",".join(f"{k}={v}" for k, v in self.options.labels.items())
        self._spawn(
            "kubelet",
            [
                str(comps.kubelet),
                f"--config={config_path}",
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.node_ip}",
                f"--root-dir={self.kubelet_root}",
                *([f"--node-labels={labels}"] if labels else []),
                "--v=1",
            ],
        )

    def _start_kube_proxy(self, comps: NodeComponents) -> None:
        self._ports["kube-proxy-healthz"] = healthz = _free_port()
        self._spawn(
            "kube-proxy",
            [
                str(comps.kube_proxy),
                f"--kubeconfig={self.admin_kubeconfig}",
                "--proxy-mode=iptables",
                f"--hostname-override={self.name}",
                f"--cluster-cidr={self.options.pod_subnet}",
                # Leave the host's conntrack and route_localnet sysctls alone.
                "--conntrack-max-per-core=0",
                "--iptables-localhost-nodeports=false",
                f"--healthz-bind-address=127.0.0.1:{healthz}",
                f"--metrics-bind-address=127.0.0.1:{_free_port()}",
                "--v=1",
            ],
        )

    # ------------------------------------------------------------------ stop pieces
    def _drain_pods(self) -> None:
        """Delete this node's pods and let the running kubelet tear them down (CNI DEL, sandbox stop)."""
        self.kubectl(
            "delete", "pods", "-A", f"--field-selector=spec.nodeName={self.name}",
            "--grace-period=0", "--force", "--wait=false", check=False,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self._running_tasks():
            time.sleep(0.3)

    def _running_tasks(self) -> list[str]:
        try:
            out = self.ctr("tasks", "ls", timeout=10)
        except RealNodeError:
            return []
        return [line.split()[0] for line in out.splitlines()[1:] if "RUNNING" in line.split()]

    def _remove_containers(self) -> None:
        """Kill and delete every task and container still in containerd (what the kubelet left)."""
        with contextlib.suppress(RealNodeError):
            for task in self._running_tasks():
                with contextlib.suppress(RealNodeError):
                    self.ctr("tasks", "kill", "--signal=SIGKILL", task, timeout=10)
            with contextlib.suppress(RealNodeError):
                tasks = [line.split()[0] for line in self.ctr("tasks", "ls").splitlines()[1:] if line.strip()]
                for task in tasks:
                    with contextlib.suppress(RealNodeError):
                        self.ctr("tasks", "delete", "--force", task, timeout=20)
            for container in self.ctr("containers", "ls", "-q").split():
                with contextlib.suppress(RealNodeError):
                    self.ctr("containers", "rm", container, timeout=20)

    def _cleanup_leftovers(self) -> None:
        """Undo what a killed earlier run left: its processes, container processes, mounts, cgroups, links."""
        workdirs = {self.workdir}
        pids: dict[str, int] = {}
        if self._record.exists():
            with contextlib.suppress(ValueError, OSError):
                record = json.loads(self._record.read_text())
                workdirs.add(Path(record["workdir"]))
                pids = {str(k): int(v) for k, v in record.get("pids", {}).items()}
                if record.get("ip_forward") in ("0", "1"):
                    self._ip_forward = str(record["ip_forward"])
        for name, pid in pids.items():
            # Only if that pid is still the binary we started (pids are reused).
            if Path(_cmdline(pid).split(" ")[0] or "/").name == Path(name).name:
                _kill(pid, signal.SIGKILL)
        errors: list[str] = []
        self._cleanup_host(errors, extra_workdirs=workdirs)
        self._restore_ip_forward()
        if errors:
            raise RealNodeError("could not remove what an earlier real node left: " + "; ".join(errors))

    def _restore_ip_forward(self) -> None:
        if self._ip_forward is not None:
            with contextlib.suppress(OSError):
                IP_FORWARD.write_text(self._ip_forward + "\n")
            self._ip_forward = None

    def _cleanup_host(self, errors: list[str], extra_workdirs: set[Path] | None = None) -> None:
        roots = {self.state_dir, *(extra_workdirs or {self.workdir})}
        # runc's state of our containers lives outside our dirs; `runc delete --force` also kills them.
        containers = self._our_runc_containers()
        for cid in containers:
            _run([str(RUNC), "--root", str(RUNC_ROOT), "delete", "--force", cid], check=False)
            shutil.rmtree(RUNC_ROOT / cid, ignore_errors=True)
        for sock in self._our_shim_sockets(containers):
            sock.unlink(missing_ok=True)
        # Container processes next (a killed run's pods keep running under their shims), then the shims.
        for cg in _kubepods_cgroups():
            for pid in _cgroup_pids(cg):
                _kill(pid, signal.SIGKILL)
        for pid in self._our_pids():
            _kill(pid, signal.SIGKILL)
        _wait_until(
            lambda: not self._our_pids() and not any(_cgroup_pids(c) for c in _kubepods_cgroups()), 10
        )
        for mount in self._our_mounts(roots):
            if not _umount(mount):
                errors.append(f"umount {mount} failed")
        for cg in _kubepods_cgroups():
            with contextlib.suppress(FileNotFoundError):
                try:
                    cg.rmdir()
                except OSError as e:
                    errors.append(f"rmdir {cg}: {e.strerror}")
        _remove_iptables_chains(KUBELET_CHAINS + KUBE_PROXY_CHAINS)
        if Path(f"/sys/class/net/{self.options.bridge}").exists():
            proc = _run(["ip", "link", "del", self.options.bridge], check=False)
            if proc.returncode != 0:
                errors.append(f"ip link del {self.options.bridge}: {proc.stderr.strip()}")
        _remove_container_log_links(roots)
        _tidy_shared_dirs()
        if not self._our_mounts(roots):
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _our_mounts(self, roots: set[Path] | None = None) -> list[str]:
        prefixes = [str(r).rstrip("/") + "/" for r in (roots or {self.state_dir, self.workdir})]
        found = [m for m in _mountpoints() if any((m + "/").startswith(p) for p in prefixes)]
        # Deepest first: an overlay rootfs inside the kubelet root's own bind mount goes before it.
        return sorted(set(found), key=lambda m: (-m.count("/"), m))

    def _our_runc_containers(self) -> list[str]:
        """Containers in the runc root whose bundle is in this node's containerd state dir."""
        prefix = f"bundle={self.state_dir}/"
        found: list[str] = []
        if not RUNC_ROOT.is_dir():
            return found
        for state in RUNC_ROOT.glob("*/state.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                labels = json.loads(state.read_text())["config"].get("labels") or []
                if any(str(label).startswith(prefix) for label in labels):
                    found.append(state.parent.name)
        return found

    def _our_shim_sockets(self, containers: list[str]) -> list[Path]:
        """The shims' sockets in /run/containerd/s: named sha256(<containerd address>/<namespace>/<id>)."""
        tasks = self.state_dir / "io.containerd.runtime.v2.task" / CONTAINERD_NAMESPACE
        ids = set(containers) | ({d.name for d in tasks.iterdir()} if tasks.is_dir() else set())
        names = {
            hashlib.sha256(f"{self.containerd_socket}/{CONTAINERD_NAMESPACE}/{i}".encode()).hexdigest()
            for i in ids
        }
        return [SHIM_SOCKETS / n for n in sorted(names) if (SHIM_SOCKETS / n).exists()]

    def _our_pids(self) -> list[int]:
        """Shims (and anything else) started with this node's containerd socket or state dir."""
        needles = (str(self.containerd_socket), str(self.state_dir) + "/")
        return [pid for pid in _pids() if pid != os.getpid() and any(n in _cmdline(pid) for n in needles)]

    # ------------------------------------------------------------------ process helpers
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        # A kubelet left behind by a killed run is cleaned up at the next start.
        self._procs.append(spawn_logged(self.workdir / "logs", name, argv, env=env, cwd=self.workdir))
        self._write_record()

    def _proc(self, name: str) -> Proc | None:
        return next((p for p in self._procs if p.name == name and p.popen.poll() is None), None)

    def _stop_proc(self, name: str) -> None:
        proc = self._proc(name)
        if proc is None:
            return
        terminate(proc.popen, 20, 10)

    def _wait(self, what: str, ready: Callable[[], bool], deadline: float) -> None:
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.popen.poll() is not None:
                    raise RealNodeError(
                        f"{p.name} exited with {p.popen.returncode}; log {p.log}:\n"
                        + self.log_tail(p.name, 12)
                    )
            if ready():
                return
            time.sleep(0.2)
        tails = "\n".join(f"--- {p.name}\n{self.log_tail(p.name, 8)}" for p in self._procs)
        raise RealNodeError(f"{what}: not ready in time; logs in {self.workdir / 'logs'}:\n{tails}")

    def _api_ok(self) -> bool:
        return self.kubectl("get", "--raw=/readyz", check=False, timeout=10).returncode == 0

    def _node_ready(self) -> bool:
        proc = self.kubectl("get", "node", self.name, "-o", "json", check=False, timeout=10)
        if proc.returncode != 0:
            return False
        conditions = json.loads(proc.stdout).get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def _kube_proxy_ready(self) -> bool:
        url = f"http://127.0.0.1:{self._ports['kube-proxy-healthz']}/healthz"
        return _http_ok(url)


# ---------------------------------------------------------------------- host helpers
def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _kubepods_cgroups() -> list[Path]:
    """Every kubepods cgroup dir in every v1 hierarchy (and v2 if mounted), deepest first."""
    found: list[Path] = []
    if not CGROUP_ROOT.is_dir():
        return found
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / "kubepods"
        if top.is_dir() and not top.is_symlink():
            for dirpath, _dirs, _files in os.walk(top):
                found.append(Path(dirpath))
    return sorted(set(found), key=lambda p: -len(p.parts))


def _cgroup_pids(cg: Path) -> list[int]:
    try:
        return [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _mountpoints() -> list[str]:
    points: list[str] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            # mountinfo escapes space, tab, newline and backslash as octal.
            points.append(fields[4].encode().decode("unicode_escape"))
    return points


def _umount(path: str) -> bool:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for _ in range(5):
        if path not in _mountpoints():
            return True
        libc.umount2(path.encode(), _MNT_DETACH)
    return path not in _mountpoints()


def _iptables_chains(chains: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for family in ("iptables", "ip6tables"):
        save = shutil.which(f"{family}-save")
        if save is None:
            continue
        out = _run([save], check=False, timeout=30).stdout
        table = ""
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and line[1:].split(" ")[0] in chains:
                found.append(f"{family} -t {table} {line[1:].split(' ')[0]}")
    return found


def _remove_iptables_chains(chains: tuple[str, ...]) -> None:
    """Delete `chains` and every rule that jumps to them, in filter/nat/mangle, for IPv4 and IPv6."""
    for family in ("iptables", "ip6tables"):
        tool, save = shutil.which(family), shutil.which(f"{family}-save")
        if tool is None or save is None:
            continue
        out = _run([save], check=False, timeout=30).stdout
        table = ""
        jumps: list[tuple[str, list[str]]] = []
        present: list[tuple[str, str]] = []
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                name = line[1:].split(" ")[0]
                if name in chains:
                    present.append((table, name))
            elif line.startswith("-A "):
                args = shlex.split(line)
                target = args[args.index("-j") + 1] if "-j" in args else ""
                if target in chains and args[1] not in chains:
                    jumps.append((table, ["-D", *args[1:]]))
        for table, rule in jumps:
            _run([tool, "-w", "-t", table, *rule], check=False)
        for table, name in present:
            _run([tool, "-w", "-t", table, "-F", name], check=False)
        for table, name in present:
            _run([tool, "-w", "-t", table, "-X", name], check=False)


def _remove_container_log_links(roots: set[Path]) -> None:
    """The kubelet links /var/log/containers/*.log to its pod logs whatever podLogsDir is; drop ours."""
    links = CONTAINER_LOG_LINKS
    if not links.is_dir():
        return
    prefixes = tuple(str(r).rstrip("/") + "/" for r in roots)
    for link in links.iterdir():
        if link.is_symlink() and os.readlink(link).startswith(prefixes):
            link.unlink(missing_ok=True)


def _tidy_shared_dirs() -> None:
    # libcni caches one result per sandbox and interface; sandboxes removed without a CNI DEL (a killed
    # run, a stop that outran the kubelet) leave theirs. Ours are named after our network and sandbox ids.
    if CNI_RESULTS.is_dir():
        ours = [f for f in CNI_RESULTS.iterdir() if f.name.startswith(f"{CNI_NETWORK}-")]
        sandbox_ids = {f.name.removeprefix(f"{CNI_NETWORK}-").rsplit("-", 1)[0] for f in ours}
        ours += [f for f in CNI_RESULTS.iterdir() if f.name.startswith("cni-loopback-")
                 and f.name.removeprefix("cni-loopback-").rsplit("-", 1)[0] in sandbox_ids]  # fmt: skip
        for f in ours:
            f.unlink(missing_ok=True)
    (KUBELET_DEVICE_PLUGINS / "kubelet.sock").unlink(missing_ok=True)
    empty_ok = [CNI_RESULTS, CNI_RESULTS.parent, KUBELET_DEVICE_PLUGINS, KUBELET_DEVICE_PLUGINS.parent]
    empty_ok.append(CONTAINER_LOG_LINKS)
    # The shim's socket dir and runc root under /run/containerd, unless a containerd of the system runs.
    if not (SYSTEM_CONTAINERD / "containerd.sock").exists():
        empty_ok += [RUNC_ROOT, RUNC_ROOT.parent, SHIM_SOCKETS, SYSTEM_CONTAINERD]
    for d in empty_ok:
        with contextlib.suppress(OSError):
            d.rmdir()
