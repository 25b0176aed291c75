"""A checkpoint's life against the real apiserver: who may make it Ready, and how its deletion waits for
the restores that read it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import POD, ApiError, is_not_found
from dynamo_snapshot.kube.kinds import CHECKPOINT

from .conftest import IDENTITY, Harness, dgd_manifest, eventually

pytestmark = pytest.mark.cluster
DIGEST = "cd" * 32


def _checkpoint(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": name},
        "spec": {
            "identity": IDENTITY,
            "job": {"podTemplateSpec": {"spec": {"containers": [{"name": "main", "image": "vllm:test"}]}}},
        },
    }


async def test_only_the_checkpoint_jobs_pod_can_make_it_ready(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    node = gpu_node(gpus=8)["metadata"]["name"]
    h.agent.checkpoint_outcome = None  # the Job's worker is not checkpointed yet
    await h.kube.create(CHECKPOINT, _checkpoint("user-ckpt"), h.namespace)
    # A pod that only carries the source labels, reporting a finished checkpoint.
    done = protocol.per_container(protocol.ANNOTATION_CHECKPOINT_STATUS, "main")
    forged = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "forged",
            "labels": {
                protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
                protocol.LABEL_CHECKPOINT_SOURCE: protocol.TRUE,
                protocol.LABEL_CHECKPOINT_ID: "user-ckpt",
            },
            "annotations": {done: "completed", protocol.ANNOTATION_ARTIFACT_DIGEST: DIGEST},
        },
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "vllm:test"}]},
    }
    await h.kube.create(POD, forged, h.namespace)

    async def creating() -> dict[str, Any] | None:
        ckpt = await h.kube.get(CHECKPOINT, "user-ckpt", h.namespace)
        return ckpt if (ckpt.get("status") or {}).get("phase") == "Creating" else None

    ckpt = await eventually(creating, within=30)
    assert ckpt["metadata"]["finalizers"] == [protocol.FINALIZER]
    await asyncio.sleep(2)  # several reconciles with the forged report in the cache
    assert (await h.kube.get(CHECKPOINT, "user-ckpt", h.namespace))["status"]["phase"] == "Creating"

    h.agent.checkpoint_outcome = "completed"

    async def ready() -> dict[str, Any] | None:
        ckpt = await h.kube.get(CHECKPOINT, "user-ckpt", h.namespace)
        return ckpt if (ckpt.get("status") or {}).get("phase") == "Ready" else None

    ckpt = await eventually(ready, within=30)
    assert ckpt["status"]["sourcePod"].startswith("user-ckpt-checkpoint-")
    assert ckpt["status"]["artifactDigest"] != DIGEST


async def test_a_deleted_checkpoint_waits_for_the_restores_that_read_it(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    gpu_node(gpus=8)
    await h.apply_dgd(dgd_manifest("held", replicas=1))
    name = await eventually(lambda: h.auto_checkpoint("held"))

    async def ready() -> bool:
        ckpt = await h.kube.get(CHECKPOINT, name, h.namespace)
        return (ckpt.get("status") or {}).get("phase") == "Ready"

    await eventually(ready, within=45)
    h.agent.restore_outcome = lambda pod: "running"  # the agent is still restoring
    await h.scale("held", 2)

    async def restoring() -> list[dict[str, Any]] | None:
        pods = [
            p for p in await h.pods("held") if p["metadata"]["labels"][protocol.LABEL_START_MODE] == "restore"
        ]
        status = protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
        ok = pods and all((p["metadata"].get("annotations") or {}).get(status) == "running" for p in pods)
        return pods if ok else None

    [pod] = await eventually(restoring, within=45)
    await h.kube.delete(CHECKPOINT, name, h.namespace)
    await h.event("DeletionWaits", pod["metadata"]["name"])
    await asyncio.sleep(1)
    ckpt = await h.kube.get(CHECKPOINT, name, h.namespace)
    assert ckpt["metadata"].get("deletionTimestamp")
    assert ckpt["metadata"]["finalizers"] == [protocol.FINALIZER]

    # The restore ends: nothing reads the artifact any more, and the checkpoint goes.
    status = protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
    await h.kube.merge_patch(
        POD, pod["metadata"]["name"], {"metadata": {"annotations": {status: "completed"}}}, h.namespace
    )

    async def gone() -> bool:
        # Auto mode then takes a new checkpoint under the same name: a new object, with a new UID.
        try:
            now = await h.kube.get(CHECKPOINT, name, h.namespace)
        except ApiError as e:
            return is_not_found(e)
        return now["metadata"]["uid"] != ckpt["metadata"]["uid"]

    await eventually(gone, within=30)
