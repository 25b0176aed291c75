"""Mode dynamo-operator: a lost worker pod of a checkpointed component that NVIDIA's Dynamo operator made
(here its stand-in, tests/helpers/dynamo_operator_pods.py) is deleted by the controller, and the
ReplicaSet's new pod in its place is a restore pod; every pod that is not provably the operator's, or
whose component has no Ready checkpoint in the pod's own namespace, is left alone. Against the real
apiserver, kube-controller-manager (the ReplicaSets) and kwok."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.config import ControllerConfig, InstallMode
from dynamo_snapshot.controller.dynamo.operator_failover import LOST_WORKER_DELETED
from dynamo_snapshot.controller.manager import Controller
from dynamo_snapshot.kube import EVENT, POD, Kube, Obj, controller_ref
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT, SNAPSHOT_JOB
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.controller.conftest import eventually
from tests.helpers.dynamo_operator_pods import (
    StandInOperator,
    crash_loop,
    fail_node,
    heal_node,
    worker_template,
)

pytestmark = pytest.mark.cluster

# Beside Dynamo's operator, which runs the snapshot kinds itself: the stand-in writes their status.
LEFT_TO_THE_OPERATOR = frozenset(
    {CHECKPOINT.kind, POD_SNAPSHOT.kind, POD_SNAPSHOT_CONTENT.kind, SNAPSHOT_JOB.kind}
)


@pytest.fixture
async def controller(
    api: client.ApiClient, crds: list[str], request: pytest.FixtureRequest
) -> AsyncIterator[Controller]:
    """The controller in mode dynamo-operator, watching every namespace; a NotReady node's workers count
    as lost after a second. Indirect parametrization overrides its config."""
    config = ControllerConfig(
        mode=InstallMode.DYNAMO_OPERATOR,
        leader_elect=False,
        resync_seconds=5,
        metrics_port=0,
        drain_timeout=5,
        node_loss_grace_seconds=1.0,
        **getattr(request, "param", {}),
    )
    ctrl = Controller(Kube(api, field_manager="tests"), config, left_to_others=LEFT_TO_THE_OPERATOR)
    stop = asyncio.Event()
    task = asyncio.create_task(ctrl.run_until(stop))
    try:
        yield ctrl
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


@pytest.fixture
def other_namespace(cluster: LocalCluster) -> Any:
    name = f"other-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


async def _running(
    op: StandInOperator, component: str, count: int, namespace: str | None = None
) -> list[Obj]:
    async def check() -> list[Obj] | None:
        pods = await op.pods(component, namespace)
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        return running if len(running) == count and len(pods) == count else None

    result: list[Obj] = await eventually(check, within=60)
    return result


async def _replaced(op: StandInOperator, component: str, lost: Obj) -> Obj:
    """The component's pod made in place of ``lost`` by the same ReplicaSet."""
    rs = (controller_ref(lost) or {})["uid"]

    async def check() -> Obj | None:
        pods = await op.pods(component)
        if any(p["metadata"]["uid"] == lost["metadata"]["uid"] for p in pods):
            return None
        new = [p for p in pods if (controller_ref(p) or {}).get("uid") == rs]
        return new[0] if new else None

    found: Obj = await eventually(check, within=30)
    return found


async def _events(kube: Kube, namespace: str, reason: str) -> list[str]:
    events, _ = await kube.list_all(EVENT, namespace, field_selector=f"reason={reason}")
    return [f"{e['involvedObject']['kind']} {e['involvedObject']['name']}: {e['message']}" for e in events]


async def _one_restorable_worker(kube: Kube, namespace: str, nodes: list[str]) -> tuple[StandInOperator, Obj]:
    """One running worker of component decode, kept to ``nodes``, whose next pod restores from a Ready
    PodSnapshot."""
    op = StandInOperator(kube, namespace)
    dgd = await op.dgd("graph", ("decode",))
    await op.snapshot("decode-ckpt", ready=True)
    await op.component(dgd, "decode", replicas=1, nodes=nodes, restore_from="decode-ckpt")
    [pod] = await _running(op, "decode", 1)
    return op, pod


async def test_a_crash_looping_worker_is_replaced_by_a_restore_pod_and_nothing_unproven_is_touched(
    controller: Controller,
    api: client.ApiClient,
    namespace: str,
    other_namespace: str,
    gpu_node: Callable[..., Obj],
) -> None:
    kube = Kube(api, field_manager="tests")
    node = gpu_node()["metadata"]["name"]
    op = StandInOperator(kube, namespace)
    dgd = await op.dgd("graph", ("decode", "prefill", "rogue"))
    await op.snapshot("decode-ckpt", ready=True)
    await op.snapshot("prefill-ckpt", ready=False)
    await op.component(dgd, "decode", replicas=2, nodes=[node], restore_from="decode-ckpt")
    # A Ready checkpoint but not made by the operator: a Deployment of no DGD, and a bare pod.
    await op.component(dgd, "rogue", replicas=1, nodes=[node], restore_from="decode-ckpt", owned=False)
    bare = worker_template("graph", "bare", [node], "decode-ckpt")
    bare["metadata"]["name"] = "bare"
    await kube.create(POD, bare, namespace)
    # The operator's, but its checkpoint is not Ready.
    await op.component(dgd, "prefill", replicas=1, nodes=[node], restore_from="prefill-ckpt")
    # The operator's, but the checkpoint it names is in another namespace (the first one).
    elsewhere = StandInOperator(kube, other_namespace)
    other_dgd = await elsewhere.dgd("graph", ("decode",))
    await elsewhere.component(other_dgd, "decode", replicas=1, nodes=[node], restore_from="decode-ckpt")

    decode = await _running(op, "decode", 2)
    untouched = [
        *await _running(op, "rogue", 1),
        *await _running(op, "bare", 1),
        *await _running(op, "prefill", 1),
        *await _running(elsewhere, "decode", 1, other_namespace),
    ]
    for pod in [decode[0], *untouched]:
        await crash_loop(kube, pod)

    new = await _replaced(op, "decode", decode[0])
    assert new["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "decode-ckpt"
    assert {p["metadata"]["uid"] for p in await op.pods("decode")} >= {decode[1]["metadata"]["uid"]}
    lost = await eventually(lambda: _events(kube, namespace, "WorkerLost"), within=15)
    assert lost == [
        f"DynamoGraphDeployment graph: component decode: pod {decode[0]['metadata']['name']} "
        "lost (crash-loop, node " + node + "); replacing it"
    ]
    deleted = await _events(kube, namespace, LOST_WORKER_DELETED)
    assert len(deleted) == 1, deleted
    assert decode[0]["metadata"]["name"] in deleted[0]

    # Every other crash-looping pod was looked at in the same passes and several resyncs since: kept.
    await asyncio.sleep(6)
    for pod in untouched:
        meta = pod["metadata"]
        current = await kube.get(POD, meta["name"], meta["namespace"])
        assert current["metadata"]["uid"] == meta["uid"]
        assert not current["metadata"].get("deletionTimestamp")
    assert await _events(kube, other_namespace, "WorkerLost") == []
    # Nothing of ours made a pod: every pod is the ReplicaSets' or the test's own.
    pods, _ = await kube.list_all(POD, namespace)
    assert all(
        (controller_ref(p) or {}).get("kind") == "ReplicaSet" or p["metadata"]["name"] == "bare" for p in pods
    )
    assert not any(protocol.LABEL_MANAGED_BY in (p["metadata"].get("labels") or {}) for p in pods)


async def test_a_worker_on_a_notready_node_is_replaced_by_a_restore_pod_elsewhere(
    controller: Controller, api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj]
) -> None:
    kube = Kube(api, field_manager="tests")
    nodes = [gpu_node()["metadata"]["name"] for _ in range(2)]
    op, pod = await _one_restorable_worker(kube, namespace, nodes)
    dead = pod["spec"]["nodeName"]
    await fail_node(kube, dead)

    new = await _replaced(op, "decode", pod)
    assert new["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "decode-ckpt"
    [placed] = await _running(op, "decode", 1)
    assert placed["spec"]["nodeName"] != dead
    lost = await _events(kube, namespace, "WorkerLost")
    assert len(lost) == 1, lost
    assert f"(node-not-ready, node {dead})" in lost[0]


# Any 3 nodes down at once pause failover, whatever else the session cluster holds.
PAUSE_AT_THREE = {"unhealthy_nodes_threshold": 0.01}


@pytest.mark.parametrize("controller", [PAUSE_AT_THREE], indirect=True)
async def test_workers_are_kept_while_many_nodes_are_notready_and_failed_over_once_the_rest_are_back(
    controller: Controller, api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj]
) -> None:
    kube = Kube(api, field_manager="tests")
    nodes = [gpu_node()["metadata"]["name"] for _ in range(3)]
    op, pod = await _one_restorable_worker(kube, namespace, nodes)
    dead = pod["spec"]["nodeName"]
    for node in nodes:
        await fail_node(kube, node)

    paused = await eventually(lambda: _events(kube, namespace, "FailoverPaused"), within=20)
    assert f"keeps its workers there ({pod['metadata']['name']} on {dead})" in paused[0]
    await asyncio.sleep(3)  # well past the node grace: still kept
    kept = await kube.get(POD, pod["metadata"]["name"], namespace)
    assert kept["metadata"]["uid"] == pod["metadata"]["uid"]
    assert await _events(kube, namespace, "WorkerLost") == []

    for node in nodes:
        if node != dead:
            await heal_node(kube, node)
    new = await _replaced(op, "decode", pod)
    assert new["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "decode-ckpt"
    [placed] = await _running(op, "decode", 1)
    assert placed["spec"]["nodeName"] != dead
    assert await _events(kube, namespace, "FailoverResumed")
