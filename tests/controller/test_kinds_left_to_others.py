"""Beside an operator that defines the snapshot kinds itself (recent Dynamo operators define DynamoCheckpoint,
PodSnapshot and PodSnapshotContent), mode dynamo-operator leaves every such kind whose CRD is not ours to
that operator: the controller reads which at start, never reconciles their objects, and its restore
webhook lets restore-from pods pass unchanged. Mode standalone runs them all."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.admission import AdmissionRequest
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.controller.config import ControllerConfig, InstallMode
from dynamo_snapshot.controller.install_mode import crd_name, kinds_left_to_others
from dynamo_snapshot.controller.webhook_server import WebhookServer
from dynamo_snapshot.kube import POD, ApiError, Kube, Obj, ResourceKind, is_not_found
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.controller.conftest import eventually

OWNER = f"{protocol.LABEL_CRD_OWNER}={protocol.MANAGED_BY_VALUE}"


@contextlib.contextmanager
def not_ours(cluster: LocalCluster, *kinds: ResourceKind) -> Iterator[None]:
    """The CRDs of ``kinds`` without our ownership label inside the block, as another operator's are."""
    names = [crd_name(k) for k in kinds]
    for name in names:
        cluster.kubectl("label", "crd", name, f"{protocol.LABEL_CRD_OWNER}-")
    try:
        yield
    finally:
        for name in names:
            cluster.kubectl("label", "--overwrite", "crd", name, OWNER)


@pytest.mark.cluster
async def test_only_foreign_kinds_are_left_and_only_in_dynamo_operator_mode(
    cluster: LocalCluster, api: client.ApiClient, crds: list[str]
) -> None:
    kube = Kube(api, field_manager="tests")
    assert await kinds_left_to_others(kube, InstallMode.DYNAMO_OPERATOR) == frozenset()
    with not_ours(cluster, CHECKPOINT, POD_SNAPSHOT):
        left = await kinds_left_to_others(kube, InstallMode.DYNAMO_OPERATOR)
        assert left == {"DynamoCheckpoint", "PodSnapshot"}
        assert await kinds_left_to_others(kube, InstallMode.STANDALONE) == frozenset()


@pytest.mark.cluster
async def test_a_podsnapshot_left_to_another_operator_is_not_bound(
    api: client.ApiClient, namespace: str, crds: list[str], gpu_node: Callable[..., Obj]
) -> None:
    kube = Kube(api, field_manager="tests")
    node = gpu_node()["metadata"]["name"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "source"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "worker:1"}]},
    }
    await kube.create(POD, pod, namespace)
    snapshot = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {"name": "left"},
        "spec": {"source": {"podRef": {"name": "source", "containers": ["main"]}}},
    }
    config = ControllerConfig(namespace=namespace, leader_elect=False, resync_seconds=1, metrics_port=0)
    created = await kube.create(POD_SNAPSHOT, snapshot, namespace)

    async def bound() -> bool:
        obj = await kube.get(POD_SNAPSHOT, "left", namespace)
        return bool((obj.get("status") or {}).get("boundSnapshotContentName"))

    # Left to another operator: resynced several times, never bound, no content made.
    stop = asyncio.Event()
    task = asyncio.create_task(build_controller(kube, config, frozenset({"PodSnapshot"})).run_until(stop))
    await asyncio.sleep(4)
    stop.set()
    await task
    assert not await bound()
    assert content_name(created["metadata"]["uid"]) not in {
        c["metadata"]["name"] for c in (await kube.list_all(POD_SNAPSHOT_CONTENT))[0]
    }
    # The same object, run by this controller: bound (the positive control), and deleted while it runs.
    stop = asyncio.Event()
    task = asyncio.create_task(build_controller(kube, config).run_until(stop))
    try:
        await eventually(bound, within=20)
        await kube.delete(POD_SNAPSHOT, "left", namespace)

        async def gone() -> bool:
            try:
                await kube.get(POD_SNAPSHOT, "left", namespace)
            except ApiError as e:
                if is_not_found(e):
                    return True
                raise
            return False

        await eventually(gone, within=20)
    finally:
        stop.set()
        await task


async def test_the_webhook_lets_restore_pods_pass_when_podsnapshots_are_anothers() -> None:
    pod = {
        "metadata": {"name": "w", "annotations": {protocol.ANNOTATION_RESTORE_FROM: "snap"}},
        "spec": {"containers": [{"name": "main", "image": "worker:1"}]},
    }
    request = AdmissionRequest.model_validate(
        {
            "uid": "1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": "team",
            "object": pod,
        }
    )
    # No client at all: passing by reads nothing (shaping would look the snapshot up and fail here).
    server = WebhookServer(None, Path("/nonexistent"), 0, passes_by=True)  # type: ignore[arg-type]
    answer = await server.review(request)
    assert answer.allowed
    assert answer.patch is None
    assert not answer.warnings
