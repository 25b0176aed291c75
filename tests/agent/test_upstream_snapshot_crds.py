"""The node agent beside NVIDIA's snapshot operator: the PodSnapshot and PodSnapshotContent CRDs are
upstream's (tests/helpers/upstream_snapshot_crds.py), whose structural schema prunes every status field
but the conditions, and a stand-in for that operator binds PodSnapshots and mirrors the content's outcome
(§2-§3 of upstream's API). The agent captures and restores for real, as in test_snapshot_capture.py: kwok
nodes, workers launched by the agent, CRIU, the artifact store on disk.

The apiserver drops status.artifact and status.compatibility on their contents; the agent keeps those
facts in annotations of the cluster-scoped content, which the restore reads. A tenant's pod naming another
namespace's PodSnapshot, a PodSnapshot bound to another namespace's content, or one bound to nothing
captured, is refused with the reason on the pod, whatever the tenant writes on namespaced objects."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.agent.snapshot_capture import CAPTURED_MESSAGE
from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.podsnapshot import content_artifact, content_compatibility, content_name
from dynamo_snapshot.artifact import ArtifactStore, artifact_key
from dynamo_snapshot.kube import POD, Kube, Obj
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.agent.test_agent import CONTENTS, _event, agents, pod  # noqa: F401  (agents: the fixture)
from tests.controller.conftest import eventually
from tests.helpers.upstream_snapshot_crds import upstream_snapshot_crds

pytestmark = [pytest.mark.cluster, pytest.mark.criu]


@pytest.fixture(scope="module")
def upstream_crds(cluster: LocalCluster, crds: list[str]) -> Iterator[None]:
    with upstream_snapshot_crds(cluster):
        yield


@pytest.fixture
def other_namespace(cluster: LocalCluster, namespace: str) -> Iterator[str]:
    name = f"{namespace[:50]}-b"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


class StandIn:
    """NVIDIA's snapshot operator, as far as the agent meets it: it binds a PodSnapshot to a content it
    makes (§3: named after the PodSnapshot's UID, labelled with the pod's node) and mirrors the content's
    Ready or Failed onto the PodSnapshot (§2)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    async def snapshot(self, ns: str, source: str, node: str, name: str | None = None) -> tuple[Obj, Obj]:
        """A PodSnapshot of pod ``source`` (the tenant's), bound to the content made for it."""
        src = await self.kube.get(POD, source, ns)
        snapshot = await self.kube.create(
            POD_SNAPSHOT,
            {
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "PodSnapshot",
                "metadata": {"name": name or f"{source}-snapshot"},
                "spec": {"source": {"podRef": {"name": source, "containers": ["main"]}}},
            },
            ns,
        )
        meta = snapshot["metadata"]
        bound = content_name(meta["uid"])
        CONTENTS.append(bound)
        content = await self.kube.create(
            POD_SNAPSHOT_CONTENT,
            {
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "PodSnapshotContent",
                "metadata": {"name": bound, "labels": {protocol.LABEL_SNAPSHOT_NODE: node}},
                "spec": {
                    "snapshotRef": {"namespace": ns, "name": meta["name"], "uid": meta["uid"]},
                    "source": {
                        "nodeName": node,
                        "podRef": {"name": source, "uid": src["metadata"]["uid"], "containers": ["main"]},
                    },
                },
            },
        )
        pending = cond.set_condition(
            [], cond.READY, False, "Pending", "Waiting for node agent to capture the checkpoint", None
        )
        status = {"boundSnapshotContentName": bound, "conditions": pending}
        await self.kube.patch_status(POD_SNAPSHOT, meta["name"], status, ns)
        return snapshot, content

    async def mirror_outcome(self, snapshot: Obj) -> Obj:
        """The content once it has an outcome, that outcome mirrored onto the PodSnapshot."""
        meta = snapshot["metadata"]

        async def outcome() -> Obj | None:
            content: Obj = await self.kube.get(POD_SNAPSHOT_CONTENT, content_name(meta["uid"]))
            done = cond.is_true(content, cond.READY) or cond.is_true(content, cond.FAILED)
            return content if done else None

        content: Obj = await eventually(outcome, within=90)
        ready = cond.find_condition(content, cond.READY) or {}
        conditions = cond.set_outcome(
            [], ready.get("status") == "True", ready["reason"], ready["message"], None
        )
        await self.kube.patch_status(
            POD_SNAPSHOT, meta["name"], {"conditions": conditions}, meta["namespace"]
        )
        return content


def _source(name: str, node: str) -> Obj:
    manifest = pod(name, node, {})
    # Not one of our controller's worker pods: nothing launches it until a capture asks for it.
    del manifest["metadata"]["labels"][protocol.LABEL_MANAGED_BY]
    return manifest


def _restore_pod(name: str, node: str, snapshot: str, container_map: str = "main=main") -> Obj:
    """A restore pod as upstream's contract shapes it (§7.3): restore-from and the container map, the
    snapshot-control emptyDir mounted at /snapshot-control with subPath the container's name, and
    SNAPSHOT_CONTROL_DIR; an inert entrypoint and the startup gate on restore-complete."""
    manifest = _source(name, node)
    manifest["metadata"]["annotations"] = {
        protocol.ANNOTATION_RESTORE_FROM: snapshot,
        protocol.ANNOTATION_RESTORE_CONTAINER_MAP: container_map,
    }
    manifest["spec"]["volumes"] = [{"name": protocol.CONTROL_VOLUME_NAME, "emptyDir": {}}]
    [main] = manifest["spec"]["containers"]
    main["command"] = ["/bin/sh", "-c", "exec sleep infinity"]
    main["env"].append({"name": protocol.ENV_CONTROL_DIR, "value": protocol.CONTROL_MOUNT_PATH})
    main["volumeMounts"] = [
        {"name": protocol.CONTROL_VOLUME_NAME, "mountPath": protocol.CONTROL_MOUNT_PATH, "subPath": "main"}
    ]
    main["startupProbe"] = {
        "exec": {"command": ["cat", f"{protocol.CONTROL_MOUNT_PATH}/{protocol.FILE_RESTORE_COMPLETE}"]},
        "timeoutSeconds": 1,
        "periodSeconds": 1,
        "failureThreshold": 1800,
        "successThreshold": 1,
    }
    return manifest


async def _restore_outcome(kube: Kube, ns: str, name: str) -> tuple[str, str, Obj]:
    """The pod's final restore status, its message and its nvidia.com/Restored condition."""
    status_key = protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
    message_key = protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")

    async def done() -> tuple[str, str, Obj] | None:
        obj = await kube.get(POD, name, ns)
        ann = obj["metadata"].get("annotations") or {}
        restored = next(
            (
                c
                for c in (obj.get("status") or {}).get("conditions") or []
                if c["type"] == protocol.POD_CONDITION_RESTORED
            ),
            None,
        )
        final = ann.get(status_key) in ("completed", "failed")
        if final and restored and restored["reason"] != protocol.RestoredReason.IN_PROGRESS:
            return ann[status_key], ann.get(message_key, ""), restored
        return None

    found: tuple[str, str, Obj] = await eventually(done, within=90)
    return found


async def _captured(kube: Kube, stand_in: StandIn, ns: str, node: str, source: str) -> tuple[Obj, Obj]:
    """A source pod of ``ns`` captured on ``node`` through the stand-in: its PodSnapshot and content."""
    await kube.create(POD, _source(source, node), ns)
    snapshot, _ = await stand_in.snapshot(ns, source, node)
    content = await stand_in.mirror_outcome(snapshot)
    ready = cond.find_condition(content, cond.READY) or {}
    assert (ready["status"], ready["reason"], ready["message"]) == ("True", "Captured", CAPTURED_MESSAGE)
    return snapshot, content


async def test_a_capture_under_upstream_crds_keeps_the_artifact_facts_and_a_restore_pod_is_restored(
    upstream_crds: None,
    api: Any,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    kube = Kube(api, field_manager="upstream-crds-test")
    node_a, node_b = gpu_node()["metadata"]["name"], gpu_node()["metadata"]["name"]
    await agents(node_a)
    await agents(node_b)
    snapshot, content = await _captured(kube, StandIn(kube), namespace, node_a, "worker-0")

    # Their schema has no room for our status fields: the apiserver dropped them.
    assert set(content["status"]) == {"conditions"}
    artifact = ArtifactStore(tmp_path / "artifacts").open(
        artifact_key(namespace, snapshot["metadata"]["uid"])
    )
    facts = content_artifact(content)
    assert facts is not None
    assert facts.to_dict() == {
        "location": str(artifact.path),
        "digest": artifact.manifest.digest,
        "sizeBytes": sum(f.size for f in artifact.manifest.files),
    }
    compatibility = content_compatibility(content)
    assert compatibility is not None
    assert compatibility.gpu_count == 0  # no GPU on this node

    await kube.create(POD, _restore_pod("restored", node_b, snapshot["metadata"]["name"]), namespace)
    state, message, restored = await _restore_outcome(kube, namespace, "restored")
    assert state == "completed", message
    assert f"restored from {snapshot['metadata']['name']}" in message
    assert (restored["status"], restored["reason"]) == ("True", protocol.RestoredReason.SUCCEEDED)


async def _forged_podsnapshot(kube: Kube, stand_in: StandIn, ns: str, node: str, facts: str) -> str:
    """A tenant's PodSnapshot the stand-in bound to a content that no agent captured (its node runs none),
    which the tenant marked Ready and annotated with another namespace's artifact facts; its name."""
    await kube.create(POD, _source("idle", node), ns)
    snapshot, _ = await stand_in.snapshot(ns, "idle", node, name="forged")
    name = snapshot["metadata"]["name"]
    captured = cond.set_outcome([], True, "Captured", CAPTURED_MESSAGE, None)
    await kube.patch_status(POD_SNAPSHOT, name, {"conditions": captured}, ns)
    forged = {"metadata": {"annotations": {protocol.ANNOTATION_CONTENT_ARTIFACT: facts}}}
    await kube.merge_patch(POD_SNAPSHOT, name, forged, ns)
    return name


async def test_tenants_are_refused_what_their_namespace_does_not_grant(
    upstream_crds: None,
    api: Any,
    namespace: str,
    other_namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Any,  # noqa: F811
) -> None:
    kube = Kube(api, field_manager="upstream-crds-test")
    stand_in = StandIn(kube)
    node_a, node_b, idle = (gpu_node()["metadata"]["name"] for _ in range(3))
    await agents(node_a)
    await agents(node_b)
    snapshot, content = await _captured(kube, stand_in, namespace, node_a, "worker-1")
    name, facts = (
        snapshot["metadata"]["name"],
        content["metadata"]["annotations"][protocol.ANNOTATION_CONTENT_ARTIFACT],
    )

    # Bound to the other namespace's content: a PodSnapshot status the tenant wrote itself.
    await kube.create(POD, _source("bystander", idle), other_namespace)
    stolen, _ = await stand_in.snapshot(other_namespace, "bystander", idle, name="stolen")
    captured = cond.set_outcome([], True, "Captured", CAPTURED_MESSAGE, None)
    status = {"boundSnapshotContentName": content["metadata"]["name"], "conditions": captured}
    await kube.patch_status(POD_SNAPSHOT, "stolen", status, other_namespace)
    forged = await _forged_podsnapshot(kube, stand_in, other_namespace, idle, facts)

    cases = {
        "cross-namespace": (name, f"nor a PodSnapshot named {name!r} exists in namespace {other_namespace}"),
        "other-content": ("stolen", "PodSnapshot 'stolen' has no content bound to it"),
        "forged-annotations": (forged, "the content of PodSnapshot 'forged' records no artifact digest"),
    }
    for pod_name, (source, _) in cases.items():
        manifest = _restore_pod(pod_name, node_b, source)
        manifest["metadata"]["annotations"][protocol.ANNOTATION_CONTENT_ARTIFACT] = facts
        await kube.create(POD, manifest, other_namespace)
    for pod_name, (_, why) in cases.items():
        state, message, restored = await _restore_outcome(kube, other_namespace, pod_name)
        assert (state, restored["status"], restored["reason"]) == ("failed", "False", "RestoreFailed")
        assert message.startswith("refused: "), (pod_name, message)
        assert why in message, (pod_name, message)
        assert restored["message"] == message
        assert (await _event(kube, other_namespace, "RestoreRefused", pod_name))["message"] == message
    assert stolen["metadata"]["uid"] != content["spec"]["snapshotRef"]["uid"]

    # The namespace's own restore pod, asking for a container it does not have.
    await kube.create(POD, _restore_pod("mapped", node_b, name, "main=engine-0"), namespace)
    state, message, _ = await _restore_outcome(kube, namespace, "mapped")
    assert state == "failed"
    assert "the pod has no container 'engine-0' to restore container 'main' into" in message
