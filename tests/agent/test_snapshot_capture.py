"""The node agent captures the PodSnapshotContents of its node, for real: a pod on a kwok node, the worker
launched by the agent, CRIU, the artifact store on disk. The content (made here as the controller makes it)
ends Ready with the artifact's location, digest and size; one whose PodSnapshot or pod does not grant it
ends Failed with the reason and nothing is stored; deleting the PodSnapshot removes its artifact. And the
whole way, with the controller binding the content: a PodSnapshot of a running pod ends Ready."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.agent.snapshot_capture import CAPTURED_MESSAGE, snapshot_identity_hash
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.artifact import ArtifactStore, artifact_key
from dynamo_snapshot.kube import POD, ApiError, Kube, Obj
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from tests.agent.test_agent import agents, pod  # noqa: F401  (agents: the fixture)
from tests.controller.conftest import Harness, eventually, harness  # noqa: F401  (harness: the fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.criu]


@pytest.fixture
async def contents(api: Any) -> AsyncIterator[Callable[..., Any]]:
    """Creates PodSnapshotContents (cluster-scoped) and deletes them at the end."""
    kube = Kube(api, field_manager="capture-test")
    made: list[str] = []

    async def create(snapshot: Obj, source: Obj, node: str, pod_uid: str | None = None) -> Obj:
        meta = snapshot["metadata"]
        name = content_name(meta["uid"])
        made.append(name)
        manifest = {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshotContent",
            "metadata": {"name": name, "labels": {protocol.LABEL_SNAPSHOT_NODE: node}},
            "spec": {
                "snapshotRef": {"namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]},
                "source": {
                    "nodeName": node,
                    "podRef": {
                        "name": source["metadata"]["name"],
                        "uid": pod_uid or source["metadata"]["uid"],
                        "containers": ["main"],
                    },
                },
            },
        }
        created: Obj = await kube.create(POD_SNAPSHOT_CONTENT, manifest)
        return created

    yield create
    for name in made:
        with contextlib.suppress(ApiError):
            await kube.delete(POD_SNAPSHOT_CONTENT, name)


async def _source_and_snapshot(
    kube: Kube, ns: str, node: str, name: str, env: dict[str, str] | None = None
) -> tuple[Obj, Obj]:
    manifest = pod(name, node, {})
    # Not one of the controller's worker pods: nothing launches it until a capture asks for it.
    del manifest["metadata"]["labels"][protocol.LABEL_MANAGED_BY]
    manifest["spec"]["containers"][0]["env"] += [{"name": k, "value": v} for k, v in (env or {}).items()]
    source = await kube.create(POD, manifest, ns)
    snapshot = await kube.create(
        POD_SNAPSHOT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {"name": f"{name}-snapshot"},
            "spec": {"source": {"podRef": {"name": name, "containers": ["main"]}}},
        },
        ns,
    )
    return source, snapshot


async def _ended(kube: Kube, name: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        content = await kube.get(POD_SNAPSHOT_CONTENT, name)
        status: dict[str, Any] = content.get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        if any(c["status"] == "True" for c in conds.values()):
            return {**status, "by_type": conds}
        return None

    found: dict[str, Any] = await eventually(check, within=90)
    return found


async def test_a_content_of_this_node_is_captured_and_its_artifact_goes_with_its_snapshot(
    api: Any,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
    contents: Any,
    tmp_path: Path,
) -> None:
    kube = Kube(api, field_manager="capture-test")
    node = gpu_node()["metadata"]["name"]
    await agents(node)
    source, snapshot = await _source_and_snapshot(kube, namespace, node, "worker-0")
    content = await contents(snapshot, source, node)

    status = await _ended(kube, content["metadata"]["name"])
    ready = status["by_type"]["Ready"]
    assert (ready["status"], ready["reason"], ready["message"]) == ("True", "Captured", CAPTURED_MESSAGE)
    assert status["by_type"]["Failed"]["status"] == "False"
    key = artifact_key(namespace, snapshot["metadata"]["uid"])
    artifact = ArtifactStore(tmp_path / "artifacts").open(key)
    assert status["artifact"] == {
        "location": str(artifact.path),
        "digest": artifact.manifest.digest,
        "sizeBytes": sum(f.size for f in artifact.manifest.files),
    }
    binding = artifact.manifest.binding
    assert binding is not None
    assert (binding.checkpoint_name, binding.source_pod_uid) == (
        "worker-0-snapshot",
        source["metadata"]["uid"],
    )
    assert artifact.manifest.identity_hash == snapshot_identity_hash(snapshot["metadata"]["uid"])

    # The artifact lives as long as its PodSnapshot.
    await kube.delete(POD_SNAPSHOT, "worker-0-snapshot", namespace)
    store = ArtifactStore(tmp_path / "artifacts")

    async def removed() -> bool:
        return not store.exists(key)

    await eventually(removed, within=30)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("replaced-pod", "StalePodReference"),
        ("no-snapshot", "SnapshotNotFound"),
        ("another-pod", "ContentConflict"),
    ],
)
async def test_a_content_nothing_grants_fails_with_its_reason_and_stores_nothing(
    api: Any,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
    contents: Any,
    tmp_path: Path,
    case: str,
    reason: str,
) -> None:
    kube = Kube(api, field_manager="capture-test")
    node = gpu_node()["metadata"]["name"]
    await agents(node)
    source, snapshot = await _source_and_snapshot(kube, namespace, node, "worker-1")
    if case == "no-snapshot":
        await kube.delete(POD_SNAPSHOT, snapshot["metadata"]["name"], namespace)
        content = await contents(snapshot, source, node)
    elif case == "another-pod":
        # A content someone else made, naming a pod of the namespace that the PodSnapshot does not ask for.
        manifest = pod("bystander", node, {})
        del manifest["metadata"]["labels"][protocol.LABEL_MANAGED_BY]
        bystander = await kube.create(POD, manifest, namespace)
        content = await contents(snapshot, bystander, node)
    else:
        content = await contents(snapshot, source, node, pod_uid="00000000-0000-4000-8000-000000000000")

    failed = (await _ended(kube, content["metadata"]["name"]))["by_type"]["Failed"]
    assert (failed["status"], failed["reason"]) == ("True", reason)
    assert not ArtifactStore(tmp_path / "artifacts").exists(
        artifact_key(namespace, snapshot["metadata"]["uid"])
    )


async def test_a_source_pod_deleted_mid_capture_fails_it_and_publishes_nothing(
    api: Any,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
    contents: Any,
    tmp_path: Path,
) -> None:
    kube = Kube(api, field_manager="capture-test")
    node = gpu_node()["metadata"]["name"]
    await agents(node)
    source, snapshot = await _source_and_snapshot(
        kube, namespace, node, "slow-worker", {"WORKER_READY_DELAY_S": "30"}
    )
    content = await contents(snapshot, source, node)
    name = content["metadata"]["name"]

    async def taken_up() -> dict[str, Any] | None:
        conds = {
            c["type"]: c
            for c in ((await kube.get(POD_SNAPSHOT_CONTENT, name)).get("status") or {}).get("conditions")
            or []
        }
        return conds.get("Ready") if conds.get("Ready", {}).get("reason") == "CaptureInProgress" else None

    ready = await eventually(taken_up, within=30)
    assert ready["status"] == "False"
    assert node in ready["message"]
    await kube.delete(POD, "slow-worker", namespace)

    failed = (await _ended(kube, name))["by_type"]["Failed"]
    assert (failed["status"], failed["reason"]) == ("True", "SourcePodGone")
    assert "nothing was published" in failed["message"]
    assert not ArtifactStore(tmp_path / "artifacts").exists(
        artifact_key(namespace, snapshot["metadata"]["uid"])
    )


async def test_a_podsnapshot_is_bound_captured_and_ready_with_the_controller(
    api: Any,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
    harness: Harness,  # noqa: F811
) -> None:
    kube = Kube(api, field_manager="capture-test")
    node = gpu_node()["metadata"]["name"]
    await agents(node)
    _, snapshot = await _source_and_snapshot(kube, namespace, node, "worker-2")

    async def ready() -> dict[str, Any] | None:
        obj = await kube.get(POD_SNAPSHOT, snapshot["metadata"]["name"], namespace)
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
        return conds["Ready"] if conds.get("Ready", {}).get("status") == "True" else None

    cond = await eventually(ready, within=90)
    assert (cond["reason"], cond["message"]) == ("Captured", CAPTURED_MESSAGE)
    # Deleted while the controller runs: its content goes first, then the artifact with the PodSnapshot.
    await kube.delete(POD_SNAPSHOT, snapshot["metadata"]["name"], namespace)

    async def content_gone() -> bool:
        try:
            await kube.get(POD_SNAPSHOT_CONTENT, content_name(snapshot["metadata"]["uid"]))
        except ApiError:
            return True
        return False

    await eventually(content_gone, within=30)


async def _restore_status(kube: Kube, namespace: str, name: str) -> tuple[str, str] | None:
    ann = (await kube.get(POD, name, namespace))["metadata"].get("annotations") or {}
    state = ann.get(protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main"))
    message = ann.get(protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main"), "")
    return (state, message) if state in ("completed", "failed") else None


async def test_any_pod_restores_from_a_podsnapshot_of_its_namespace(
    api: Any,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
    harness: Harness,  # noqa: F811
) -> None:
    """NVIDIA Snapshot's restore: a plain pod (no labels of ours) with nvidia.com/restore-from naming a Ready
    PodSnapshot of its namespace is restored by the agent of the node it lands on; one naming a PodSnapshot
    that is not Ready is refused, with the reason on the pod."""
    kube = Kube(api, field_manager="capture-test")
    node_a, node_b = gpu_node()["metadata"]["name"], gpu_node()["metadata"]["name"]
    await agents(node_a)
    await agents(node_b)
    _, snapshot = await _source_and_snapshot(kube, namespace, node_a, "worker-3")

    async def ready() -> bool:
        obj = await kube.get(POD_SNAPSHOT, snapshot["metadata"]["name"], namespace)
        return any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (obj.get("status") or {}).get("conditions") or []
        )

    await eventually(ready, within=90)
    pending = await kube.create(
        POD_SNAPSHOT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {"name": "never-captured"},
            "spec": {"source": {"podRef": {"name": "absent", "containers": ["main"]}}},
        },
        namespace,
    )
    for name, source in (("restored", snapshot), ("refused", pending)):
        manifest = pod(name, node_b, {})
        del manifest["metadata"]["labels"][protocol.LABEL_MANAGED_BY]
        manifest["metadata"]["annotations"] = {protocol.ANNOTATION_RESTORE_FROM: source["metadata"]["name"]}
        await kube.create(POD, manifest, namespace)

    state, message = await eventually(lambda: _restore_status(kube, namespace, "restored"), within=90)
    assert state == "completed", message
    assert f"restored from {snapshot['metadata']['name']}" in message
    state, message = await eventually(lambda: _restore_status(kube, namespace, "refused"), within=30)
    assert state == "failed"
    assert "PodSnapshot 'never-captured' is not Ready" in message
