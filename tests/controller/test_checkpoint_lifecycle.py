"""A checkpoint's life against the real apiserver: the SnapshotJob it owns takes it (the node agent's
outcome is written on the PodSnapshotContent here, as the agent writes it), only that job's PodSnapshot can
make it Ready, a failure says why, and its deletion waits for the restores that read it and then takes the
SnapshotJob, the PodSnapshot and its content with it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import now_rfc3339
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.api.snapshotjob import SnapshotJobReason
from dynamo_snapshot.controller.dynamo.checkpoint_reconciler import LEGACY_CHECKPOINT_MESSAGE
from dynamo_snapshot.controller.podspec import owner_reference
from dynamo_snapshot.kube import POD, ApiError, Obj, is_not_found
from dynamo_snapshot.kube.kinds import CHECKPOINT, JOB, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT, SNAPSHOT_JOB

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


async def _phase(h: Harness, name: str, phase: str) -> Obj:
    async def check() -> Obj | None:
        ckpt: Obj = await h.kube.get(CHECKPOINT, name, h.namespace)
        return ckpt if (ckpt.get("status") or {}).get("phase") == phase else None

    found: Obj = await eventually(check, within=45)
    return found


async def _get(h: Harness, kind: Any, name: str) -> Obj | None:
    try:
        obj: Obj = await h.kube.get(kind, name, h.namespace)
    except ApiError as e:
        if is_not_found(e):
            return None
        raise
    return obj


async def test_only_its_own_snapshot_jobs_podsnapshot_can_make_it_ready(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    node = gpu_node(gpus=8)["metadata"]["name"]
    h.agent.checkpoint_outcome = None  # the SnapshotJob's worker is not checkpointed yet
    ckpt = await h.kube.create(CHECKPOINT, _checkpoint("user-ckpt"), h.namespace)
    ckpt = await _phase(h, "user-ckpt", "Creating")
    assert ckpt["metadata"]["finalizers"] == [protocol.FINALIZER]
    # A PodSnapshot of another pod that claims the checkpoint (its labels, C as controller) and is Ready.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "forged"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "vllm:test"}]},
    }
    await h.kube.create(POD, pod, h.namespace)
    forged = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {
            "name": "forged",
            "labels": {protocol.LABEL_SNAPSHOT_JOB: "user-ckpt-checkpoint"},
            "ownerReferences": [owner_reference(ckpt)],
        },
        "spec": {"source": {"podRef": {"name": "forged", "containers": ["main"]}}},
    }
    snap = await h.kube.create(POD_SNAPSHOT, forged, h.namespace)
    content = content_name(snap["metadata"]["uid"])

    async def taken_up() -> Obj | None:
        found = await h.kube.get(POD_SNAPSHOT_CONTENT, content)
        return found if (found.get("status") or {}).get("conditions") else None

    await eventually(taken_up)
    ready = {
        "conditions": [
            {
                "type": t,
                "status": s,
                "reason": "Captured",
                "message": "forged",
                "lastTransitionTime": now_rfc3339(),
            }
            for t, s in (("Ready", "True"), ("Failed", "False"))
        ],
        "artifact": {"location": "/forged", "digest": DIGEST, "sizeBytes": 1},
    }
    await h.kube.patch_status(POD_SNAPSHOT_CONTENT, content, ready)

    async def forged_ready() -> bool:
        return bool(cond.is_true(await h.kube.get(POD_SNAPSHOT, "forged", h.namespace), cond.READY))

    await eventually(forged_ready)
    await asyncio.sleep(2)  # several reconciles with the forged PodSnapshot Ready in the cache
    status = (await h.kube.get(CHECKPOINT, "user-ckpt", h.namespace))["status"]
    assert status["phase"] == "Creating"
    assert status.get("podSnapshotName") == "user-ckpt-checkpoint"

    h.agent.checkpoint_outcome = "completed"
    ckpt = await _phase(h, "user-ckpt", "Ready")
    assert ckpt["status"]["sourcePod"].startswith("user-ckpt-checkpoint-")
    assert ckpt["status"]["artifactDigest"] != DIGEST
    assert ckpt["status"]["podSnapshotName"] == "user-ckpt-checkpoint"


async def test_a_checkpoint_is_taken_by_a_snapshot_job_it_owns_and_deleted_with_it(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    gpu_node(gpus=8)
    body = _checkpoint("owned")
    body["spec"]["job"]["activeDeadlineSeconds"] = 900
    body["spec"]["job"]["podTemplateSpec"]["metadata"] = {"labels": {"team": "a"}}
    created = await h.kube.create(CHECKPOINT, body, h.namespace)
    uid = created["metadata"]["uid"]
    ckpt = await _phase(h, "owned", "Ready")
    await h.event("SnapshotJobCreated", "owned-checkpoint")
    await h.event("CheckpointReady", "owned-checkpoint")

    job = await h.kube.get(SNAPSHOT_JOB, "owned-checkpoint", h.namespace)
    assert [(r["kind"], r["uid"], r["controller"]) for r in job["metadata"]["ownerReferences"]] == [
        ("DynamoCheckpoint", uid, True)
    ]
    labels = job["metadata"]["labels"]
    assert labels[protocol.LABEL_CHECKPOINT_ID] == "owned"
    assert labels[protocol.LABEL_CHECKPOINT_HASH] == ckpt["status"]["identityHash"]
    assert labels[protocol.LABEL_MANAGED_BY] == protocol.MANAGED_BY_VALUE
    assert job["spec"]["activeDeadlineSeconds"] == 900
    assert job["spec"]["podSnapshotTemplate"] == {"targetContainers": ["main"]}
    assert job["spec"]["podTemplate"]["metadata"]["labels"] == {"team": "a"}
    assert ckpt["status"]["jobName"] == "owned-checkpoint"

    snap = await h.kube.get(POD_SNAPSHOT, ckpt["status"]["podSnapshotName"], h.namespace)
    assert [(r["kind"], r["uid"], r["controller"]) for r in snap["metadata"]["ownerReferences"]] == [
        ("DynamoCheckpoint", uid, True)
    ]
    content = await h.kube.get(POD_SNAPSHOT_CONTENT, snap["status"]["boundSnapshotContentName"])
    artifact, compat = content["status"]["artifact"], content["status"]["compatibility"]
    assert ckpt["status"]["location"] == artifact["location"]
    assert ckpt["status"]["artifactDigest"] == artifact["digest"]
    assert ckpt["status"]["sourcePod"] == content["spec"]["source"]["podRef"]["name"]
    assert ckpt["status"]["storageType"] == "pvc"
    assert ckpt["status"]["createdAt"]
    # The template asks no GPU: a count of 0 asks nothing of a restore's node.
    assert compat["gpuCount"] == 0
    assert compat["gpuProduct"]
    want = {k: compat[k] for k in ("gpuProduct", "cudaDriverMajor") if compat.get(k)}
    assert ckpt["status"]["compatibility"] == want
    ready = next(c for c in ckpt["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"

    async def job_completed() -> bool:
        done = await h.kube.get(SNAPSHOT_JOB, "owned-checkpoint", h.namespace)
        return cond.is_true(done, "Completed") and await _get(h, JOB, "owned-checkpoint") is None

    await eventually(job_completed, within=30)  # the worker's pod is gone, its snapshot stays

    await h.kube.delete(CHECKPOINT, "owned", h.namespace)

    async def all_gone() -> bool:
        left = [
            await _get(h, CHECKPOINT, "owned"),
            await _get(h, SNAPSHOT_JOB, "owned-checkpoint"),
            await _get(h, POD_SNAPSHOT, snap["metadata"]["name"]),
        ]
        try:
            await h.kube.get(POD_SNAPSHOT_CONTENT, content["metadata"]["name"])
        except ApiError as e:
            if is_not_found(e):
                return left == [None, None, None]
            raise
        return False

    await eventually(all_gone, within=45)


async def test_a_failed_snapshot_job_fails_the_checkpoint_with_its_reason(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    gpu_node(gpus=8)
    h.agent.checkpoint_outcome = "failed"
    await h.kube.create(CHECKPOINT, _checkpoint("broken"), h.namespace)
    ckpt = await _phase(h, "broken", "Failed")
    job = await h.kube.get(SNAPSHOT_JOB, "broken-checkpoint", h.namespace)
    failed = cond.find_condition(job, cond.FAILED) or {}
    assert failed.get("reason") == SnapshotJobReason.POD_SNAPSHOT_FAILED
    message = ckpt["status"]["message"]
    assert message == f"SnapshotJob broken-checkpoint failed: PodSnapshotFailed: {failed['message']}"
    assert "CheckpointFailed: criu dump: test failure" in message
    await h.event("CheckpointFailed", "criu dump: test failure")
    ready = next(c for c in ckpt["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Failed")


async def test_a_pod_template_without_a_main_container_fails_the_checkpoint_and_says_why(
    harness: Harness,
) -> None:
    h = harness
    body = _checkpoint("nomain")
    body["spec"]["job"]["podTemplateSpec"]["spec"]["containers"][0]["name"] = "worker"
    await h.kube.create(CHECKPOINT, body, h.namespace)
    ckpt = await _phase(h, "nomain", "Failed")
    message = ckpt["status"]["message"]
    assert message.startswith("spec.job.podTemplateSpec: the SnapshotJob nomain-checkpoint was refused: ")
    assert "targetContainers must name containers present in podTemplate" in message
    assert await _get(h, SNAPSHOT_JOB, "nomain-checkpoint") is None
    await h.event("CheckpointFailed", "targetContainers")


async def test_a_ready_checkpoint_without_a_podsnapshot_is_outdated_and_says_so(harness: Harness) -> None:
    """A checkpoint left Ready by an earlier version (no status.podSnapshotName) is restored by no agent any
    more: it is marked Failed with what to do, so Auto mode and checkpointRef users stop waiting on it."""
    h = harness
    h.agent.checkpoint_outcome = None  # its SnapshotJob never finishes: only the status written here counts
    await h.kube.create(CHECKPOINT, _checkpoint("legacy"), h.namespace)
    await _phase(h, "legacy", "Creating")
    await h.kube.patch_status(
        CHECKPOINT,
        "legacy",
        {
            "phase": "Ready",
            "artifactDigest": DIGEST,
            "location": "/artifacts/team/old",
            "podSnapshotName": None,
        },
        h.namespace,
    )
    ckpt = await _phase(h, "legacy", "Failed")
    assert ckpt["status"]["message"] == LEGACY_CHECKPOINT_MESSAGE
    await h.event("CheckpointOutdated", "taken by an earlier dynamo-snapshot")


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
