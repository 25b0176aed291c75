"""The SnapshotJob reconcile against the real control plane: its Job's pod (made Ready by kwok) is captured
into a PodSnapshot (the capture's outcome is written on the content here, as the node agent writes it),
then the Job and pod go and the SnapshotJob is Completed; a deadline, a pod deleted mid-capture or a name
taken by someone else fail it with the reason and publish nothing; a controller restart finds what it made."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import now_rfc3339
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.api.snapshotjob import SnapshotJobReason
from dynamo_snapshot.kube import POD, ApiError, Obj, is_not_found
from dynamo_snapshot.kube.kinds import JOB, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT, SNAPSHOT_JOB
from tests.controller.conftest import Harness, eventually

pytestmark = pytest.mark.cluster

PROBE = {"httpGet": {"path": "/health", "port": 8000}}


def _snapshot_job(name: str, node: str, deadline: int | None = None, **extra: Any) -> Obj:
    spec: dict[str, Any] = {
        "podSnapshotTemplate": {"targetContainers": ["main"]},
        "podTemplate": {
            "metadata": {"labels": {"app": name}},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [
                    {"name": "main", "image": "worker:1", "livenessProbe": PROBE, "startupProbe": PROBE},
                    *extra.get("containers", []),
                ],
            },
        },
    }
    if deadline is not None:
        spec["activeDeadlineSeconds"] = deadline
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "SnapshotJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def _conditions(obj: Obj) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


async def _get(harness: Harness, kind: Any, name: str) -> Obj | None:
    try:
        obj: Obj = await harness.kube.get(kind, name, harness.namespace)
    except ApiError as e:
        if is_not_found(e):
            return None
        raise
    return obj


@pytest.fixture
async def made(harness: Harness) -> AsyncIterator[Callable[..., Any]]:
    """Creates SnapshotJobs; at the end every PodSnapshot of the namespace is deleted while the controller
    still runs, so no content (cluster-scoped) outlives the test."""

    async def create(manifest: Obj) -> Obj:
        created: Obj = await harness.kube.create(SNAPSHOT_JOB, manifest, harness.namespace)
        return created

    yield create
    snapshots, _ = await harness.kube.list_all(POD_SNAPSHOT, harness.namespace)
    for snap in snapshots:
        with contextlib.suppress(ApiError):
            await harness.kube.delete(POD_SNAPSHOT, snap["metadata"]["name"], harness.namespace)

    async def all_gone() -> bool:
        return not (await harness.kube.list_all(POD_SNAPSHOT, harness.namespace))[0]

    await eventually(all_gone, within=20)


async def _until(harness: Harness, name: str, type_: str, status: str = "True") -> Obj:
    async def check() -> Obj | None:
        obj = await _get(harness, SNAPSHOT_JOB, name)
        return obj if obj and _conditions(obj).get(type_, {}).get("status") == status else None

    found: Obj = await eventually(check, within=45)
    return found


async def _capturing(harness: Harness, name: str) -> Obj:
    """The SnapshotJob once its PodSnapshot is made (Captured False, CaptureInProgress)."""

    async def check() -> Obj | None:
        obj = await _get(harness, SNAPSHOT_JOB, name)
        captured = _conditions(obj or {}).get("Captured", {})
        return obj if captured.get("reason") == SnapshotJobReason.CAPTURE_IN_PROGRESS else None

    found: Obj = await eventually(check, within=45)
    return found


async def _agent_captured(harness: Harness, snapshot_uid: str) -> None:
    """What the node agent writes on the content once the capture is verified."""
    name = content_name(snapshot_uid)
    await eventually(lambda: harness.kube.get(POD_SNAPSHOT_CONTENT, name))
    now = now_rfc3339()
    conds = [
        {"type": t, "status": s, "reason": "Captured", "message": "verified", "lastTransitionTime": now}
        for t, s in (("Ready", "True"), ("Failed", "False"))
    ]
    await harness.kube.patch_status(POD_SNAPSHOT_CONTENT, name, {"conditions": conds})


async def _gone(harness: Harness, kind: Any, name: str) -> None:
    async def check() -> bool:
        return await _get(harness, kind, name) is None

    await eventually(check, within=30)


async def _pods_of(harness: Harness, sj_uid: str) -> list[Obj]:
    selector = f"{protocol.LABEL_SNAPSHOT_JOB_UID}={sj_uid}"
    pods, _ = await harness.kube.list_all(POD, harness.namespace, label_selector=selector)
    return pods


async def test_a_ready_pod_is_captured_and_the_job_completes(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    sj = await made(_snapshot_job("warm", node))
    uid = sj["metadata"]["uid"]
    running = await _capturing(harness, "warm")

    job = await harness.kube.get(JOB, "warm", harness.namespace)
    assert running["status"]["sourceJobUid"] == job["metadata"]["uid"]
    assert job["metadata"]["ownerReferences"][0]["uid"] == uid
    assert job["metadata"]["labels"][protocol.LABEL_SNAPSHOT_JOB_UID] == uid
    assert (job["spec"]["backoffLimit"], job["spec"]["activeDeadlineSeconds"]) == (0, 3600)
    (pod,) = await _pods_of(harness, uid)
    main = pod["spec"]["containers"][0]
    assert main["readinessProbe"]["exec"]["command"] == ["cat", "/snapshot-control/ready-for-snapshot"]
    assert "livenessProbe" not in main
    assert "startupProbe" not in main

    conds = _conditions(running)
    assert (conds["Running"]["status"], conds["Running"]["reason"]) == ("True", "PodReady")
    assert running["status"]["startedAt"]
    assert "Failed" not in conds
    assert "Completed" not in conds
    snap = await harness.kube.get(POD_SNAPSHOT, "warm", harness.namespace)
    assert running["status"]["podSnapshotName"] == "warm"
    assert running["status"]["podSnapshotUid"] == snap["metadata"]["uid"]
    assert snap["spec"]["source"]["podRef"] == {
        "name": pod["metadata"]["name"],
        "uid": pod["metadata"]["uid"],
        "containers": ["main"],
    }
    assert "ownerReferences" not in snap["metadata"]  # the artifact outlives the job
    assert snap["metadata"]["labels"][protocol.LABEL_SNAPSHOT_JOB] == "warm"
    await harness.event("PodSnapshotCreated", pod["metadata"]["name"])

    await _agent_captured(harness, snap["metadata"]["uid"])
    done = await _until(harness, "warm", "Completed")
    conds = _conditions(done)
    assert (conds["Completed"]["reason"], conds["Captured"]["status"]) == ("JobCompleted", "True")
    assert conds["Captured"]["reason"] == "CaptureCompleted"
    assert "Failed" not in conds
    assert done["status"]["completedAt"]
    await _gone(harness, JOB, "warm")

    async def pods_gone() -> bool:
        return not await _pods_of(harness, uid)

    await eventually(pods_gone, within=30)
    ready = await harness.kube.get(POD_SNAPSHOT, "warm", harness.namespace)
    assert _conditions(ready)["Ready"]["status"] == "True"  # what the job published stays


async def test_a_deadline_fails_the_job_and_publishes_nothing(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    await made(_snapshot_job("slow", node, deadline=4))
    await _capturing(harness, "slow")  # ready and being captured, but no agent answers
    failed = await _until(harness, "slow", "Failed")
    conds = _conditions(failed)
    assert conds["Failed"]["reason"] == SnapshotJobReason.DEADLINE_EXCEEDED
    assert (conds["Completed"]["status"], conds["Completed"]["reason"]) == ("False", "DeadlineExceeded")
    assert conds["Captured"]["reason"] == "CaptureInProgress"  # set before: not back-filled over
    assert failed["status"]["completedAt"]
    await harness.event("DeadlineExceeded")
    await _gone(harness, JOB, "slow")
    await _gone(harness, POD_SNAPSHOT, "slow")  # the pending capture can no longer publish


async def test_a_pod_deleted_mid_capture_fails_the_job_and_publishes_nothing(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    sj = await made(_snapshot_job("lost", node))
    await _capturing(harness, "lost")
    (pod,) = await _pods_of(harness, sj["metadata"]["uid"])
    await harness.kube.delete(POD, pod["metadata"]["name"], harness.namespace, grace_period_seconds=0)

    failed = await _until(harness, "lost", "Failed")
    cond = _conditions(failed)["Failed"]
    assert cond["reason"] == SnapshotJobReason.JOB_FAILED, cond
    await harness.event("JobFailed")
    await _gone(harness, JOB, "lost")
    await _gone(harness, POD_SNAPSHOT, "lost")


async def test_a_job_of_its_name_made_by_someone_else_is_a_conflict_and_left_alone(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    foreign = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "taken"},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"dynamo-snapshot.test/nowhere": "true"},
                    "containers": [{"name": "main", "image": "other:1"}],
                }
            }
        },
    }
    theirs = await harness.kube.create(JOB, foreign, harness.namespace)
    await made(_snapshot_job("taken", node))
    cond = _conditions(await _until(harness, "taken", "Failed"))["Failed"]
    assert cond["reason"] == SnapshotJobReason.JOB_NAME_CONFLICT
    await harness.event("JobNameConflict", "not controlled by this SnapshotJob")
    job = await harness.kube.get(JOB, "taken", harness.namespace)
    assert job["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert not job["metadata"].get("deletionTimestamp")


async def test_a_podsnapshot_of_its_name_made_by_someone_else_is_a_conflict_and_left_alone(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    other_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "someone"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "w:1"}]},
    }
    await harness.kube.create(POD, other_pod, harness.namespace)
    theirs = await harness.kube.create(
        POD_SNAPSHOT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {"name": "dup"},
            "spec": {"source": {"podRef": {"name": "someone", "containers": ["main"]}}},
        },
        harness.namespace,
    )
    await made(_snapshot_job("dup", node))
    cond = _conditions(await _until(harness, "dup", "Failed"))["Failed"]
    assert cond["reason"] == SnapshotJobReason.POD_SNAPSHOT_NAME_CONFLICT
    await harness.event("PodSnapshotNameConflict", "was not made by this SnapshotJob")
    await _gone(harness, JOB, "dup")  # its own pod goes
    snap = await harness.kube.get(POD_SNAPSHOT, "dup", harness.namespace)
    assert snap["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert not snap["metadata"].get("deletionTimestamp")


async def test_a_template_the_apiserver_refuses_is_an_invalid_spec(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    # The CRD keeps a container as given; a pod refuses a name that is not a DNS label.
    await made(_snapshot_job("bad", node, containers=[{"name": "Not_A_Label", "image": "w:1"}]))
    cond = _conditions(await _until(harness, "bad", "Failed"))["Failed"]
    assert cond["reason"] == SnapshotJobReason.INVALID_SPEC
    assert "Not_A_Label" in cond["message"]
    assert await _get(harness, JOB, "bad") is None


async def test_a_restart_after_a_lost_status_write_finds_what_it_made(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    sj = await made(_snapshot_job("again", node))
    before = (await _capturing(harness, "again"))["status"]
    # A crash right after the creates, before the status recorded them: the status says nothing made.
    await harness.kill_controller()
    forgotten = {
        k: None for k in ("sourceJobUid", "podSnapshotName", "podSnapshotUid", "startedAt", "conditions")
    }
    await harness.kube.patch_status(SNAPSHOT_JOB, "again", forgotten, harness.namespace)
    await harness.start_controller()

    after = (await _capturing(harness, "again"))["status"]
    assert after["sourceJobUid"] == before["sourceJobUid"]
    assert after["podSnapshotUid"] == before["podSnapshotUid"]
    jobs, _ = await harness.kube.list_all(JOB, harness.namespace)
    snaps, _ = await harness.kube.list_all(POD_SNAPSHOT, harness.namespace)
    assert [j["metadata"]["uid"] for j in jobs] == [before["sourceJobUid"]]
    assert [s["metadata"]["uid"] for s in snaps] == [before["podSnapshotUid"]]
    assert len(await _pods_of(harness, sj["metadata"]["uid"])) == 1
    assert "Failed" not in _conditions(await harness.kube.get(SNAPSHOT_JOB, "again", harness.namespace))

    await _agent_captured(harness, before["podSnapshotUid"])
    await _until(harness, "again", "Completed")


async def test_a_failed_capture_fails_the_job_with_the_podsnapshots_reason(
    harness: Harness, made: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    await made(_snapshot_job("broken", node))
    status = (await _capturing(harness, "broken"))["status"]
    name = content_name(status["podSnapshotUid"])
    await eventually(lambda: harness.kube.get(POD_SNAPSHOT_CONTENT, name))
    now = now_rfc3339()
    conds = [
        {
            "type": t,
            "status": s,
            "reason": "CheckpointFailed",
            "message": "criu dump: exit 1",
            "lastTransitionTime": now,
        }
        for t, s in (("Failed", "True"), ("Ready", "False"))
    ]
    await harness.kube.patch_status(POD_SNAPSHOT_CONTENT, name, {"conditions": conds})

    cond = _conditions(await _until(harness, "broken", "Failed"))["Failed"]
    assert cond["reason"] == SnapshotJobReason.POD_SNAPSHOT_FAILED
    assert "CheckpointFailed: criu dump: exit 1" in cond["message"]
    await harness.event("PodSnapshotFailed", "criu dump: exit 1")
    await _gone(harness, JOB, "broken")
    # The failed PodSnapshot stays, saying why; it can never be restored from.
    snap = await harness.kube.get(POD_SNAPSHOT, "broken", harness.namespace)
    assert _conditions(snap)["Failed"]["status"] == "True"
