"""The brake on failover, pulled by a real outage: every kubelet (kwok) stops for longer than the node
grace, the controller-manager marks the nodes NotReady, and the controller process (its grace shortened in
its config file, as an operator would) pauses failover (FailoverPaused) and deletes no worker; once the
nodes are back it resumes, the nodes that come back last are not taken for lost on the way, and a node that
then fails alone has its workers replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import parse_rfc3339
from dynamo_snapshot.controller.failover.node_state import node_healthy
from dynamo_snapshot.kube import EVENT, NODE, POD, Kube, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.nodes import KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE
from tests.controller.conftest import dgd_manifest, eventually
from tests.helpers.cli import CLI

pytestmark = pytest.mark.cluster
NodeFactory = Callable[..., dict[str, Any]]

# Short enough for a test, long enough that nodes the controller-manager marks NotReady a monitor period
# (5 s) apart are all down before the first one's grace ends, and that kwok, started again on a busy
# machine, brings the others back well inside the fresh grace the late one gets.
GRACE = 30.0
GRAPH = "outage"


@dataclass
class Process:
    kube: Kube
    log: Path

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


@pytest.fixture
async def controller_process(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, crds: list[str], tmp_path: Path
) -> AsyncIterator[Process]:
    """`dynamo-snapshot controller --config FILE`, the node grace set in FILE."""
    config = tmp_path / "controller.yaml"
    settings = {
        "namespace": namespace,
        "leaderElect": False,
        "resyncSeconds": 5,
        "metricsPort": 0,
        "healthPort": 0,
        "drainTimeout": 5,
        "autoscale": False,
        "nodeLossGraceSeconds": GRACE,
    }
    config.write_text(yaml.safe_dump(settings))
    log = tmp_path / "controller.log"
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    with log.open("w") as out:
        proc = await asyncio.create_subprocess_exec(
            *CLI, "controller", "--config", str(config), env=env, stdout=out, stderr=out
        )
    try:
        yield Process(Kube(api, field_manager="tests"), log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _names(pods: list[Obj]) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


async def _workers(kube: Kube, namespace: str) -> list[Obj]:
    items, _ = await kube.list_all(POD, namespace, label_selector=f"{protocol.LABEL_GRAPH}={GRAPH}")
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


async def _events(kube: Kube, namespace: str, reason: str) -> list[str]:
    items, _ = await kube.list_all(EVENT, namespace)
    return [str(e.get("message")) for e in items if e.get("reason") == reason]


async def _event_times(kube: Kube, namespace: str, reason: str) -> list[datetime]:
    """When the events of `reason` were first recorded (the controller's clock, whole seconds)."""
    items, _ = await kube.list_all(EVENT, namespace)
    return sorted(parse_rfc3339(e["firstTimestamp"]) for e in items if e.get("reason") == reason)


async def _nodes(kube: Kube, names: list[str]) -> list[Obj]:
    items, _ = await kube.list_all(NODE)
    return [n for n in items if n["metadata"]["name"] in names]


async def _node_states(kube: Kube, names: list[str]) -> list[str]:
    """Each node's Ready condition and taints, for a failure message."""
    states = []
    for node in await _nodes(kube, names):
        ready = next((c for c in node["status"].get("conditions") or [] if c["type"] == "Ready"), {})
        taints = [f"{t['key']}:{t['effect']}@{t.get('timeAdded')}" for t in node["spec"].get("taints") or []]
        since = ready.get("lastTransitionTime")
        states.append(f"{node['metadata']['name']} Ready={ready.get('status')}@{since} {taints}")
    return states


def _down_since(node: Obj) -> datetime:
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    return parse_rfc3339(ready["lastTransitionTime"])


async def test_an_outage_longer_than_the_node_grace_pauses_failover_and_deletes_nothing(
    cluster: LocalCluster, controller_process: Process, namespace: str, gpu_node: NodeFactory
) -> None:
    kube = controller_process.kube
    nodes = [gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580)["metadata"]["name"] for _ in range(3)]
    manifest = dgd_manifest(GRAPH, replicas=3)
    del manifest["spec"]["services"]["VllmWorker"]["checkpoint"]  # cold workers: no node agent needed
    await DgdClient(kube).create(manifest, namespace)

    async def running() -> list[Obj]:
        pods = await _workers(kube, namespace)
        up = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        return pods if len(pods) == 3 and len(up) == 3 else []

    pods = await eventually(running, within=60)
    before = _names(pods)

    async def healthy(names: list[str], want: bool) -> list[Obj]:
        mine = await _nodes(kube, names)
        return mine if len(mine) == len(names) and all(node_healthy(n) == want for n in mine) else []

    async def untouched_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            now = _names(await _workers(kube, namespace))
            lost = await _events(kube, namespace, "WorkerLost")
            if now != before or lost:
                states = await _node_states(kube, nodes)
                pytest.fail(
                    f"workers replaced: {sorted(now)}, lost: {lost}; the nodes: {states}; "
                    f"the controller:\n{controller_process.tail()}"
                )
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)

    # The last node to come back: kwok is not given it again at once.
    late = pods[0]["spec"]["nodeName"]
    try:
        await asyncio.to_thread(cluster.stop_component, "kwok")
        down = await eventually(lambda: healthy(nodes, False), within=90, interval=0.5)
        paused = await eventually(lambda: _events(kube, namespace, "FailoverPaused"), within=30)
        assert "nodes are NotReady or unreachable" in paused[0]
        # The outage outlasts the grace of every node by far: only the pause keeps the workers.
        last_down = max(_down_since(n) for n in down)
        await untouched_for(GRACE + 10 - (datetime.now(UTC) - last_down).total_seconds())
        status = (await DgdClient(kube).get(GRAPH, namespace)).get("status") or {}
        degraded = next(c for c in status.get("conditions") or [] if c["type"] == "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "FailoverPaused"), degraded
        assert "keeps its workers there" in degraded["message"]
    finally:
        await kube.merge_patch(NODE, late, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: None}}})
        await asyncio.to_thread(cluster.start_component, "kwok")

    # The others are back, which ends the pause; the late one, down far longer than the grace, gets a fresh
    # grace from then: its workers are not taken for lost while its heartbeat may be on its way.
    await eventually(lambda: healthy([n for n in nodes if n != late], True), within=90, interval=0.2)
    resumed = await eventually(lambda: _event_times(kube, namespace, "FailoverResumed"), within=30)
    # Its fresh grace runs from the resume, not from when this test saw the others back (kwok brings them
    # back one by one, the last possibly well after the resume on a busy machine): back half-way through.
    await untouched_for(GRACE / 2 - (datetime.now(UTC) - resumed[0]).total_seconds())
    await _set_ready(kube, late, True)
    await eventually(lambda: healthy(nodes, True), within=30, interval=0.2)
    await untouched_for(GRACE / 2 + 2)  # past the end of the fresh grace
    assert len(await _events(kube, namespace, "FailoverPaused")) == 1

    # Failover works as before: one node failing alone has its workers replaced once its grace is over.
    pods = await _workers(kube, namespace)
    lost_node = pods[0]["spec"]["nodeName"]
    gone = {p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == lost_node}
    await kube.merge_patch(NODE, lost_node, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: None}}})
    await _set_ready(kube, lost_node, False)
    failed_at = time.monotonic()

    async def replaced() -> list[Obj]:
        now = await _workers(kube, namespace)
        placed = all(p["spec"].get("nodeName") for p in now)
        return now if len(now) == 3 and not (_names(now) & gone) and placed else []

    after = await eventually(replaced, within=60, interval=0.5)
    # Not before the grace (the node's transition time has whole seconds: it may start up to 1 s early).
    assert time.monotonic() - failed_at >= GRACE - 1.5
    assert all(p["spec"]["nodeName"] != lost_node for p in after)
    lost = await _events(kube, namespace, "WorkerLost")
    assert lost
    assert all("node-not-ready" in m and lost_node in m for m in lost)


async def _set_ready(kube: Kube, node: str, ready: bool) -> None:
    """Report the node Ready (handed back to kwok, which heartbeats it) or NotReady from now, as a dead
    kubelet's node looks once the node controller notices (tests/controller/test_failover.py's way)."""
    if ready:
        annotations = {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE}
        await kube.merge_patch(NODE, node, {"metadata": {"annotations": annotations}})
    current = await kube.get(NODE, node)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status, reason = ("True", "KubeletReady") if ready else ("False", "KubeletStopped")
    # Back Ready with a heartbeat of now: one of the outage's time would have the node controller mark it
    # Unknown again before kwok, given it back, heartbeats it (slow on a loaded machine).
    fields = {"status": status, "reason": reason, "lastTransitionTime": now}
    if ready:
        fields["lastHeartbeatTime"] = now
    conditions = [{**c, **fields} if c["type"] == "Ready" else c for c in current["status"]["conditions"]]
    await kube.merge_patch(NODE, node, {"status": {"conditions": conditions}}, subresource="status")
