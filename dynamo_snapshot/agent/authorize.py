"""What the node agent may do to a pod, decided from objects in that pod's own namespace.

The agent is privileged on every GPU node, and anyone who can create a pod can put any label or
annotation on it. So labels and annotations only say what a pod *asks* for; the grant comes from the
DynamoCheckpoint the pod names, read from the apiserver in the pod's namespace:

- a checkpoint is taken only of a pod that the checkpoint's own Job controls, while the checkpoint is
  still being taken; the artifact is bound to that checkpoint's UID and that pod (``Binding``) and stored
  under ``<namespace>/<checkpoint uid>``, so no other namespace or checkpoint can publish in its place;
- a restore is made only into a pod of the checkpoint's namespace, from a checkpoint that is Ready, not
  being deleted, and records the digest of the artifact it published (a DGD's own checkpoint only into
  that DGD's pods); the agent then restores exactly the artifact with that digest.

Pure functions over plain dicts: the watcher fetches the objects, this module decides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointPhase
from dynamo_snapshot.api.conditions import FAILED, READY, find_condition
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.api.podsnapshot import PodSnapshotReason
from dynamo_snapshot.artifact import Binding, artifact_key
from dynamo_snapshot.kube import Obj, controller_ref

__all__ = [
    "CheckpointGrant",
    "ContentRefused",
    "Refused",
    "RestoreGrant",
    "asks_to_be_restored",
    "checkpoint_grant",
    "checkpoint_name_to_restore",
    "content_grant",
    "restore_grant",
    "snapshot_restore_grant",
]

DGD_KIND = "DynamoGraphDeployment"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Refused(AgentError):
    """The pod asked for something no object in its namespace grants; the message says what is missing."""


class ContentRefused(Refused):
    """A PodSnapshotContent this agent must not capture; ``reason`` is its Failed condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CheckpointGrant:
    identity_hash: str
    identity: CheckpointIdentity
    binding: Binding


@dataclass(frozen=True)
class RestoreGrant:
    checkpoint_name: str
    artifact_key: str
    manifest_digest: str


def _where(pod: Obj) -> str:
    return f"namespace {pod['metadata']['namespace']}"


def asks_to_be_restored(pod: Obj) -> bool:
    """A restore pod of ours is labelled; any other pod asks with nvidia.com/restore-from alone. Asking
    grants nothing: the object it names does (``restore_grant``, ``snapshot_restore_grant``)."""
    meta = pod["metadata"]
    return (meta.get("labels") or {}).get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE or bool(
        (meta.get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_FROM)
    )


def checkpoint_name_to_restore(pod: Obj) -> str:
    """The checkpoint a restore pod asks for: `nvidia.com/restore-from`, else the checkpoint-id label."""
    meta = pod["metadata"]
    named = (meta.get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_FROM) or (
        meta.get("labels") or {}
    ).get(protocol.LABEL_CHECKPOINT_ID)
    return str(named or "")


def checkpoint_grant(pod: Obj, ckpt: Obj | None, job: Obj | None) -> CheckpointGrant:
    """What the agent may checkpoint this source pod as; `Refused` when nothing grants it.

    `ckpt` is the DynamoCheckpoint the pod's checkpoint-id label names (None: not found in the pod's
    namespace) and `job` the Job that controls the pod (None: none found).
    """
    meta = pod["metadata"]
    name = (meta.get("labels") or {}).get(protocol.LABEL_CHECKPOINT_ID, "")
    if not name:
        raise Refused(f"the pod names no DynamoCheckpoint (label {protocol.LABEL_CHECKPOINT_ID})")
    if ckpt is None:
        raise Refused(f"DynamoCheckpoint {name!r} not found in {_where(pod)}")
    if ckpt["metadata"].get("deletionTimestamp"):
        raise Refused(f"DynamoCheckpoint {name!r} is being deleted")
    phase = (ckpt.get("status") or {}).get("phase")
    if phase in (CheckpointPhase.READY.value, CheckpointPhase.FAILED.value):
        raise Refused(f"DynamoCheckpoint {name!r} is {phase} already: a checkpoint is taken once")
    owner = controller_ref(pod)
    if (
        job is None
        or owner is None
        or owner.get("kind") != "Job"
        or owner.get("uid") != job["metadata"].get("uid")
        or (controller_ref(job) or {}).get("uid") != ckpt["metadata"]["uid"]
    ):
        raise Refused(
            f"pod {meta['name']} is not run by the checkpoint Job of DynamoCheckpoint {name!r}: "
            "only that Job's pod is checkpointed"
        )
    try:
        identity = CheckpointIdentity.model_validate((ckpt.get("spec") or {}).get("identity"))
    except ValidationError as e:
        raise Refused(f"DynamoCheckpoint {name!r} has an invalid identity: {e.errors()[0]['msg']}") from None
    binding = Binding(
        namespace=meta["namespace"],
        checkpoint_name=name,
        checkpoint_uid=ckpt["metadata"]["uid"],
        source_pod=meta["name"],
        source_pod_uid=meta["uid"],
    )
    return CheckpointGrant(identity.compute_hash(), identity, binding)


def restore_grant(pod: Obj, ckpt: Obj | None) -> RestoreGrant:
    """What the agent may restore into this pod; `Refused` when nothing grants it.

    `ckpt` is the DynamoCheckpoint the pod names (`checkpoint_name_to_restore`), read in the pod's own
    namespace (None: not found there).
    """
    meta = pod["metadata"]
    name = checkpoint_name_to_restore(pod)
    if not name:
        raise Refused(f"the pod names no DynamoCheckpoint (annotation {protocol.ANNOTATION_RESTORE_FROM})")
    if ckpt is None:
        raise Refused(
            f"DynamoCheckpoint {name!r} not found in {_where(pod)}: a pod is restored only from a "
            "checkpoint in its own namespace"
        )
    if ckpt["metadata"].get("deletionTimestamp"):
        raise Refused(f"DynamoCheckpoint {name!r} is being deleted")
    status = ckpt.get("status") or {}
    if status.get("phase") != CheckpointPhase.READY.value:
        raise Refused(f"DynamoCheckpoint {name!r} is not Ready (phase {status.get('phase') or 'Pending'})")
    digest = status.get("artifactDigest") or ""
    if not _SHA256.fullmatch(digest):
        raise Refused(
            f"DynamoCheckpoint {name!r} records no artifact digest (status.artifactDigest): "
            "take the checkpoint again"
        )
    dgd = controller_ref(ckpt)
    if dgd is not None and dgd.get("kind") == DGD_KIND:
        pod_owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
        if dgd.get("uid") not in pod_owners:
            raise Refused(
                f"DynamoCheckpoint {name!r} belongs to DynamoGraphDeployment {dgd.get('name')!r}; "
                f"pod {meta['name']} is not one of its pods"
            )
    return RestoreGrant(name, artifact_key(meta["namespace"], ckpt["metadata"]["uid"]), digest)


def _snapshot_grants_content(content: Obj, snapshot: Obj | None) -> None:
    """The PodSnapshot a content names exists, lives, has not failed, is bound to this content (or not yet
    to any) and asks for the pod and container the content names; ``ContentRefused`` otherwise."""
    spec = content.get("spec") or {}
    ref = spec.get("snapshotRef") or {}
    pod_ref = (spec.get("source") or {}).get("podRef") or {}
    namespace, name = str(ref.get("namespace") or ""), str(ref.get("name") or "")
    if snapshot is None or snapshot["metadata"].get("uid") != ref.get("uid"):
        raise ContentRefused(
            PodSnapshotReason.SNAPSHOT_NOT_FOUND,
            f"PodSnapshot {namespace}/{name} of this content does not exist",
        )
    if snapshot["metadata"].get("deletionTimestamp"):
        raise ContentRefused(
            PodSnapshotReason.SNAPSHOT_DELETED, f"PodSnapshot {namespace}/{name} is being deleted"
        )
    failed = find_condition(snapshot, FAILED) or {}
    if failed.get("status") == "True":
        raise ContentRefused(
            PodSnapshotReason.SNAPSHOT_FAILED,
            f"PodSnapshot {namespace}/{name} failed already ({failed.get('reason')}): nothing to capture",
        )
    bound = (snapshot.get("status") or {}).get("boundSnapshotContentName")
    if bound and bound != content["metadata"]["name"]:
        raise ContentRefused(
            PodSnapshotReason.CONTENT_CONFLICT, f"PodSnapshot {namespace}/{name} is bound to {bound}"
        )
    # Whoever made the content, the PodSnapshot says which pod and container it asks for.
    asked = ((snapshot.get("spec") or {}).get("source") or {}).get("podRef") or {}
    if (
        asked.get("name") != pod_ref.get("name")
        or (asked.get("uid") and asked.get("uid") != pod_ref.get("uid"))
        or list(asked.get("containers") or []) != list(pod_ref.get("containers") or [])
    ):
        raise ContentRefused(
            PodSnapshotReason.CONTENT_CONFLICT,
            f"PodSnapshot {namespace}/{name} asks for pod {asked.get('name')!r} "
            f"{list(asked.get('containers') or [])}, not what this content names",
        )


def content_grant(content: Obj, snapshot: Obj | None, pod: Obj | None, node_name: str) -> Binding:
    """What the agent may capture for a PodSnapshotContent of its node; ``ContentRefused`` otherwise.

    The content is cluster-scoped and made by the controller, but the grant still comes from the
    namespace: ``snapshot`` is the PodSnapshot it names, read in that namespace (None: not there), which
    must be the one it was bound to (same UID) and bind it; ``pod`` is the pod of that namespace the
    content names (None: not there), which must be that very pod (same UID), on this node, with the
    container.
    """
    spec = content.get("spec") or {}
    ref = spec.get("snapshotRef") or {}
    source = spec.get("source") or {}
    pod_ref = source.get("podRef") or {}
    namespace, name = str(ref.get("namespace") or ""), str(ref.get("name") or "")
    _snapshot_grants_content(content, snapshot)
    if source.get("nodeName") != node_name:
        raise ContentRefused(
            PodSnapshotReason.INVALID_DESTINATION, f"the content names node {source.get('nodeName')!r}"
        )
    pod_name = str(pod_ref.get("name") or "")
    if pod is None:
        raise ContentRefused(
            PodSnapshotReason.SOURCE_POD_NOT_FOUND, f"source pod {namespace}/{pod_name} does not exist"
        )
    if pod["metadata"].get("uid") != pod_ref.get("uid"):
        raise ContentRefused(
            PodSnapshotReason.STALE_POD_REFERENCE,
            f"source pod {namespace}/{pod_name} was replaced (its UID differs)",
        )
    if pod["metadata"].get("deletionTimestamp"):
        raise ContentRefused(
            PodSnapshotReason.SOURCE_POD_GONE, f"source pod {namespace}/{pod_name} is being deleted"
        )
    if (pod.get("spec") or {}).get("nodeName") != node_name:
        raise ContentRefused(
            PodSnapshotReason.INVALID_DESTINATION, f"source pod {namespace}/{pod_name} is not on this node"
        )
    containers = [str(c) for c in pod_ref.get("containers") or []]
    names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
    if len(containers) != 1 or containers[0] not in names:
        raise ContentRefused(
            PodSnapshotReason.INVALID_TARGET_CONTAINER,
            f"source pod {namespace}/{pod_name} has no container {containers!r}",
        )
    if containers[0] != protocol.DEFAULT_TARGET_CONTAINER:
        # The agent captures and restores the container called main (what Dynamo's workers run in).
        raise ContentRefused(
            PodSnapshotReason.INVALID_TARGET_CONTAINER,
            f"container {containers[0]!r}: this agent captures only the container called "
            f"{protocol.DEFAULT_TARGET_CONTAINER!r}",
        )
    return Binding(
        namespace=namespace,
        checkpoint_name=name,
        checkpoint_uid=ref["uid"],
        source_pod=pod_name,
        source_pod_uid=pod["metadata"]["uid"],
    )


def snapshot_restore_grant(pod: Obj, snapshot: Obj, content: Obj | None) -> RestoreGrant:
    """What the agent may restore into a pod whose ``nvidia.com/restore-from`` names a PodSnapshot of its
    own namespace (``snapshot``, read there); ``Refused`` otherwise. ``content`` is the PodSnapshotContent
    the PodSnapshot is bound to (None: none), whose status records the artifact's digest."""
    meta = pod["metadata"]
    name = snapshot["metadata"]["name"]
    if snapshot["metadata"].get("deletionTimestamp"):
        raise Refused(f"PodSnapshot {name!r} is being deleted")
    ready = find_condition(snapshot, READY) or {}
    if ready.get("status") != "True":
        why = ready.get("message") or ready.get("reason") or "not captured yet"
        raise Refused(f"PodSnapshot {name!r} is not Ready ({why})")
    ref = (content or {}).get("spec", {}).get("snapshotRef") or {}
    if (
        content is None
        or ref.get("uid") != snapshot["metadata"]["uid"]
        or ref.get("namespace") != meta["namespace"]
    ):
        raise Refused(f"PodSnapshot {name!r} has no content bound to it")
    digest = ((content.get("status") or {}).get("artifact") or {}).get("digest") or ""
    if not _SHA256.fullmatch(digest):
        raise Refused(f"the content of PodSnapshot {name!r} records no artifact digest")
    mapping = (meta.get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_CONTAINER_MAP)
    main = protocol.DEFAULT_TARGET_CONTAINER
    if mapping and mapping.replace(" ", "") != f"{main}={main}":
        raise Refused(
            f"{protocol.ANNOTATION_RESTORE_CONTAINER_MAP}={mapping!r}: this agent restores the captured "
            f"container into the container called {main!r} only"
        )
    return RestoreGrant(name, artifact_key(meta["namespace"], snapshot["metadata"]["uid"]), digest)
