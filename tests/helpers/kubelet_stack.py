"""A controller and a node agent (runtime containerd) in-process against the real kubelet node, and the
CPU reference worker's graph on it: shared by the kubelet-node tests and benchmarks/kubelet_restore.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime.containerd import ContainerdRuntime
from dynamo_snapshot.agent.watcher import NodeAgent
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import ArtifactCache, ArtifactStore
from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.controller.manager import ControllerConfig
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.kube import POD, Kube, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT
from dynamo_snapshot.kube.until_written import get_or_none
from dynamo_snapshot_dev.demo.scenario import kubelet_worker_spec, worker_graph
from dynamo_snapshot_dev.localcluster.realnode import RUNC_ROOT, RealNode
from dynamo_snapshot_dev.localcluster.realnode.host import host_processes

GRAPH, SERVICE, PORT = "kub", "CpuWorker", 8000
MEMORY_LIMIT, MEMORY_LIMIT_BYTES = "160Mi", 160 << 20
PROMPT = b"what does a restored worker answer?"


@dataclass
class Stack:
    kube: Kube
    namespace: str
    node: RealNode
    criu: Criu
    state: Path
    store: Path
    agent_task: asyncio.Task[None] | None = None
    runtime: ContainerdRuntime | None = None
    _controller: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def start_controller(self) -> None:
        config = ControllerConfig(
            namespace=self.namespace, leader_elect=False, resync_seconds=5, metrics_port=0, drain_timeout=5
        )
        self._controller = asyncio.create_task(build_controller(self.kube, config).run_until(self._stop))

    async def close(self) -> None:
        self._stop.set()
        if self.agent_task is not None:
            await self.kill_agent()
        if self._controller is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._controller, 30)

    def start_agent(
        self,
        runc_root: Path = RUNC_ROOT,
        *,
        objects: ObjectStore | None = None,
        cache: ArtifactCache | None = None,
        **settings: Any,
    ) -> ContainerdRuntime:
        runtime = ContainerdRuntime(self.criu, self.state, runc_root=runc_root)
        config = AgentConfig.model_validate(
            {"node_name": self.node.name, "runc_root": runc_root, "ready_timeout_seconds": 120, **settings}
        )
        executor = Executor(
            runtime,
            ArtifactStore(self.store),
            self.criu,
            config,
            cuda=None,
            gpus=None,
            cache=cache,
            objects=objects,
        )
        agent = NodeAgent(self.kube, executor, runtime)
        self.agent_task = asyncio.create_task(agent.run_until(asyncio.Event()))
        self.runtime = runtime
        return runtime

    async def delete_pod(self, name: str) -> None:
        """Delete the pod and wait until the apiserver no longer has it."""
        await self.kube.delete(POD, name, self.namespace)
        # Nothing here signals the deletion: the apiserver is asked again.
        while await get_or_none(self.kube, POD, name, self.namespace) is not None:  # noqa: ASYNC110
            await asyncio.sleep(0.1)

    async def kill_agent(self) -> None:
        """End the agent at once, as a killed agent process ends (no clean-up of its own)."""
        assert self.agent_task is not None
        self.agent_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.agent_task
        self.agent_task = None


def graph_manifest(node: RealNode, replicas: int) -> Obj:
    env = {"WORKER_WEIGHTS_MIB": "24", "WORKER_COMPILE_ROUNDS": "20000", "WORKER_SERVICE_MS": "1"}
    spec = kubelet_worker_spec(node, env, port=PORT, memory=MEMORY_LIMIT)
    return worker_graph(GRAPH, SERVICE, spec, replicas=replicas)


def post(ip: str, path: str = "/generate", body: bytes = PROMPT) -> dict[str, Any]:
    req = urllib.request.Request(f"http://{ip}:{PORT}{path}", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def serving(ip: str) -> bool:
    """Whether the worker at ``ip`` answers ``GET /health`` with 200 (within a second)."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{PORT}/health", timeout=1) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


async def first_answer(ip: str, within: float = 30) -> dict[str, Any]:
    """The restored worker's first answer to a prompt. "completed" is written once the process is restored
    and told so; the worker opens its port on resuming from that signal, a moment later (as a readiness
    probe would wait for)."""

    async def answer() -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(post, ip)
        except OSError:
            return None

    got: dict[str, Any] = await eventually(answer, within, f"the restored worker at {ip} to answer")
    return got


def health(ip: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{ip}:{PORT}/health", timeout=5) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def ready(pod: Obj) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


async def pods(s: Stack, mode: str) -> list[Obj]:
    pods, _ = await s.kube.list_all(POD, s.namespace)
    return [
        p
        for p in pods
        if (p["metadata"].get("labels") or {}).get(protocol.LABEL_START_MODE) == mode
        and not p["metadata"].get("deletionTimestamp")
    ]


async def eventually(check: Any, within: float, what: str) -> Any:
    deadline = asyncio.get_running_loop().time() + within
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out after {within:.0f}s waiting for {what} (last: {last!r})")


async def checkpointed_graph(s: Stack) -> tuple[Obj, Obj]:
    """The graph applied with one replica: its Ready Auto-mode checkpoint and its Ready cold worker."""
    await DgdClient(s.kube).create(
        {**graph_manifest(s.node, 1), "metadata": {"name": GRAPH, "namespace": s.namespace}}
    )

    async def checkpoint_ready() -> Obj | None:
        items, _ = await s.kube.list_all(CHECKPOINT, s.namespace)
        for ckpt in items:
            phase = (ckpt.get("status") or {}).get("phase")
            assert phase != "Failed", ckpt["status"]
            if phase == "Ready":
                return ckpt
        return None

    ckpt = await eventually(checkpoint_ready, 180, "the Auto-mode checkpoint to be Ready")

    async def cold_ready() -> list[Obj]:
        return [p for p in await pods(s, protocol.StartMode.COLD.value) if ready(p)]

    (cold,) = await eventually(cold_ready, 120, "the cold-started worker to be Ready")
    return ckpt, cold


def snapshot_pod(node: RealNode, name: str, main: Obj, *, standby: bool, **spec: Any) -> Obj:
    """A pod on the real node whose container ``main`` has the snapshot control volume and variables,
    and with ``standby`` the restore pods' standby variables."""
    env = [{"name": n, "value": protocol.CONTROL_MOUNT_PATH} for n in protocol.ENV_CONTROL_DIRS]
    if standby:
        env += [{"name": n, "value": "1"} for n in protocol.ENV_RESTORE_STANDBYS]
    container = {
        "name": "main",
        "imagePullPolicy": "Never",
        **main,
        "env": env,
        "volumeMounts": [{"name": protocol.CONTROL_VOLUME_NAME, "mountPath": protocol.CONTROL_MOUNT_PATH}],
    }
    volumes = [{"name": protocol.CONTROL_VOLUME_NAME, "emptyDir": {}}]
    return node.pod(name, [container], volumes=volumes, **spec)


def restore_pod(
    s: Stack, name: str, dgd: Obj, ckpt: Obj, image: str, command: list[str] | None, *, standby: bool
) -> Obj:
    """A restore pod of the graph's checkpoint, shaped by hand to be wrong in one way."""
    main: Obj = {"image": image, **({"command": command} if command else {})}
    pod = snapshot_pod(s.node, name, main, standby=standby, restartPolicy="Never")
    ckpt_name = ckpt["metadata"]["name"]
    pod["metadata"].update(
        namespace=s.namespace,
        labels={protocol.LABEL_RESTORE_TARGET: protocol.TRUE, protocol.LABEL_CHECKPOINT_ID: ckpt_name},
        annotations={protocol.ANNOTATION_RESTORE_FROM: ckpt_name},
        # One of the graph's pods (the checkpoint is the graph's own), though not one it manages.
        ownerReferences=[
            {
                "apiVersion": dgd["apiVersion"],
                "kind": dgd["kind"],
                "name": dgd["metadata"]["name"],
                "uid": dgd["metadata"]["uid"],
                "controller": False,
            }
        ],
    )
    return pod


def worker_processes() -> dict[int, tuple[str, str]]:
    """The host's cpu_worker processes: pid -> (command line, cgroups)."""
    return {p.pid: (p.cmdline, p.cgroups) for p in host_processes("cpu_worker.py")}


def workers_outside_pods() -> list[str]:
    """cpu_worker processes on the host that are in no pod's cgroup."""
    return [
        f"{pid}: {cmdline}"
        for pid, (cmdline, cgroups) in worker_processes().items()
        if "/kubepods/" not in cgroups
    ]


async def capture(s: Stack, source: Obj, name: str) -> Obj:
    """Run the pod ``source`` (its container main) in the stack's namespace and capture it as the
    PodSnapshot ``name``; the PodSnapshot once Ready (a Failed one fails the test)."""
    await s.kube.create(POD, {**source, "metadata": {**source["metadata"], "namespace": s.namespace}})
    await s.kube.create(
        POD_SNAPSHOT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {"name": name, "namespace": s.namespace},
            "spec": {"source": {"podRef": {"name": source["metadata"]["name"], "containers": ["main"]}}},
        },
    )

    async def snapshot_ready() -> Obj | None:
        obj = await s.kube.get(POD_SNAPSHOT, name, s.namespace)
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
        assert conds.get("Failed", {}).get("status") != "True", conds
        return obj if conds.get("Ready", {}).get("status") == "True" else None

    snapshot: Obj = await eventually(snapshot_ready, 180, f"PodSnapshot {name} to be Ready")
    return snapshot


async def captured_worker(s: Stack, source_name: str, snapshot_name: str = "snap") -> tuple[Obj, Obj]:
    """The CPU reference worker in a kubelet pod of its own and a PodSnapshot of it, once Ready: (the
    source pod as created, the Ready PodSnapshot)."""
    env = [{"name": "WORKER_HOST", "value": "0.0.0.0"}, {"name": "WORKER_PORT", "value": str(PORT)}]
    source = snapshot_pod(s.node, source_name, {"image": s.node.worker_image.name}, standby=False)
    source["spec"]["containers"][0]["env"] += env
    created = await s.kube.create(
        POD, {**source, "metadata": {**source["metadata"], "namespace": s.namespace}}
    )
    await s.kube.create(
        POD_SNAPSHOT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {"name": snapshot_name, "namespace": s.namespace},
            "spec": {"source": {"podRef": {"name": source_name, "containers": ["main"]}}},
        },
    )

    async def snapshot_ready() -> Obj | None:
        obj = await s.kube.get(POD_SNAPSHOT, snapshot_name, s.namespace)
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
        assert conds.get("Failed", {}).get("status") != "True", conds
        return obj if conds.get("Ready", {}).get("status") == "True" else None

    snapshot: Obj = await eventually(snapshot_ready, 180, "the PodSnapshot to be Ready")
    return created, snapshot
