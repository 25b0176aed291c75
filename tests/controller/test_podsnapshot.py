"""The PodSnapshot reconcile against the real control plane: a PodSnapshot of a running pod is bound to a
PodSnapshotContent for the pod's node, mirrors the content's outcome (which the node agent writes; here the
test writes it), fails with a clear reason for a pod that is missing, replaced or lacks the container, and
takes its content with it when deleted."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import now_rfc3339
from dynamo_snapshot.api.podsnapshot import PodSnapshotReason, content_name
from dynamo_snapshot.controller.snapshot.podsnapshot_reconciler import PENDING_MESSAGE, UNSCHEDULED_MESSAGE
from dynamo_snapshot.kube import POD, ApiError, Obj, is_not_found
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from tests.controller.conftest import Harness, eventually

pytestmark = pytest.mark.cluster


def _pod(name: str, node: str | None, containers: tuple[str, ...] = ("main",)) -> Obj:
    spec: dict[str, Any] = {"containers": [{"name": c, "image": "worker:1"} for c in containers]}
    if node is not None:
        spec["nodeName"] = node
    else:
        spec["nodeSelector"] = {"dynamo-snapshot.test/nowhere": "true"}  # never scheduled
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _snapshot(name: str, pod: str, uid: str | None = None, container: str = "main") -> Obj:
    ref: dict[str, Any] = {"name": pod, "containers": [container]}
    if uid is not None:
        ref["uid"] = uid
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {"name": name},
        "spec": {"source": {"podRef": ref}},
    }


def _conditions(obj: Obj) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


@pytest.fixture
async def snapshots(harness: Harness) -> Any:
    """Creates PodSnapshots; whatever the test leaves is deleted while the controller still runs, so no
    content outlives it (contents are cluster-scoped)."""
    made: list[str] = []

    async def create(manifest: Obj) -> Obj:
        made.append(manifest["metadata"]["name"])
        created: Obj = await harness.kube.create(POD_SNAPSHOT, manifest, harness.namespace)
        return created

    yield create
    for name in made:
        with contextlib.suppress(ApiError):
            await harness.kube.delete(POD_SNAPSHOT, name, harness.namespace)

    async def all_gone() -> bool:
        for name in made:
            try:
                await harness.kube.get(POD_SNAPSHOT, name, harness.namespace)
            except ApiError as e:
                if is_not_found(e):
                    continue
                raise
            return False
        return True

    await eventually(all_gone, within=20)


async def _status(harness: Harness, name: str) -> Obj:
    obj: Obj = await harness.kube.get(POD_SNAPSHOT, name, harness.namespace)
    return obj


async def _agent_says(harness: Harness, content: str, type_: str, reason: str, message: str) -> None:
    """What the node agent writes on a content when its capture ends."""
    other = "Failed" if type_ == "Ready" else "Ready"
    now = now_rfc3339()
    status = {
        "conditions": [
            {
                "type": type_,
                "status": "True",
                "reason": reason,
                "message": message,
                "lastTransitionTime": now,
            },
            {
                "type": other,
                "status": "False",
                "reason": reason,
                "message": message,
                "lastTransitionTime": now,
            },
        ]
    }
    await harness.kube.patch_status(POD_SNAPSHOT_CONTENT, content, status)


async def test_a_snapshot_is_bound_to_a_content_for_its_pods_node_and_mirrors_it(
    harness: Harness, snapshots: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    pod = await harness.kube.create(POD, _pod("worker-0", node), harness.namespace)
    snap = await snapshots(_snapshot("snap-a", "worker-0"))
    name = content_name(snap["metadata"]["uid"])

    async def bound() -> Obj | None:
        obj = await _status(harness, "snap-a")
        return obj if (obj.get("status") or {}).get("boundSnapshotContentName") == name else None

    obj = await eventually(bound)
    ready = _conditions(obj)["Ready"]
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "Pending", PENDING_MESSAGE)
    assert protocol.FINALIZER_CONTENT_CLEANUP in obj["metadata"]["finalizers"]
    content = await harness.kube.get(POD_SNAPSHOT_CONTENT, name)
    assert content["metadata"]["labels"][protocol.LABEL_SNAPSHOT_NODE] == node
    assert content["spec"]["snapshotRef"] == {
        "namespace": harness.namespace,
        "name": "snap-a",
        "uid": snap["metadata"]["uid"],
    }
    assert content["spec"]["source"] == {
        "nodeName": node,
        "podRef": {"name": "worker-0", "uid": pod["metadata"]["uid"], "containers": ["main"]},
    }

    await _agent_says(harness, name, "Ready", "Captured", "Checkpoint captured and verified")

    async def ready_now() -> dict[str, dict[str, Any]] | None:
        conds = _conditions(await _status(harness, "snap-a"))
        return conds if conds.get("Ready", {}).get("status") == "True" else None

    conds = await eventually(ready_now)
    assert (conds["Ready"]["reason"], conds["Failed"]["status"]) == ("Captured", "False")
    await harness.event("SnapshotReady", "Checkpoint captured and verified")

    # Deleting the PodSnapshot deletes its content first.
    await harness.kube.delete(POD_SNAPSHOT, "snap-a", harness.namespace)

    async def content_gone() -> bool:
        try:
            await harness.kube.get(POD_SNAPSHOT_CONTENT, name)
        except ApiError as e:
            return is_not_found(e)
        return False

    await eventually(content_gone, within=20)


async def test_a_failed_capture_fails_the_snapshot_for_good(
    harness: Harness, snapshots: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    node = gpu_node()["metadata"]["name"]
    await harness.kube.create(POD, _pod("worker-1", node), harness.namespace)
    snap = await snapshots(_snapshot("snap-b", "worker-1"))
    name = content_name(snap["metadata"]["uid"])
    await eventually(lambda: harness.kube.get(POD_SNAPSHOT_CONTENT, name))
    await _agent_says(harness, name, "Failed", "CheckpointFailed", "criu dump: exit 1")

    async def failed() -> dict[str, dict[str, Any]] | None:
        conds = _conditions(await _status(harness, "snap-b"))
        return conds if conds.get("Failed", {}).get("status") == "True" else None

    conds = await eventually(failed)
    assert (conds["Failed"]["reason"], conds["Ready"]["status"]) == ("CheckpointFailed", "False")
    await harness.event("CheckpointFailed", "criu dump: exit 1")
    # Terminal: a later Ready on the content does not revive it.
    await _agent_says(harness, name, "Ready", "Captured", "late")
    await harness.kube.merge_patch(
        POD_SNAPSHOT, "snap-b", {"metadata": {"annotations": {"touch": uuid.uuid4().hex}}}, harness.namespace
    )
    # The touch and the content's change each wake a reconcile at once: watch long enough for both to have
    # run (the queue answers within a fraction of a second here), and more.
    for _ in range(15):
        conds = _conditions(await _status(harness, "snap-b"))
        assert (conds["Failed"]["status"], conds["Ready"]["status"]) == ("True", "False")
        await asyncio.sleep(0.2)


@pytest.mark.parametrize(
    ("pod_uid", "container", "reason", "words"),
    [
        (None, "main", PodSnapshotReason.SOURCE_POD_NOT_FOUND, "does not exist"),
        ("00000000-0000-4000-8000-000000000000", "main", PodSnapshotReason.STALE_POD_REFERENCE, "replaced"),
        (None, "engine", PodSnapshotReason.INVALID_TARGET_CONTAINER, "no container 'engine'"),
    ],
)
async def test_a_bad_source_fails_with_its_reason(
    harness: Harness,
    snapshots: Callable[..., Any],
    gpu_node: Callable[..., Obj],
    pod_uid: str | None,
    container: str,
    reason: str,
    words: str,
) -> None:
    node = gpu_node()["metadata"]["name"]
    pod_name = "absent" if reason == PodSnapshotReason.SOURCE_POD_NOT_FOUND else "worker-2"
    if pod_name != "absent":
        await harness.kube.create(POD, _pod(pod_name, node), harness.namespace)
    snap = await snapshots(_snapshot("snap-c", pod_name, uid=pod_uid, container=container))

    async def failed() -> dict[str, Any] | None:
        cond = _conditions(await _status(harness, "snap-c")).get("Failed")
        return cond if cond and cond["status"] == "True" else None

    cond = await eventually(failed)
    assert cond["reason"] == reason
    assert words in cond["message"]
    await harness.event(reason, words)
    with pytest.raises(ApiError) as missing:  # nothing to capture: no content was made
        await harness.kube.get(POD_SNAPSHOT_CONTENT, content_name(snap["metadata"]["uid"]))
    assert is_not_found(missing.value)


async def test_an_unscheduled_pod_is_waited_for(harness: Harness, snapshots: Callable[..., Any]) -> None:
    await harness.kube.create(POD, _pod("worker-3", None), harness.namespace)
    snap = await snapshots(_snapshot("snap-d", "worker-3"))

    async def waiting() -> dict[str, Any] | None:
        cond = _conditions(await _status(harness, "snap-d")).get("Ready")
        return cond if cond and cond["message"] == UNSCHEDULED_MESSAGE else None

    cond = await eventually(waiting)
    assert (cond["status"], cond["reason"]) == ("False", "Pending")
    assert "Failed" not in _conditions(await _status(harness, "snap-d"))
    with pytest.raises(ApiError):
        await harness.kube.get(POD_SNAPSHOT_CONTENT, content_name(snap["metadata"]["uid"]))


@pytest.mark.parametrize("harness", [{"snapshot_pickup_timeout_seconds": 3}], indirect=True)
async def test_a_content_no_node_agent_takes_up_fails_the_snapshot_but_one_taken_up_waits(
    harness: Harness, snapshots: Callable[..., Any], gpu_node: Callable[..., Obj]
) -> None:
    """A pod on a node where no agent runs: its content is never taken up, and the PodSnapshot says so
    instead of pending for ever. A content the agent took up (CaptureInProgress) waits past that time."""
    lonely, busy = gpu_node()["metadata"]["name"], gpu_node()["metadata"]["name"]
    await harness.kube.create(POD, _pod("on-lonely-node", lonely), harness.namespace)
    await harness.kube.create(POD, _pod("on-busy-node", busy), harness.namespace)
    await snapshots(_snapshot("snap-lonely", "on-lonely-node"))
    busy_snap = await snapshots(_snapshot("snap-busy", "on-busy-node"))
    busy_content = content_name(busy_snap["metadata"]["uid"])

    async def content_made() -> bool:
        return bool((await _status(harness, "snap-busy")).get("status", {}).get("boundSnapshotContentName"))

    await eventually(content_made)
    taking = "the node agent of busy captures container main of pod on-busy-node"
    # What the node agent writes when it takes a content up: Ready False, no Failed yet.
    await harness.kube.patch_status(
        POD_SNAPSHOT_CONTENT,
        busy_content,
        {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "CaptureInProgress",
                    "message": taking,
                    "lastTransitionTime": now_rfc3339(),
                }
            ]
        },
    )

    async def failed() -> dict[str, Any] | None:
        conds = _conditions(await _status(harness, "snap-lonely"))
        return conds["Failed"] if conds.get("Failed", {}).get("status") == "True" else None

    cond = await eventually(failed, within=20)
    assert cond["reason"] == "NoNodeAgent"
    assert lonely in cond["message"]
    await harness.event("NoNodeAgent", lonely)
    # Well past the pickup time, the content taken up still waits, saying who captures it.
    await asyncio.sleep(4)
    conds = _conditions(await _status(harness, "snap-busy"))
    assert conds.get("Failed", {}).get("status") != "True"
    assert (conds["Ready"]["status"], conds["Ready"]["reason"], conds["Ready"]["message"]) == (
        "False",
        "CaptureInProgress",
        taking,
    )
