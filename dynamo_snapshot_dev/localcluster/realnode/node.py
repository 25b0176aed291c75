"""`RealNode`: start, use and stop kubelet + containerd (+ kube-proxy) as one node of a `LocalCluster`.

The pieces it puts together live next to it: the host it runs on (`host`), its daemons' configuration
(`configs`), its pods' images and seccomp profile (`pod_images`) and what it leaves on the host (`traces`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from dynamo_snapshot_dev.localcluster.components import SETUP_HINT
from dynamo_snapshot_dev.localcluster.images import ImageRef
from dynamo_snapshot_dev.localcluster.pki import Pki, PkiError, make_node_certs
from dynamo_snapshot_dev.localcluster.realnode import configs, gpu, links
from dynamo_snapshot_dev.localcluster.realnode.configs import REAL_NODE_TAINT, RealNodeOptions
from dynamo_snapshot_dev.localcluster.realnode.facts import HostFacts, read_host_facts
from dynamo_snapshot_dev.localcluster.realnode.host import (
    CONTAINERD_NAMESPACE,
    IP_FORWARD,
    LOCK_PATH,
    RUNC,
    NodeComponents,
    RealNodeError,
    find_node_components,
    free_port,
    http_ok,
    run,
)
from dynamo_snapshot_dev.localcluster.realnode.pod_images import build_node_images, install_seccomp_profiles
from dynamo_snapshot_dev.localcluster.realnode.traces import HostTraces, cmdline, kill
from dynamo_snapshot_dev.localcluster.supervise import Proc, spawn_logged, terminate


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
        self._images_skipped: list[str] = []
        self._facts: HostFacts | None = None
        self._gpu_labels: dict[str, str] = {}
        self._gpu_count = 0

    # ------------------------------------------------------------------ paths
    @property
    def facts(self) -> HostFacts:
        """What the machine offers (cgroup version, iptables, GPUs), read once."""
        if self._facts is None:
            self._facts = read_host_facts()
        return self._facts

    @property
    def components(self) -> NodeComponents:
        if self._components is None:
            self._components = find_node_components(iptables=self.facts.iptables)
        return self._components

    @property
    def kube_proxy(self) -> bool:
        """Whether the node runs kube-proxy: asked for, and the machine has iptables for it."""
        return self.options.kube_proxy and self.facts.iptables and self.components.kube_proxy is not None

    @property
    def gpus(self) -> int:
        """How many GPUs the node gives pods (0 without the GPU option)."""
        return self._gpu_count

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
    def cdi_dir(self) -> Path:
        """Where the node's CDI spec is: containerd's only cdi_spec_dirs entry, gone with the node."""
        return self.state_dir / "cdi"

    @property
    def _record(self) -> Path:
        return self.state_dir / "record.json"

    @property
    def _lock_path(self) -> Path:
        return LOCK_PATH

    @property
    def _traces(self) -> HostTraces:
        runc = self._components.runc if self._components is not None else RUNC
        return HostTraces(self.workdir, self.state_dir, self.containerd_socket, self.options.bridge, runc)

    @property
    def worker_image(self) -> ImageRef:
        """The CPU reference worker image this node imported (its tag hashes the files it holds)."""
        if self._worker_image is None:
            if self._images_skipped:
                raise RealNodeError("this node has no worker image: " + "; ".join(self._images_skipped))
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
        with_gpus = gpu.wants_gpus(self.options.gpus, self.facts.gpu_devices)
        if with_gpus and comps.gpu_device_plugin is None:
            plugin = comps.bin_dir / "gpu-device-plugin"
            raise RealNodeError(f"a node with GPUs needs the device plugin {plugin}: {SETUP_HINT}")
        self._take_lock()
        deadline = time.monotonic() + timeout
        try:
            if self.options.kube_proxy and not self.kube_proxy:
                say(
                    "no iptables on this machine: the node runs without kube-proxy (pods are reached on "
                    "their pod IPs; Services do not work)"
                )
            say("removing what an earlier run of the real node left behind")
            self._cleanup_leftovers()
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._ip_forward = IP_FORWARD.read_text().strip()
            self._write_record()
            self._traces.share()
            self._setup_bridge()
            install_seccomp_profiles(self.kubelet_root)
            say("building the pause and test images")
            images = build_node_images(self.workdir / "images")
            self._worker_image, self._images_skipped = images.worker, images.skipped
            for reason in images.skipped:
                say(f"not built: {reason}")
            self._write_cni_config()
            # CDI is on for every node, as containerd 2.x has it by default: a spec written into cdi_dir
            # after the start (a test's fake GPU) is read when a container first asks for its devices.
            self.cdi_dir.mkdir(parents=True, exist_ok=True)
            if with_gpus:
                self._prepare_gpus(say)
            say(f"starting containerd (cgroup v{self.facts.cgroup_version})")
            self._start_containerd(comps, deadline, [self.cdi_dir])
            for archive in images.archives:
                self.ctr("images", "import", str(archive))
            say("starting kubelet")
            self._start_kubelet(comps)
            self._wait("node Ready", self._node_ready, deadline)
            if with_gpus:
                say("starting the GPU device plugin")
                self._start_device_plugin(comps, deadline)
            if self.kube_proxy:
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
            self._stop_proc("gpu-device-plugin")
            self._stop_proc("kubelet")
            if self._proc("containerd") is not None:
                self._remove_containers()
            self._stop_proc("containerd")
            for proc in self._procs:
                proc.log_handle.close()
            self._procs.clear()
            self._traces.remove(errors)
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
        self._wait("the restarted kubelet", lambda: http_ok(healthz), time.monotonic() + timeout)

    def ctr(self, *args: str, timeout: float = 60.0) -> str:
        argv = [
            str(self.components.ctr),
            f"--address={self.containerd_socket}",
            "-n",
            CONTAINERD_NAMESPACE,
            *args,
        ]
        return run(argv, timeout=timeout).stdout

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return run(
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
        return self._traces.found()

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

    def _setup_bridge(self) -> None:
        try:
            links.add_bridge(self.options.bridge, self.node_ip, self.options.prefix_len)
        except links.LinkError as e:
            raise RealNodeError(f"the pods' bridge: {e}") from None

    def _prepare_gpus(self, say: Callable[[str], None]) -> list[Path]:
        """The GPUs' labels and CDI spec, before containerd starts (it reads its spec dirs at start)."""
        found = gpu.read_node_gpus()
        self._gpu_labels, self._gpu_count = gpu.gpu_labels(found), found.count
        spec = gpu.write_cdi_spec(self.cdi_dir)
        say(f"{found.count} x {found.product} (driver {found.driver_version}), CDI spec {spec}")
        return [self.cdi_dir]

    def _start_device_plugin(self, comps: NodeComponents, deadline: float) -> None:
        assert comps.gpu_device_plugin is not None
        argv = gpu.device_plugin_argv(comps.gpu_device_plugin, self.cdi_dir, self.options.gpu_replicas)
        self._spawn("gpu-device-plugin", argv)
        wanted = self._gpu_count * self.options.gpu_replicas
        self._wait(f"{wanted} nvidia.com/gpu on the node", self._gpus_advertised, deadline)

    def _write_cni_config(self) -> None:
        net = self.workdir / "cni" / "net.d"
        net.mkdir(parents=True, exist_ok=True)
        conf = configs.cni_conflist(self.options, self.state_dir)
        (net / "10-pods.conflist").write_text(json.dumps(conf, indent=2))

    def _start_containerd(self, comps: NodeComponents, deadline: float, cdi_dirs: list[Path]) -> None:
        config = self.workdir / "containerd.toml"
        toml = configs.containerd_toml(
            root=self.workdir / "containerd",
            state_dir=self.state_dir,
            socket=self.containerd_socket,
            cni_conf_dir=self.workdir / "cni" / "net.d",
            runc=comps.runc,
            cni_bin_dir=comps.cni_bin_dir,
            cdi_spec_dirs=cdi_dirs,
        )
        config.write_text(toml)
        # The shim and runc (spawned by it) find containerd-shim-runc-v2 and criu on PATH.
        env = {**os.environ, "PATH": f"{comps.bin_dir}:{os.environ.get('PATH', '')}"}
        self._spawn("containerd", [str(comps.containerd), f"--config={config}"], env=env)
        self._wait("containerd", self._containerd_ok, deadline)

    def _containerd_ok(self) -> bool:
        if not self.containerd_socket.exists():
            return False
        argv = [str(self.components.ctr), f"--address={self.containerd_socket}", "version"]
        return run(argv, check=False, timeout=10).returncode == 0

    def _start_kubelet(self, comps: NodeComponents) -> None:
        try:
            certs = make_node_certs(self.pki, self.name, self.node_ip)
        except PkiError as e:
            raise RealNodeError(str(e)) from None
        kubeconfig = self.workdir / "kubelet.kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                configs.kubeconfig(
                    server=self.server, ca_cert=self.pki.ca_cert, cert=certs.client_cert, key=certs.client_key
                ),
                indent=2,
            )
        )
        self._ports["kubelet-healthz"] = healthz = free_port()
        config = configs.kubelet_configuration(
            self.options,
            pki=self.pki,
            certs=certs,
            containerd_socket=self.containerd_socket,
            pod_logs_dir=self.pod_logs_dir,
            healthz_port=healthz,
            cgroup_v2=self.facts.cgroup_v2,
        )
        config_path = self.workdir / "kubelet-config.json"
        config_path.write_text(json.dumps(config, indent=2))
        argv = configs.kubelet_argv(
            comps.kubelet,
            self.options,
            config=config_path,
            kubeconfig=kubeconfig,
            root_dir=self.kubelet_root,
            extra_labels=self._gpu_labels,
        )
        self._spawn("kubelet", argv)

    def _start_kube_proxy(self, comps: NodeComponents) -> None:
        assert comps.kube_proxy is not None
        self._ports["kube-proxy-healthz"] = healthz = free_port()
        argv = configs.kube_proxy_argv(
            comps.kube_proxy,
            self.options,
            kubeconfig=self.admin_kubeconfig,
            healthz_port=healthz,
            metrics_port=free_port(),
        )
        self._spawn("kube-proxy", argv)

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
            if Path(cmdline(pid).split(" ")[0] or "/").name == Path(name).name:
                kill(pid, signal.SIGKILL)
        errors: list[str] = []
        self._traces.remove(errors, extra_workdirs=workdirs)
        self._restore_ip_forward()
        if errors:
            raise RealNodeError("could not remove what an earlier real node left: " + "; ".join(errors))

    def _restore_ip_forward(self) -> None:
        if self._ip_forward is not None:
            with contextlib.suppress(OSError):
                IP_FORWARD.write_text(self._ip_forward + "\n")
            self._ip_forward = None

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

    def _node(self) -> dict[str, Any] | None:
        proc = self.kubectl("get", "node", self.name, "-o", "json", check=False, timeout=10)
        if proc.returncode != 0:
            return None
        node: dict[str, Any] = json.loads(proc.stdout)
        return node

    def _node_ready(self) -> bool:
        conditions = (self._node() or {}).get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def _gpus_advertised(self) -> bool:
        node = self._node()
        return node is not None and gpu.advertised_gpus(node) == self._gpu_count * self.options.gpu_replicas

    def _kube_proxy_ready(self) -> bool:
        url = f"http://127.0.0.1:{self._ports['kube-proxy-healthz']}/healthz"
        return http_ok(url)
