"""NVIDIA Snapshot's generic API end to end on the real kubelet node, with the restore webhook in the path:
a PodSnapshot of a running kubelet pod becomes Ready, then three *plain* pods — nothing snapshot-specific
but the annotation nvidia.com/restore-from — are shaped by the webhook, restored by the node's agent into
their own containers, marked nvidia.com/Restored=True (which their readiness gate waits for) and serve on
their own pod IPs. A plain pod naming a snapshot that does not exist is admitted, marked Restored=False
with the reason, and its container is not started as a cold worker."""

from __future__ import annotations

import asyncio
import json
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import POD, Obj, ResourceKind
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, SNAPSHOT_JOB
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.realnode import TEST_IMAGE, RealNode
from tests.helpers.kubelet_stack import (
    PORT,
    PROMPT,
    Stack,
    capture,
    eventually,
    health,
    post,
    ready,
    snapshot_pod,
)
from tests.helpers.webhook import make_certs, registered_webhook

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

REPLICAS = 3
DEPLOYMENT = ResourceKind("apps", "v1", "deployments", "Deployment")
ENV = [{"name": "WORKER_HOST", "value": "0.0.0.0"}, {"name": "WORKER_PORT", "value": str(PORT)}]


def _plain_pod(node: RealNode, name: str, restore_from: str) -> Obj:
    """What a user writes: the worker's image and its own settings, and the annotation."""
    pod = node.pod(
        name, [{"name": "main", "image": node.worker_image.name, "imagePullPolicy": "Never", "env": ENV}]
    )
    pod["metadata"]["annotations"] = {protocol.ANNOTATION_RESTORE_FROM: restore_from}
    return pod


def _restored(pod: Obj) -> dict[str, Any] | None:
    conds = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c.get("type") == protocol.POD_CONDITION_RESTORED), None)


async def _ready_snapshot(s: Stack, node: RealNode) -> Obj:
    source = snapshot_pod(node, "api-source", {"image": node.worker_image.name}, standby=False)
    source["spec"]["containers"][0]["env"] += ENV
    return await capture(s, source, "api-snap")


async def test_three_plain_pods_are_shaped_by_the_webhook_restored_and_marked_restored(
    stack: Stack, real_node: RealNode, cluster: LocalCluster, tmp_path: Path
) -> None:
    s = stack
    s.start_agent()
    await _ready_snapshot(s, real_node)
    names = [f"api-restored-{i}" for i in range(REPLICAS)]
    async with registered_webhook(cluster, s.kube, s.namespace, make_certs(tmp_path)):
        for name in names:
            await s.kube.create(POD, _plain_pod(real_node, name, "api-snap"), s.namespace)
        await s.kube.create(POD, _plain_pod(real_node, "api-missing", "no-such-snapshot"), s.namespace)

    stored = [await s.kube.get(POD, name, s.namespace) for name in names]
    for pod in stored:  # the webhook's work, as the apiserver stored it
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
        assert gates == [protocol.POD_CONDITION_RESTORED]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
        assert all(env.get(n) == "1" for n in protocol.ENV_RESTORE_STANDBYS), env
        assert env.get(protocol.ENV_CONTROL_DIR) == protocol.CONTROL_MOUNT_PATH

    async def all_restored() -> list[Obj] | None:
        pods = [await s.kube.get(POD, name, s.namespace) for name in names]
        for pod in pods:
            cond = _restored(pod) or {}
            assert cond.get("reason") != protocol.RestoredReason.FAILED, cond
        done = [
            p
            for p in pods
            if (_restored(p) or {}).get("status") == "True" and ready(p) and p["status"].get("podIP")
        ]
        return pods if len(done) == REPLICAS else None

    pods = await eventually(all_restored, 240, f"{REPLICAS} plain pods to be restored and Ready")
    answers = []
    for pod in pods:
        cond = _restored(pod)
        assert cond is not None
        assert cond["reason"] == protocol.RestoredReason.SUCCEEDED
        assert "api-snap" in cond["message"]
        answer = await asyncio.to_thread(post, pod["status"]["podIP"], "/generate", PROMPT)
        # Each restored worker answers on its own pod IP and knows which pod it is now.
        assert answer["pod"] == pod["metadata"]["name"]
        answers.append(answer["text"])
    assert len(set(answers)) == 1  # one captured state, three copies of it
    assert len({p["status"]["podIP"] for p in pods}) == REPLICAS

    async def refused() -> dict[str, Any] | None:
        pod = await s.kube.get(POD, "api-missing", s.namespace)
        cond = _restored(pod) or {}
        return (
            cond
            if cond.get("status") == "False" and cond.get("reason") == protocol.RestoredReason.FAILED
            else None
        )

    cond = await eventually(refused, 60, "the pod naming a missing snapshot to be marked Restored=False")
    assert "no-such-snapshot" in cond["message"]
    missing = await s.kube.get(POD, "api-missing", s.namespace)
    assert not ready(missing)
    ip = missing["status"].get("podIP")
    if ip:  # the container waits as the placeholder: no worker listens there
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(health, ip)


def _sidecar() -> Obj:
    return {
        "name": "sidecar",
        "image": TEST_IMAGE.name,
        "imagePullPolicy": "Never",
        "command": ["sleep", "3600"],
    }


def _snapshot_job(node: RealNode, name: str) -> Obj:
    """The worker in a container called worker, beside a sidecar the capture leaves alone."""
    worker = {"name": "worker", "image": node.worker_image.name, "imagePullPolicy": "Never", "env": ENV}
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "SnapshotJob",
        "metadata": {"name": name},
        "spec": {
            "activeDeadlineSeconds": 300,
            "podSnapshotTemplate": {"targetContainers": ["worker"]},
            "podTemplate": {
                "spec": {
                    **node.pod_overrides(),
                    "terminationGracePeriodSeconds": 1,
                    "containers": [_sidecar(), worker],
                }
            },
        },
    }


def _deployment(node: RealNode, name: str, restore_from: str, replicas: int) -> Obj:
    """Pods whose worker container is called engine, beside a sidecar, mapped from the captured one."""
    pod = _plain_pod(node, name, restore_from)
    [engine] = pod["spec"]["containers"]
    engine["name"] = "engine"
    pod["spec"]["containers"] = [_sidecar(), engine]
    pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_CONTAINER_MAP] = "worker=engine"
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": pod["metadata"]["annotations"]},
                "spec": pod["spec"],
            },
        },
    }


async def test_a_snapshot_job_captures_its_pod_and_a_deployment_restores_from_it(
    stack: Stack, real_node: RealNode, cluster: LocalCluster, tmp_path: Path
) -> None:
    """The examples/plain-vllm flow in miniature: a SnapshotJob runs the worker on the kubelet node until it
    is ready, the node's agent captures it, the job Completes and its pod goes; a Deployment whose pods say
    only restore-from (and where the captured container goes) gets every replica restored. Neither
    container is called main: the capture takes the one the SnapshotJob names, the restore goes into the
    one the map names, and the sidecars beside them are left as they run."""
    s = stack
    s.start_agent()
    await s.kube.create(SNAPSHOT_JOB, _snapshot_job(real_node, "job-snap"), s.namespace)

    async def completed() -> Obj | None:
        job = await s.kube.get(SNAPSHOT_JOB, "job-snap", s.namespace)
        conds = {c["type"]: c for c in (job.get("status") or {}).get("conditions") or []}
        assert conds.get("Failed", {}).get("status") != "True", conds
        return job if conds.get("Completed", {}).get("status") == "True" else None

    job = await eventually(completed, 240, "the SnapshotJob to complete")
    assert job["status"]["podSnapshotName"] == "job-snap"
    snapshot = await s.kube.get(POD_SNAPSHOT, "job-snap", s.namespace)
    assert {c["type"]: c["status"] for c in snapshot["status"]["conditions"]}["Ready"] == "True"

    async def source_gone() -> bool:
        pods, _ = await s.kube.list_all(POD, s.namespace)
        return not [
            p
            for p in pods
            if (p["metadata"].get("labels") or {}).get(protocol.LABEL_SNAPSHOT_JOB) == "job-snap"
        ]

    await eventually(source_gone, 60, "the SnapshotJob's pod to be removed")

    async with registered_webhook(cluster, s.kube, s.namespace, make_certs(tmp_path)):
        await s.kube.create(DEPLOYMENT, _deployment(real_node, "from-job", "job-snap", 2), s.namespace)

        async def replicas_restored() -> list[Obj] | None:
            pods, _ = await s.kube.list_all(POD, s.namespace)
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get("app") == "from-job"]
            for pod in mine:
                assert (_restored(pod) or {}).get("reason") != protocol.RestoredReason.FAILED, _restored(pod)
            done = [p for p in mine if (_restored(p) or {}).get("status") == "True" and ready(p)]
            return done if len(done) == 2 else None

        done = await eventually(replicas_restored, 240, "the Deployment's 2 replicas to be restored")
    for pod in done:
        answer = await asyncio.to_thread(post, pod["status"]["podIP"], "/generate", PROMPT)
        assert answer["pod"] == pod["metadata"]["name"]
        statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
        ids = json.loads(pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORED_CONTAINER_IDS])
        assert ids == {"engine": statuses["engine"]["containerID"].split("://", 1)[-1]}, (ids, statuses)
        assert pod["metadata"]["annotations"][protocol.ANNOTATION_TARGET_CONTAINERS] == "engine"
        assert statuses["sidecar"]["restartCount"] == 0
        assert "running" in statuses["sidecar"]["state"]
