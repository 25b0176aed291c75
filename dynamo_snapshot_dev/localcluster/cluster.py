"""Start and stop the local control plane as supervised child processes."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_snapshot.api import crdgen
from dynamo_snapshot_dev.localcluster.components import Components, find_components
from dynamo_snapshot_dev.localcluster.nodes import KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE, gpu_node_manifest
from dynamo_snapshot_dev.localcluster.pki import Pki, PkiError, make_pki
from dynamo_snapshot_dev.localcluster.realnode import RealNode, RealNodeOptions
from dynamo_snapshot_dev.localcluster.supervise import Proc, Started, spawn_logged, terminate


class LocalClusterError(RuntimeError):
    """A one-line, actionable reason the control plane could not start or answer."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_port_free(port: int, what: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise LocalClusterError(
                f"port {port} for {what} is in use: stop the process holding it "
                f"(ss -ltnp 'sport = :{port}') or choose another port"
            ) from None


@dataclass
class ClusterOptions:
    apiserver_port: int | None = None
    # Short grace so failover tests see NotReady nodes in seconds, like a tuned production cluster.
    node_monitor_grace_period: str = "20s"
    pod_cidr: str = "10.64.0.1/12"
    extra_apiserver_args: Sequence[str] = field(default_factory=tuple)
    # Start a real kubelet + containerd node (realnode.py) next to kwok once the control plane is up.
    real_node: bool = False
    real_node_options: RealNodeOptions | None = None
    # kwok and its fake GPU nodes; None: where the bin dir has kwok (a machine that runs a real node only
    # has no need of it).
    kwok: bool | None = None


class LocalCluster(Started):
    """etcd + kube-apiserver + kube-scheduler + kube-controller-manager (+ kwok), rooted at `workdir`."""

    def __init__(
        self,
        workdir: Path,
        *,
        components: Components | None = None,
        options: ClusterOptions | None = None,
    ) -> None:
        self.workdir = workdir
        self._components = components
        self.options = options or ClusterOptions()
        self._procs: list[Proc] = []
        self._pki: Pki | None = None
        self._real_node: RealNode | None = None
        self.apiserver_port = 0

    # ------------------------------------------------------------------ public surface
    @property
    def components(self) -> Components:
        if self._components is None:
            # helm only installs the chart (chart_install), which says so where it is missing.
            self._components = find_components(kwok=self.options.kwok is True, helm=False)
        return self._components

    @property
    def kwok(self) -> bool:
        """Whether this cluster runs kwok (and so can have fake GPU nodes)."""
        return self.options.kwok is not False and self.components.kwok is not None

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def start(self, timeout: float = 180.0, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda _msg: None)
        comps = self.components
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.options.apiserver_port:
            ensure_port_free(self.options.apiserver_port, "kube-apiserver")
        self.apiserver_port = self.options.apiserver_port or free_port()
        etcd_port, etcd_peer = free_port(), free_port()
        pki = self._make_pki()
        self._write_kubeconfig(pki)
        deadline = time.monotonic() + timeout

        say("starting etcd")
        self._spawn("etcd", self._etcd_argv(comps, etcd_port, etcd_peer))
        self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), deadline)

        say("starting kube-apiserver")
        self._spawn("kube-apiserver", self._apiserver_argv(comps, pki, etcd_port))
        self._wait("kube-apiserver", lambda: self._api_ok("/readyz"), deadline)

        say("starting kube-controller-manager, kube-scheduler" + (" and kwok" if self.kwok else ""))
        if not self.kwok and self.options.kwok is None:
            say(f"no kwok in {comps.bin_dir}: the cluster runs without fake nodes")
        self._spawn("kube-controller-manager", self._controller_manager_argv(comps, pki))
        self._spawn("kube-scheduler", self._scheduler_argv(comps))
        if self.kwok:
            self._spawn("kwok", self._kwok_argv(comps))
        # The service-account controller proves the controller-manager is working, not merely alive.
        self._wait("kube-controller-manager", lambda: self._has_default_sa("default"), deadline)
        say(f"control plane ready at {self.server} (kubeconfig {self.kubeconfig})")
        if self.options.real_node:
            try:
                self.start_real_node(self.options.real_node_options, progress=say)
            except BaseException:
                self.stop()
                raise

    # ------------------------------------------------------------------ the control plane's pieces
    def _make_pki(self) -> Pki:
        try:
            # The real node's address too: without kube-proxy (a machine with no iptables) its pods reach
            # the apiserver there rather than through the `kubernetes` Service.
            node_ip = (self.options.real_node_options or RealNodeOptions()).node_ip
            self._pki = make_pki(
                self.workdir / "pki",
                ["127.0.0.1", "localhost", "10.96.0.1", node_ip, "kubernetes", "kubernetes.default.svc"],
            )
        except PkiError as e:
            raise LocalClusterError(str(e)) from None
        return self._pki

    def _etcd_argv(self, comps: Components, port: int, peer_port: int) -> list[str]:
        return [
            str(comps.etcd),
            "--name=local",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{port}",
            f"--advertise-client-urls=http://127.0.0.1:{port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=local=http://127.0.0.1:{peer_port}",
            # Tests and the demo value speed over durability; the data dies with the cluster anyway.
            "--unsafe-no-fsync",
            "--quota-backend-bytes=8589934592",
            "--log-level=warn",
        ]

    def _apiserver_argv(self, comps: Components, pki: Pki, etcd_port: int) -> list[str]:
        return [
            str(comps.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            # Every address, so that the real node's pods reach it through the `kubernetes` Service, whose
            # endpoint start_real_node sets to the node's bridge address (the apiserver's own endpoint
            # reconciler is off: it would publish 127.0.0.1, which a pod cannot reach).
            "--bind-address=0.0.0.0",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={pki.server_cert}",
            f"--tls-private-key-file={pki.server_key}",
            f"--client-ca-file={pki.ca_cert}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            "--profiling=false",
            # No real network here: the `kubernetes` Service endpoint would be loopback, which is refused.
            "--endpoint-reconciler-type=none",
            "--max-requests-inflight=1600",
            "--max-mutating-requests-inflight=800",
            # For a real node (logs, exec, port-forward): the admin cert passes the kubelet's webhook
            # authorization, and the node name does not resolve here, its InternalIP does.
            f"--kubelet-client-certificate={pki.admin_cert}",
            f"--kubelet-client-key={pki.admin_key}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            *self.options.extra_apiserver_args,
        ]

    def _controller_manager_argv(self, comps: Components, pki: Pki) -> list[str]:
        return [
            str(comps.kube_controller_manager),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}",
            "--use-service-account-credentials=false",
            "--cluster-name=dynamo-snapshot-local",
            f"--node-monitor-grace-period={self.options.node_monitor_grace_period}",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
        ]

    def _scheduler_argv(self, comps: Components) -> list[str]:
        return [
            str(comps.kube_scheduler),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
        ]

    def _kwok_argv(self, comps: Components) -> list[str]:
        assert comps.kwok is not None
        assert comps.kwok_stages is not None
        return [
            str(comps.kwok),
            f"--kubeconfig={self.kubeconfig}",
            f"--config={comps.kwok_stages}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_VALUE}",
            f"--cidr={self.options.pod_cidr}",
            "--node-ip=10.255.0.1",
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{free_port()}",
        ]

    @property
    def real_node(self) -> RealNode | None:
        return self._real_node

    def start_real_node(
        self,
        options: RealNodeOptions | None = None,
        *,
        timeout: float = 120.0,
        progress: Callable[[str], None] | None = None,
    ) -> RealNode:
        """Start (or start again) the real kubelet node in this running cluster; raises RealNodeError."""
        if self._pki is None:
            raise LocalClusterError("start the control plane before its real node")
        if self._real_node is None:
            self._real_node = RealNode(
                self.workdir / "real-node",
                server=self.server,
                pki=self._pki,
                admin_kubeconfig=self.kubeconfig,
                kubectl=self.components.kubectl,
                options=options or self.options.real_node_options,
            )
        if not self._real_node.running:
            self._real_node.start(timeout=timeout, progress=progress)
            self._publish_apiserver_endpoint(self._real_node.node_ip)
        return self._real_node

    def _publish_apiserver_endpoint(self, address: str) -> None:
        """The `kubernetes` Service's endpoint: this apiserver at ``address``, as in-cluster clients (the
        chart's controller and agent pods) reach it through kube-proxy."""
        port = [{"name": "https", "port": self.apiserver_port, "protocol": "TCP"}]
        self.apply(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"kubernetes.io/service-name": "kubernetes"},
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
                "ports": port,
            }
        )

    def stop_real_node(self) -> None:
        if self._real_node is not None:
            self._real_node.stop()

    def stop(self) -> None:
        try:
            self.stop_real_node()
        finally:
            self._stop_control_plane()

    def _stop_control_plane(self) -> None:
        # etcd last, once the apiserver is gone: an apiserver whose etcd vanished first spends its whole
        # shutdown grace (about 15 s) retrying it.
        last = [p for p in self._procs if p.name == "etcd"]
        first = [p for p in reversed(self._procs) if p.name != "etcd"]
        for group in (first, last):
            for proc in group:
                if proc.popen.poll() is None:
                    proc.popen.terminate()
            for proc in group:
                try:
                    proc.popen.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait(timeout=5)
        for proc in self._procs:
            proc.log_handle.close()
        self._procs.clear()

    def env(self) -> dict[str, str]:
        """Environment for child tools (kubectl, helm, the controller) pointed at this cluster."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.components.bin_dir}:{os.environ.get('PATH', '')}",
        }

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.components.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise LocalClusterError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None) -> str:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=text).stdout

    def install_crds(self) -> list[str]:
        """Apply this project's CRDs (generated from the models, as crds/ holds them) and wait until the
        apiserver serves them; returns their names as kubectl prints them."""
        names: list[str] = []
        for _, text in sorted(crdgen.render_crds().items()):
            out = self.kubectl(
                "apply", "--server-side", "--force-conflicts", "-f", "-", "-o", "name", input=text
            )
            names += out.stdout.split()
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)
        return names

    def add_gpu_node(self, name: str, **kwargs: Any) -> dict[str, Any]:
        if not self.kwok:
            raise LocalClusterError(
                f"fake GPU node {name}: this cluster runs without kwok (none in {self.components.bin_dir})"
            )
        manifest = gpu_node_manifest(name, **kwargs)
        self.apply(manifest)
        return manifest

    def stop_component(self, name: str) -> None:
        """Stop one component (an apiserver outage; kwok: every kubelet's); `start_component` restarts it."""
        proc = next(p for p in self._procs if p.name == name)
        terminate(proc.popen, 15, 5)

    def start_component(self, name: str, timeout: float = 60.0) -> None:
        """Start a stopped component again, as it was started (same ports, same data)."""
        index, proc = next((i, p) for i, p in enumerate(self._procs) if p.name == name)
        if proc.popen.poll() is None:
            return
        proc.log_handle.close()
        self._spawn(name, proc.argv)
        # Same place in the list: stop() ends the components in the reverse order of their start.
        self._procs[index] = self._procs.pop()
        deadline = time.monotonic() + timeout
        # Not _wait: other components may be stopped on purpose meanwhile.
        while name == "kube-apiserver" and not self._api_ok("/readyz"):
            if time.monotonic() > deadline or self._procs[index].popen.poll() is not None:
                raise LocalClusterError(f"{name} did not come back; log {proc.log}")
            time.sleep(0.2)

    def alive(self) -> dict[str, bool]:
        return {p.name: p.popen.poll() is None for p in self._procs}

    def log_tail(self, name: str, lines: int = 20) -> str:
        for p in self._procs:
            if p.name == name:
                return "\n".join(p.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    # ------------------------------------------------------------------ internals
    def _spawn(self, name: str, argv: list[str]) -> None:
        self._procs.append(spawn_logged(self.workdir / "logs", name, argv))

    def _wait(self, name: str, ready: Callable[[], bool], deadline: float) -> None:
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.popen.poll() is not None:
                    tail = self.log_tail(p.name, 8)
                    self.stop()
                    raise LocalClusterError(
                        f"{p.name} exited with {p.popen.returncode}; log {p.log}:\n{tail}"
                    )
            if ready():
                return
            time.sleep(0.2)
        self.stop()
        raise LocalClusterError(f"{name} did not become ready in time; see {self.workdir / 'logs'}")

    def _ssl(self) -> ssl.SSLContext:
        assert self._pki is not None
        ctx = ssl.create_default_context(cafile=str(self._pki.ca_cert))
        ctx.load_cert_chain(str(self._pki.admin_cert), str(self._pki.admin_key))
        return ctx

    def _api_ok(self, path: str) -> bool:
        return _http_ok(self.server + path, self._ssl())

    def _has_default_sa(self, namespace: str) -> bool:
        return _http_ok(f"{self.server}/api/v1/namespaces/{namespace}/serviceaccounts/default", self._ssl())

    def _write_kubeconfig(self, pki: Pki) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {"server": self.server, "certificate-authority": str(pki.ca_cert)},
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {"client-certificate": str(pki.admin_cert), "client-key": str(pki.admin_key)},
                }
            ],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
            "current-context": "local",
        }
        self.kubeconfig.write_text(json.dumps(config, indent=2))


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
