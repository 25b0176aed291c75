"""The brakes on failover, against the real apiserver, scheduler, controller-manager and kwok GPU nodes: a
node NotReady for less than the node grace loses no worker, one NotReady for longer has its workers
replaced off every NotReady node, failover pauses while most nodes are NotReady and resumes when they
return, a crash-looping worker's replacements back off (said once, in an Event and the DGD's condition),
NoCompatibleNode is said once, and only about node compatibility, and an apiserver outage that leaves
every node NotReady deletes no worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api import protocol
from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.failover.node_state import node_healthy
from dynamo_snapshot.kube import EVENT, NODE, POD, ApiError, Kube, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.controller.conftest import Harness, dgd_manifest, eventually
from tests.controller.test_failover import _fail_node, _heal_node, _mode, _replaced, _restored_service

pytestmark = pytest.mark.cluster

NodeFactory = Callable[..., dict[str, Any]]
EXITED = protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, "main")


async def _condition(h: Harness, type_: str, graph: str = "fo") -> dict[str, Any]:
    for c in ((await h.dgd(graph)).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


async def _says(h: Harness, type_: str, *words: str) -> bool:
    message = (await _condition(h, type_)).get("message") or ""
    return all(w in message for w in words)


def _names(pods: list[Obj]) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


def _required_not_in(pod: Obj) -> set[str]:
    required = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    return {
        value
        for term in required.get("nodeSelectorTerms") or []
        for expr in term.get("matchExpressions") or []
        if expr["key"] == "kubernetes.io/hostname" and expr["operator"] == "NotIn"
        for value in expr["values"]
    }


async def _healthy(h: Harness, node: str, want: bool) -> bool:
    return node_healthy(await h.kube.get(NODE, node)) == want


async def _cluster_nodes(h: Harness) -> list[str]:
    items, _ = await h.kube.list_all(NODE)
    return [n["metadata"]["name"] for n in items if not n["metadata"].get("deletionTimestamp")]


@pytest.mark.parametrize("harness", [{"node_loss_grace_seconds": 12.0}], indirect=True)
async def test_a_node_not_ready_for_less_than_the_grace_loses_no_worker(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 3)
    node = pods[-1]["spec"]["nodeName"]
    await _fail_node(h, node)
    # Said while it lasts: which node, and from when its workers count as lost.
    await eventually(lambda: _says(h, "Degraded", "NotReady node(s)", node, "count as lost from"), within=10)
    await asyncio.sleep(2)
    await _heal_node(h, node)

    async def note_gone() -> bool:
        return not await _says(h, "Degraded", "NotReady node(s)")

    await eventually(note_gone, within=10)
    await asyncio.sleep(12)  # past the end the grace would have had
    assert _names(await h.pods("fo")) == _names(pods)
    assert await h.events("WorkerLost") == []


@pytest.mark.parametrize("harness", [{"node_loss_grace_seconds": 3.0}], indirect=True)
async def test_workers_of_a_node_not_ready_past_the_grace_are_replaced_off_not_ready_nodes(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 4)
    # A fourth node, with no worker, NotReady too: 2 of 4 nodes down is not enough to pause failover.
    idle = gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580, pods=18)["metadata"]["name"]
    node = next(p for p in pods if _mode(p) == protocol.StartMode.RESTORE.value)["spec"]["nodeName"]
    gone = {p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == node}
    await _fail_node(h, idle)
    await eventually(lambda: _healthy(h, idle, False), within=10)
    failed_at = time.monotonic()
    await _fail_node(h, node)
    await _replaced(h, gone, 4, avoid=node)
    # Not before the grace (the node's transition time has whole seconds: it may start up to 1 s early).
    assert time.monotonic() - failed_at >= 2.0

    async def placed() -> list[Obj]:  # replacements are created first, scheduled a moment later
        now = [p for p in await h.pods("fo") if p["metadata"]["name"] not in _names(pods)]
        return now if len(now) == len(gone) and all(p["spec"].get("nodeName") for p in now) else []

    fresh = await eventually(placed, within=30)
    for pod in fresh:
        assert pod["spec"]["nodeName"] not in {node, idle}
        assert {node, idle} <= _required_not_in(pod), pod["spec"].get("affinity")
    await h.event("WorkerLost", "node-not-ready", node)
    assert await h.events("FailoverPaused") == []


# Longer than failing the three nodes takes: none must be past its grace while the others still look up.
@pytest.mark.parametrize("harness", [{"node_loss_grace_seconds": 3.0}], indirect=True)
async def test_failover_pauses_while_most_nodes_are_not_ready_and_resumes_when_they_return(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 3)
    nodes = await _cluster_nodes(h)
    assert len(nodes) == 3, f"other nodes in the cluster change the NotReady share this test sets: {nodes}"
    for node in nodes:
        await _fail_node(h, node)
    await h.event("FailoverPaused", "3 of 3 nodes are NotReady")
    await eventually(lambda: _says(h, "Degraded", "FailoverPaused", "keeps its workers there"), within=15)
    await asyncio.sleep(4)  # the grace is long over: only the pause keeps them
    assert _names(await h.pods("fo")) == _names(pods)
    assert await h.events("WorkerLost") == []

    # Two nodes come back: 1 of 3 down no longer pauses anything, and its workers are replaced.
    down = pods[0]["spec"]["nodeName"]
    for node in set(nodes) - {down}:
        await _heal_node(h, node)
    gone = {p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == down}
    after = await _replaced(h, gone, 3, avoid=down)
    # A replacement may not be scheduled yet; none is ever bound to the down node.
    assert all(p["spec"].get("nodeName") != down for p in after if p["metadata"]["name"] not in gone)
    await h.event("FailoverResumed")
    await h.event("WorkerLost", "node-not-ready", down)
    [paused] = await h.events("FailoverPaused")
    assert paused.get("count", 1) == 1


@dataclass
class _Killer:
    """Kills every worker of a graph as soon as it runs (restored ones once the agent double reports the
    restore), as the node agent reports a worker process that exited: a worker that dies at once."""

    h: Harness
    graph: str
    seen: dict[str, float] = field(default_factory=dict)  # pod -> when first seen
    killed: set[str] = field(default_factory=set)
    condition_said: set[str] = field(default_factory=set)  # Degraded messages seen meanwhile

    async def run(self) -> None:
        while True:
            for pod in await self.h.pods(self.graph):
                name = pod["metadata"]["name"]
                self.seen.setdefault(name, time.monotonic())
                annotations = pod["metadata"].get("annotations") or {}
                restoring = _mode(pod) == protocol.StartMode.RESTORE.value and not annotations.get(
                    protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
                )
                running = (pod.get("status") or {}).get("phase") == "Running"
                if name in self.killed or not running or restoring:
                    continue
                exited = {"metadata": {"annotations": {EXITED: "worker process 4242 exited (test)"}}}
                with contextlib.suppress(ApiError):
                    await self.h.kube.merge_patch(POD, name, exited, self.h.namespace)
                    self.killed.add(name)
            self.condition_said.add((await _condition(self.h, "Degraded", self.graph)).get("message") or "")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def _killing(h: Harness, graph: str) -> AsyncIterator[_Killer]:
    killer = _Killer(h, graph)
    task = asyncio.create_task(killer.run())
    try:
        yield killer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


CRASH_LOOP = {
    "crash_backoff_initial_seconds": 2.0,
    "crash_backoff_max_seconds": 8.0,
    "crash_backoff_reset_seconds": 10.0,
}


@pytest.mark.parametrize("harness", [CRASH_LOOP], indirect=True)
async def test_a_crash_looping_worker_backs_off_and_says_so_once(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    first = await _restored_service(h, gpu_node, 1)
    async with _killing(h, "fo") as killer:
        await asyncio.sleep(20)
    window = {name for name, seen in killer.seen.items() if name not in _names(first)}
    # Deaths at about 0 s and then waits of 0, 2, 4, 8 s: 4 or 5 replacements in 20 s. Paced only by the
    # failover buckets (5/s) they would be one per kill cycle, 15 or more.
    assert 3 <= len(window) <= 7, sorted(killer.seen.items(), key=lambda kv: kv[1])
    assert len(killer.killed) >= 4
    [event] = await h.events("CrashLoopBackOff")
    assert event["type"] == "Warning"
    assert event.get("count", 1) == 1
    assert "die young" in event["message"]
    assert any("CrashLoopBackOff" in said and "wait until" in said for said in killer.condition_said)
    assert await h.events("NoCompatibleNode") == []

    # The last replacement lives: once no worker died young for the reset time, the backoff ends.
    await h.event("CrashLoopBackOffEnded", "VllmWorker", within=30)

    async def healthy() -> bool:
        svc = ((await h.dgd("fo")).get("status") or {}).get("services", {}).get("VllmWorker") or {}
        return svc.get("readyReplicas") == 1 and await _says(h, "Degraded", "no problem detected")

    await eventually(healthy, within=30)
    assert len(await h.events("CrashLoopBackOff")) == 1


async def test_no_compatible_node_is_said_once_and_only_about_nodes(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    nodes = [
        gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580, pods=18)["metadata"]["name"]
        for _ in range(2)
    ]
    await h.apply_dgd(dgd_manifest("fo", replicas=1))

    async def ready() -> bool:
        items = await h.checkpoints()
        return bool(items) and all((c.get("status") or {}).get("phase") == "Ready" for c in items)

    await eventually(ready, within=60)
    # The GPUs change under the checkpoint: no Ready node matches it any more.
    for node in nodes:
        await h.kube.merge_patch(
            NODE, node, {"metadata": {"labels": {protocol.LABEL_GPU_PRODUCT: "NVIDIA-L40S"}}}
        )
    for replicas in (2, 3, 4):
        await h.scale("fo", replicas)

        async def scaled(n: int = replicas) -> bool:
            return len(await h.pods("fo")) == n

        await eventually(scaled, within=30)
    new = [p for p in await h.pods("fo") if _mode(p) == protocol.StartMode.COLD.value]
    assert len(new) >= 3, "the new replicas start cold"
    [event] = await h.events("NoCompatibleNode")
    assert event.get("count", 1) == 1
    assert "no Ready node matches checkpoint" in event["message"]


async def test_a_failed_checkpoint_is_not_reported_as_no_compatible_node(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580, pods=18)
    h.agent.checkpoint_outcome = "failed"
    await h.apply_dgd(dgd_manifest("fo", replicas=2))

    async def failed() -> bool:
        items = await h.checkpoints()
        return bool(items) and all((c.get("status") or {}).get("phase") == "Failed" for c in items)

    await eventually(failed, within=60)
    for _ in range(2):  # each deleted worker is replaced (cold) while the checkpoint stays Failed
        pods = await eventually(lambda: _two_placed(h), within=30)
        await h.kube.delete(POD, pods[0]["metadata"]["name"], h.namespace)
        await _replaced(h, {pods[0]["metadata"]["name"]}, 2, avoid=None)
    assert await h.events("NoCompatibleNode") == []


async def _two_placed(h: Harness) -> list[Obj]:
    pods = await h.pods("fo")
    return pods if len(pods) == 2 and all((p.get("spec") or {}).get("nodeName") for p in pods) else []


@pytest.fixture
async def controller(api: client.ApiClient, namespace: str, crds: list[str]) -> AsyncIterator[Kube]:
    """The controller alone, with its default node grace: no agent double, whose polling would not
    outlive an apiserver outage (the service has no Ready checkpoint; its workers are cold starts)."""
    kube = Kube(api, field_manager="tests")
    config = ControllerConfig(
        namespace=namespace, leader_elect=False, resync_seconds=5, metrics_port=0, drain_timeout=5
    )
    stop = asyncio.Event()
    task = asyncio.create_task(build_controller(kube, config).run_until(stop))
    try:
        yield kube
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


async def test_a_control_plane_outage_deletes_no_worker(
    cluster: LocalCluster, controller: Kube, namespace: str, gpu_node: NodeFactory
) -> None:
    kube = controller
    nodes = [gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580)["metadata"]["name"] for _ in range(3)]
    await DgdClient(kube).create(dgd_manifest("blip", replicas=3), namespace)

    async def running() -> list[Obj]:
        items, _ = await kube.list_all(POD, namespace, label_selector=f"{protocol.LABEL_GRAPH}=blip")
        up = [p for p in items if (p.get("status") or {}).get("phase") == "Running"]
        return items if len(items) == 3 and len(up) == 3 else []

    before = _names(await eventually(running, within=60))

    async def nodes_ready(want: bool) -> bool:
        items, _ = await kube.list_all(NODE)
        mine = [n for n in items if n["metadata"]["name"] in nodes]
        return len(mine) == 3 and all(node_healthy(n) == want for n in mine)

    # The apiserver goes away for 22 s. kwok (every kubelet) stops with it, so that the controller-manager,
    # back before the kubelets, sees their heartbeats stale past its grace and marks every node NotReady,
    # as it did in the outage this reproduces.
    try:
        await asyncio.to_thread(cluster.stop_component, "kwok")
        await asyncio.to_thread(cluster.stop_component, "kube-apiserver")
        await asyncio.sleep(22)
        await asyncio.to_thread(cluster.start_component, "kube-apiserver")
        await eventually(lambda: nodes_ready(False), within=60)

        async def noted() -> bool:
            conds = ((await DgdClient(kube).get("blip", namespace)).get("status") or {}).get(
                "conditions"
            ) or []
            return any("NotReady node(s)" in (c.get("message") or "") for c in conds)

        await eventually(noted, within=30)  # the controller saw the nodes down, and keeps the workers
        await asyncio.sleep(5)
    finally:
        await asyncio.to_thread(cluster.start_component, "kube-apiserver")
        await asyncio.to_thread(cluster.start_component, "kwok")
    try:
        await eventually(lambda: nodes_ready(True), within=60)
        assert all(cluster.alive().values()), f"the outage left components down: {cluster.alive()}"
        items, _ = await kube.list_all(POD, namespace, label_selector=f"{protocol.LABEL_GRAPH}=blip")
        assert _names([p for p in items if not p["metadata"].get("deletionTimestamp")]) == before
        events, _ = await kube.list_all(EVENT, namespace)
        assert [e["message"] for e in events if e.get("reason") == "WorkerLost"] == []
    finally:
        # The controller-manager's (and scheduler's) caches can stay stale after the apiserver came back
        # (seen: leases "read version ... is not as new as written version", no default ServiceAccount in
        # new namespaces). Restarted, they serve the tests that share this cluster.
        for name in ("kube-controller-manager", "kube-scheduler"):
            await asyncio.to_thread(cluster.stop_component, name)
            await asyncio.to_thread(cluster.start_component, name)
