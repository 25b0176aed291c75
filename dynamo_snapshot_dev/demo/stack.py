"""Everything the demo runs, on one machine: the local control plane with a real kubelet + containerd node
(the default: workers are kubelet pods of the locally built worker image, restored into their own
containers) or with fake GPU nodes (`kwok`: the agents launch the workers as runc containers), Prometheus,
the controller, one node agent per node (built from an AgentConfig as `dynamo-snapshot agent` builds its
own) or, with `chart`, the Helm chart's controller and agent pods instead, and where the workers serve
(pod IPs, or the registrations of launched workers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from dynamo_snapshot.agent.pod_container import running_container
from dynamo_snapshot.agent.privileges import CONTAINERD_DEFAULT_CAPABILITIES, REQUIRED_CAPABILITIES
from dynamo_snapshot.agent.watcher import NodeAgent, workload_key
from dynamo_snapshot.api.protocol import LABEL_GPU_PRESENT
from dynamo_snapshot.artifact import ArtifactStore
from dynamo_snapshot.cli import agent_cmd
from dynamo_snapshot.cli.agent_cmd import AgentConfig
from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.controller.config import CONTROLLER_NAME
from dynamo_snapshot.controller.manager import ControllerConfig
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.kube import POD, Kube, Obj, load_client
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.chart_install import install, node_values
from dynamo_snapshot_dev.localcluster.cluster import ClusterOptions
from dynamo_snapshot_dev.localcluster.prometheus import LocalPrometheus
from dynamo_snapshot_dev.localcluster.realnode import RUNC_ROOT, RealNode
from dynamo_snapshot_dev.localcluster.realnode.host import host_processes
from dynamo_snapshot_dev.localcluster.s3server import LocalS3

NAMESPACE = "demo"
S3_BUCKET = "checkpoints"
TRANSFERS, TRANSFER_BYTES = (
    "dynsnap_agent_object_store_transfers_total",
    "dynsnap_agent_object_store_bytes_total",
)
REPO = Path(__file__).resolve().parents[2]
CPU_WORKER = REPO / "examples" / "reference_worker" / "cpu_worker.py"
GPU_WORKER = REPO / "examples" / "reference_worker" / "worker.py"
# Where the worker listens in a kubelet pod (its pod IP).
WORKER_PORT = 8000
# The chart's release (Stack.chart).
RELEASE, RELEASE_NAMESPACE = "dynamo-snapshot", "dynamo-snapshot-system"

# The demo's workers run on the CPU: no CUDA host copy whose zero pages the CUDA restore reads back, so the
# agent's rewrite wins their checkpoints and restores (agent/README.md, --drop-zero-pages).
CPU_WORKERS_DROP_ZERO_PAGES = "auto"


class DemoError(RuntimeError):
    """A one-line reason the demo cannot go on."""


@dataclass
class Endpoint:
    pod: str
    address: str  # host:port

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False


@dataclass
class Stack:
    workdir: Path
    nodes: int = 3  # fake GPU nodes (kwok)
    kubelet: bool = True  # a real kubelet node runs the workers; False: kwok nodes, launched workers
    # With kubelet: the Helm chart installed, its controller and agent pods run the story (no in-process
    # controller or agent); their logs go to `logs_dir` at stop.
    chart: bool = False
    logs_dir: Path | None = None
    # "s3": each node's agent keeps a store of its own and every checkpoint goes through a local
    # S3-compatible server (SeaweedFS); "volume": one store shared by all nodes, like a RWX volume.
    storage: str = "volume"
    s3: LocalS3 | None = None
    apiserver_port: int | None = None
    say: Callable[[str], None] = print
    cluster: LocalCluster | None = None
    prometheus: LocalPrometheus | None = None
    kube: Kube | None = None
    agents: dict[str, NodeAgent] = field(default_factory=dict)
    real_node: RealNode | None = None
    # Pods the story stopped counting as serving (a killed worker) until they are gone.
    forgotten: set[str] = field(default_factory=set)
    # pod -> where it serves: the registration directory as last read (by the discovery task, 5x a second)
    workers: dict[str, Endpoint] = field(default_factory=dict)
    # Shared by all nodes, like a RWX volume.
    artifacts: ArtifactStore = field(init=False)
    _api: Any = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.artifacts = ArtifactStore(self.workdir / "artifacts")

    @property
    def endpoint_dir(self) -> Path:
        return self.workdir / "endpoints"

    # ------------------------------------------------------------------ start / stop
    async def start_cluster(self) -> None:
        self.cluster = LocalCluster(
            self.workdir / "cluster", options=ClusterOptions(apiserver_port=self.apiserver_port)
        )
        await asyncio.to_thread(self.cluster.start, progress=self.say)
        await asyncio.to_thread(self._install)
        if self.kubelet:
            self.real_node = await asyncio.to_thread(self.cluster.start_real_node, progress=self.say)

    async def start(self) -> None:
        """The cluster, then Prometheus, the controller and the agents."""
        if shutil.which("runc") is None:
            raise DemoError("runc is missing: run scripts/test-env.sh (it installs the Debian package)")
        if self.chart and not self.kubelet:
            raise DemoError("the chart's pods need the kubelet node: --chart goes without --kwok")
        if self.chart and self.storage == "s3":
            raise DemoError("--storage s3 runs with the in-process agents: leave out --chart")
        if self.kubelet and os.geteuid() != 0:
            raise DemoError("the kubelet node needs root (bridge, mounts, cgroups): run with sudo, or --kwok")
        if not CPU_WORKER.exists():
            raise DemoError(f"{CPU_WORKER} is missing: run the demo from a checkout of the repository")
        criu = Criu(None)
        await criu.require()
        self.endpoint_dir.mkdir(parents=True, exist_ok=True)
        if self.storage == "s3":
            await self._start_object_store()
        await self.start_cluster()
        assert self.cluster is not None
        # The chart's controller is a pod: it asks Prometheus at the node's address.
        host = self.real_node.node_ip if self.chart and self.real_node is not None else "127.0.0.1"
        self.prometheus = LocalPrometheus(
            [], workdir=self.workdir / "prometheus", scrape_interval_s=0.5, host=host
        )
        await asyncio.to_thread(self.prometheus.start)
        self.say(f"prometheus at {self.prometheus.url}")
        self._api = await load_client(str(self.cluster.kubeconfig))
        self.kube = Kube(self._api, field_manager="dynamo-snapshot-demo")
        if self.chart:
            await asyncio.to_thread(self._install_chart)
            self._tasks.append(asyncio.create_task(self._discover(), name="discovery"))
            return
        config = ControllerConfig(
            leader_elect=False,
            metrics_port=0,
            resync_seconds=30,
            prometheus_url=self.prometheus.url,
        )
        controller = build_controller(Kube(self._api, field_manager=CONTROLLER_NAME), config)
        self._tasks.append(asyncio.create_task(controller.run_until(self._stop), name="controller"))
        for node in self.node_names:
            kube = Kube(self._api, field_manager=agent_cmd.FIELD_MANAGER)
            agent = self.agents[node] = agent_cmd.build(self.agent_config(node), kube)
            self._tasks.append(asyncio.create_task(agent.run_until(self._stop), name=f"agent-{node}"))
        self._tasks.append(asyncio.create_task(self._discover(), name="discovery"))
        if self.kubelet:
            self.say(
                f"controller and the node agent of kubelet node {self.node_names[0]} (containerd) running"
            )
        else:
            self.say(f"controller and {self.nodes} node agents (runc) running")

    async def _start_object_store(self) -> None:
        self.s3 = LocalS3(self.workdir / "s3")
        await asyncio.to_thread(self.s3.start)
        await self.s3.create_bucket(S3_BUCKET)
        self.s3.write_credentials(self.workdir / "s3-credentials")
        self.say(f"S3 server (SeaweedFS) at {self.s3.endpoint}, bucket {S3_BUCKET}")

    def _storage_settings(self, base: Path) -> dict[str, Any]:
        if self.s3 is None:
            return {"artifact_root": self.artifacts.root}
        return {
            "artifact_root": base / "artifacts",
            # As the chart with storage.type s3: what a node fetches goes into its node cache.
            "cache_root": base / "cache",
            "s3_endpoint": self.s3.endpoint,
            "s3_bucket": S3_BUCKET,
            "s3_credentials_dir": self.workdir / "s3-credentials",
        }

    def node_store(self, node: str) -> ArtifactStore:
        """The artifact store the agent of ``node`` writes its checkpoints into."""
        return (
            self.artifacts if self.s3 is None else ArtifactStore(self.workdir / "nodes" / node / "artifacts")
        )

    def storage_report(self) -> dict[str, Any]:
        """Where the checkpoints went, and what the agents sent to and fetched from the object store."""
        if self.s3 is None:
            return {"storage": self.storage}
        counts = {
            f"{op}_{result}": REGISTRY.get_sample_value(TRANSFERS, {"op": op, "result": result}) or 0.0
            for op in ("upload", "fetch")
            for result in ("done", "present", "failed")
        }
        sent = {
            f"{op}_bytes": REGISTRY.get_sample_value(TRANSFER_BYTES, {"op": op}) or 0.0
            for op in ("upload", "fetch")
        }
        return {"storage": self.storage, "endpoint": self.s3.endpoint, "bucket": S3_BUCKET, **counts, **sent}

    @property
    def node_names(self) -> list[str]:
        if self.kubelet:
            assert self.real_node is not None
            return [self.real_node.name]
        return [f"gpu-node-{i}" for i in range(self.nodes)]

    def agent_config(self, node: str) -> AgentConfig:
        """What agent/config.yaml would say on this node: on the kubelet node the defaults (runtime
        containerd); on a kwok node no kubelet runs pods, so the agent starts the workers."""
        base = self.workdir / "nodes" / node
        if self.kubelet:
            return AgentConfig(
                node_name=node,
                **self._storage_settings(base),
                control_root=base / "control",
                state_root=base / "state",
                runc_root=RUNC_ROOT,
                ready_timeout_seconds=600,
                drop_zero_pages=CPU_WORKERS_DROP_ZERO_PAGES,
                metrics_port=0,
                health_port=0,
            )
        return AgentConfig(
            node_name=node,
            **self._storage_settings(base),
            control_root=base / "control",
            state_root=base / "state",
            runtime="runc",
            launch_workloads=True,
            ready_timeout_seconds=600,
            drop_zero_pages=CPU_WORKERS_DROP_ZERO_PAGES,
            # The workers run this checkout's Python; they register themselves where the demo looks.
            host_binds=["/usr", "/etc", "/opt", sys.prefix, sys.base_prefix, str(REPO)],
            writable_binds=[str(self.endpoint_dir)],
            # build() starts no servers: those are the `agent` command's, one process per node.
            metrics_port=0,
            health_port=0,
        )

    def _install_chart(self) -> None:
        assert self.cluster is not None
        assert self.real_node is not None
        assert self.prometheus is not None
        # The label the GPU operator puts on GPU nodes, which the chart's agent selects by default.
        self.cluster.kubectl("label", "node", self.real_node.name, f"{LABEL_GPU_PRESENT}=true", "--overwrite")
        self.say("building the controller and agent images from this checkout (cached once built)")
        values = node_values(
            self.real_node,
            self.workdir,
            capabilities=[*REQUIRED_CAPABILITIES, *CONTAINERD_DEFAULT_CAPABILITIES],
            watch_namespace=NAMESPACE,
            prometheus_url=self.prometheus.url,
        )
        install(
            self.cluster, self.real_node, RELEASE, RELEASE_NAMESPACE, values, self.workdir / "values.yaml"
        )
        self.say(f"helm install {RELEASE}: the controller and agent pods are Ready on {self.real_node.name}")

    def _save_release_logs(self) -> None:
        assert self.cluster is not None
        assert self.logs_dir is not None
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        for component in ("controller", "agent"):
            got = self.cluster.kubectl(
                "logs", "-n", RELEASE_NAMESPACE, "-l", f"app.kubernetes.io/component={component}",
                "--tail=-1", check=False,
            )  # fmt: skip
            (self.logs_dir / f"{component}.log").write_text(got.stdout + got.stderr)

    def _install(self) -> None:
        assert self.cluster is not None
        if not self.chart:  # the chart installs them
            self.cluster.install_crds()
        if not self.kubelet:
            for i in range(self.nodes):
                self.cluster.add_gpu_node(f"gpu-node-{i}")
        self.cluster.kubectl("create", "namespace", NAMESPACE)
        nodes = "" if self.kubelet else f", {self.nodes} fake H200 nodes"
        done = f"namespace {NAMESPACE}" if self.chart else f"CRDs installed{nodes}, namespace {NAMESPACE}"
        self.say(done)

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            if task.get_name() == "discovery":
                task.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), timeout=30)
        for node, agent in self.agents.items():
            if self.kubelet:
                break  # the kubelet's containers go with the node
            for key in await asyncio.to_thread(_workload_keys, self.agent_config(node).node.control_root):
                with contextlib.suppress(Exception):
                    await agent.runtime.stop(key)
        if self.chart and self.cluster is not None and self.logs_dir is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._save_release_logs)
        if self._api is not None:
            await self._api.close()
        if self.prometheus is not None:
            await asyncio.to_thread(self.prometheus.stop)
        if self.s3 is not None:
            await asyncio.to_thread(self.s3.stop)
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)

    # ------------------------------------------------------------------ workers
    def _read_registrations(self) -> dict[str, Endpoint]:
        """Workers that registered (cpu_worker writes <pod>.json once it listens)."""
        found: dict[str, Endpoint] = {}
        for path in self.endpoint_dir.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                data = json.loads(path.read_text())
                found[path.stem] = Endpoint(path.stem, f"{data['host']}:{data['port']}")
        return found

    async def _pod_endpoints(self) -> dict[str, Endpoint]:
        """Kubelet pods whose main container runs, at their pod IP."""
        assert self.kube is not None
        pods, _ = await self.kube.list_all(POD, NAMESPACE)
        return {
            p["metadata"]["name"]: Endpoint(p["metadata"]["name"], f"{p['status']['podIP']}:{WORKER_PORT}")
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("podIP")
            and running_container(p) is not None
        }

    async def _discover(self) -> None:
        """The demo's service discovery: keep `workers` current and Prometheus scraping them."""
        assert self.prometheus is not None
        current: list[str] = []
        while True:
            if self.kubelet:
                found = await self._pod_endpoints()
            else:
                found = await asyncio.to_thread(self._read_registrations)
            self.workers = {name: e for name, e in found.items() if name not in self.forgotten}
            wanted = sorted(e.address for e in self.workers.values())
            if wanted != current:
                await asyncio.to_thread(self.prometheus.set_targets, wanted)
                current = wanted
            await asyncio.sleep(0.2)

    def forget_endpoint(self, pod: str) -> None:
        self.forgotten.add(pod)
        self.workers.pop(pod, None)
        with contextlib.suppress(FileNotFoundError):
            (self.endpoint_dir / f"{pod}.json").unlink()

    async def worker_pid(self, pod: Obj) -> int | None:
        if self.chart:
            return await asyncio.to_thread(_worker_in_pod, pod["metadata"]["uid"])
        agent = self.agents.get((pod.get("spec") or {}).get("nodeName") or "")
        if agent is None:
            return None
        workload = await agent.runtime.find(workload_key(pod))
        return workload.pid if workload is not None else None


def _worker_in_pod(pod_uid: str) -> int | None:
    """The reference worker's process in the pod (with the chart, the agent that knows the worker runs
    in a pod of its own, not in the demo)."""
    found = {p.pid: p.ppid for p in host_processes(CPU_WORKER.name) if p.in_pod(pod_uid)}
    # The worker, not a process it started.
    roots = [pid for pid, parent in found.items() if parent not in found]
    return min(roots) if roots else None


def _workload_keys(control_root: Path) -> list[str]:
    """The workloads an agent left behind: each has a control directory named by its key."""
    return sorted(p.name for p in control_root.glob("*")) if control_root.exists() else []


def repo_env() -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
