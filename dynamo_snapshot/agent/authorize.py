"""What the node agent may do to a pod, decided from objects in that pod's own namespace.

The agent is privileged on every GPU node, and anyone who can create a pod can put any label or
annotation on it. So labels and annotations only say what a pod *asks* for; the grant comes from the
objects it names, read from the apiserver in the pod's namespace:

- a capture is made only of a PodSnapshotContent of this node whose PodSnapshot (same UID, bound to it)
  asks for that very pod (``content_grant``); the artifact is bound to the PodSnapshot's UID and the pod
  (``Binding``) and stored under ``<namespace>/<PodSnapshot uid>``, so no other namespace or PodSnapshot can
  publish in its place. A PodSnapshot controlled by a DynamoCheckpoint of its namespace is sealed with that
  checkpoint's identity, which must be valid;
- a restore is made only into a pod whose ``nvidia.com/restore-from`` names a Ready PodSnapshot of its
  namespace with a bound content that records the artifact's digest (its status, else its annotation,
  which only the cluster-scoped content can carry: what a pod or PodSnapshot says of an artifact is never
  read), or a DynamoCheckpoint of its namespace that is Ready, records that digest and controls that
  PodSnapshot (a DGD's own checkpoint only into that DGD's pods); the agent then restores exactly the
  artifact with that digest (``restore_grant``).

Pure functions over plain dicts: the watcher and the capture fetch the objects, this module decides.
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
from dynamo_snapshot.api.podsnapshot import PodSnapshotReason, content_artifact
from dynamo_snapshot.api.restore_request import container_map, name_problem, restore_from
from dynamo_snapshot.artifact import Binding, artifact_key
from dynamo_snapshot.kube import Obj, controller_ref

__all__ = [
    "CHECKPOINT_KIND",
    "CaptureGrant",
    "ContentRefused",
    "Refused",
    "RestoreGrant",
    "asks_to_be_restored",
    "capture_checkpoint_name",
    "content_grant",
    "name_to_restore",
    "restore_grant",
    "snapshot_to_restore",
]

CHECKPOINT_KIND = "DynamoCheckpoint"
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
class CaptureGrant:
    """What a capture is bound to, and the DynamoCheckpoint identity it is sealed with (None: the
    PodSnapshot is no DynamoCheckpoint's)."""

    binding: Binding
    identity: CheckpointIdentity | None


@dataclass(frozen=True)
class RestoreGrant:
    checkpoint_name: str
    artifact_key: str
    manifest_digest: str


def asks_to_be_restored(pod: Obj) -> bool:
    """A restore pod of ours is labelled; any other pod asks with nvidia.com/restore-from alone. Asking
    grants nothing: the object it names does (``restore_grant``)."""
    meta = pod["metadata"]
    return (meta.get("labels") or {}).get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE or bool(
        (meta.get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_FROM)
    )


def name_to_restore(pod: Obj) -> str:
    """What a restore pod asks to be restored from: its ``nvidia.com/restore-from`` as written ("" when
    it has none); ``restore_grant`` refuses one that is no name of the pod's namespace."""
    return restore_from(pod["metadata"].get("annotations")) or ""


def _controlled_by_checkpoint(obj: Obj) -> dict[str, str] | None:
    ref = controller_ref(obj)
    if ref is None or ref.get("kind") != CHECKPOINT_KIND:
        return None
    if ref.get("apiVersion", "").split("/")[0] != protocol.API_GROUP:
        return None
    return ref


def capture_checkpoint_name(snapshot: Obj | None) -> str | None:
    """The DynamoCheckpoint (of the PodSnapshot's namespace) whose identity a capture of ``snapshot`` is
    sealed with: its controller, where that is a DynamoCheckpoint; else None."""
    ref = _controlled_by_checkpoint(snapshot) if snapshot is not None else None
    return ref.get("name") if ref is not None else None


def snapshot_to_restore(name: str, ckpt: Obj | None) -> str:
    """The PodSnapshot a restore from ``name`` reads: the one the DynamoCheckpoint of that name records
    (``status.podSnapshotName``, "" while it records none), else the PodSnapshot of that name."""
    if ckpt is not None:
        return str((ckpt.get("status") or {}).get("podSnapshotName") or "")
    return name


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


def content_grant(
    content: Obj, snapshot: Obj | None, pod: Obj | None, node_name: str, ckpt: Obj | None = None
) -> CaptureGrant:
    """What the agent may capture for a PodSnapshotContent of its node; ``ContentRefused`` otherwise.

    The content is cluster-scoped and made by the controller, but the grant still comes from the
    namespace: ``snapshot`` is the PodSnapshot it names, read in that namespace (None: not there), which
    must be the one it was bound to (same UID) and bind it; ``pod`` is the pod of that namespace the
    content names (None: not there), which must be that very pod (same UID), on this node, with the
    container; ``ckpt`` is the DynamoCheckpoint ``capture_checkpoint_name`` names, read in that namespace
    (None: not there or none named), whose identity the artifact is sealed with.
    """
    spec = content.get("spec") or {}
    ref = spec.get("snapshotRef") or {}
    source = spec.get("source") or {}
    pod_ref = source.get("podRef") or {}
    namespace, name = str(ref.get("namespace") or ""), str(ref.get("name") or "")
    _snapshot_grants_content(content, snapshot)
    assert snapshot is not None  # _snapshot_grants_content refuses a missing PodSnapshot
    identity = _capture_identity(snapshot, ckpt)
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
    binding = Binding(
        namespace=namespace,
        checkpoint_name=name,
        checkpoint_uid=ref["uid"],
        source_pod=pod_name,
        source_pod_uid=pod["metadata"]["uid"],
    )
    return CaptureGrant(binding, identity)


def _capture_identity(snapshot: Obj, ckpt: Obj | None) -> CheckpointIdentity | None:
    """The identity a capture of ``snapshot`` is sealed with: that of the DynamoCheckpoint controlling it
    (``ckpt``, read by name in its namespace; None: not there), which must be that very one (same UID),
    live and hold a valid identity; None for a PodSnapshot no DynamoCheckpoint controls."""
    ref = _controlled_by_checkpoint(snapshot)
    if ref is None:
        return None
    where = f"DynamoCheckpoint {snapshot['metadata'].get('namespace')}/{ref.get('name')}"
    if ckpt is None:
        raise ContentRefused(
            PodSnapshotReason.CHECKPOINT_NOT_FOUND, f"{where}, which controls the PodSnapshot, does not exist"
        )
    if ckpt["metadata"].get("uid") != ref.get("uid"):
        raise ContentRefused(
            PodSnapshotReason.CHECKPOINT_NOT_FOUND,
            f"{where} is not the one that controls the PodSnapshot (its UID differs)",
        )
    if ckpt["metadata"].get("deletionTimestamp"):
        raise ContentRefused(PodSnapshotReason.CHECKPOINT_DELETED, f"{where} is being deleted")
    try:
        return CheckpointIdentity.model_validate((ckpt.get("spec") or {}).get("identity"))
    except ValidationError as e:
        raise ContentRefused(
            PodSnapshotReason.INVALID_IDENTITY, f"{where} has an invalid identity: {e.errors()[0]['msg']}"
        ) from None


def restore_grant(
    pod: Obj, ckpt: Obj | None, snapshot: Obj | None, content: Obj | None, owner: Obj | None = None
) -> RestoreGrant:
    """What the agent may restore into this pod; ``Refused`` when nothing grants it.

    The pod's ``nvidia.com/restore-from`` names a DynamoCheckpoint or a PodSnapshot of its own namespace:
    ``ckpt`` is the DynamoCheckpoint of that name read there (None: none), ``snapshot`` the PodSnapshot
    ``snapshot_to_restore`` names, read there (None: none), ``content`` the PodSnapshotContent that
    PodSnapshot is bound to (None: none), whose status records the artifact's digest. A PodSnapshot that a
    DynamoCheckpoint controls is restored under that checkpoint's rules even when the pod names the
    PodSnapshot itself: ``owner`` is that DynamoCheckpoint, read in the namespace (None: none).
    """
    meta = pod["metadata"]
    name = name_to_restore(pod)
    if not name:
        raise Refused(
            f"the pod names nothing to restore from (annotation {protocol.ANNOTATION_RESTORE_FROM})"
        )
    problem = name_problem(name, meta["namespace"])
    if problem:
        raise Refused(problem)
    if ckpt is None:
        if snapshot is None:
            raise Refused(
                f"neither a DynamoCheckpoint nor a PodSnapshot named {name!r} exists in namespace "
                f"{meta['namespace']}: a pod is restored only from one of its own namespace"
            )
        controller = _controlled_by_checkpoint(snapshot)
        if controller is None:
            key, digest = _snapshot_grant(pod, snapshot, content)
            return RestoreGrant(name, key, digest)
        if owner is None or owner["metadata"].get("uid") != controller.get("uid"):
            raise Refused(
                f"PodSnapshot {name!r} belongs to DynamoCheckpoint {controller.get('name')!r}, "
                "which no longer exists"
            )
        ckpt = owner  # its rules (Ready, a graph's checkpoint only into that graph's pods) hold here too
    ckpt_name = ckpt["metadata"]["name"]
    recorded = _checkpoint_grant(pod, ckpt)
    snapshot_name = snapshot_to_restore(ckpt_name, ckpt)
    if not snapshot_name:
        raise Refused(f"DynamoCheckpoint {ckpt_name!r} records no PodSnapshot (status.podSnapshotName)")
    if snapshot is None or snapshot["metadata"]["name"] != snapshot_name:
        raise Refused(f"PodSnapshot {snapshot_name!r} of DynamoCheckpoint {ckpt_name!r} does not exist")
    controller = _controlled_by_checkpoint(snapshot)
    if controller is None or controller.get("uid") != ckpt["metadata"].get("uid"):
        raise Refused(f"PodSnapshot {snapshot_name!r} is not controlled by DynamoCheckpoint {ckpt_name!r}")
    key, digest = _snapshot_grant(pod, snapshot, content)
    if digest != recorded:
        raise Refused(
            f"artifact digest mismatch: the content of PodSnapshot {snapshot_name!r} records {digest}, "
            f"DynamoCheckpoint {ckpt_name!r} records {recorded} (status.artifactDigest)"
        )
    return RestoreGrant(name, key, digest)


def _checkpoint_grant(pod: Obj, ckpt: Obj) -> str:
    """The DynamoCheckpoint part of a restore: it lives, is Ready, records the digest of its artifact
    (returned), and a DGD's own checkpoint goes only into that DGD's pods."""
    meta = pod["metadata"]
    name = ckpt["metadata"]["name"]
    if ckpt["metadata"].get("deletionTimestamp"):
        raise Refused(f"DynamoCheckpoint {name!r} is being deleted")
    status = ckpt.get("status") or {}
    if status.get("phase") != CheckpointPhase.READY.value:
        raise Refused(f"DynamoCheckpoint {name!r} is not Ready (phase {status.get('phase') or 'Pending'})")
    digest = str(status.get("artifactDigest") or "")
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
    return digest


def _snapshot_grant(pod: Obj, snapshot: Obj, content: Obj | None) -> tuple[str, str]:
    """The PodSnapshot part of a restore, whether the pod names it or a DynamoCheckpoint records it: it
    lives, is Ready, is bound to a content of the pod's namespace that records the artifact's digest, and
    the pod asks for no container map this agent cannot follow. The artifact's key and digest."""
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
    try:
        facts = content_artifact(content)
    except ValueError as e:
        raise Refused(f"the content of PodSnapshot {name!r}: {e}") from None
    digest = str((facts.digest if facts else None) or "")
    if not _SHA256.fullmatch(digest):
        raise Refused(
            f"the content of PodSnapshot {name!r} records no artifact digest (status.artifact, "
            f"else annotation {protocol.ANNOTATION_CONTENT_ARTIFACT})"
        )
    mapping = (meta.get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_CONTAINER_MAP)
    main = protocol.DEFAULT_TARGET_CONTAINER
    if mapping is not None:
        try:
            mapped = container_map(str(mapping))
        except ValueError as e:
            raise Refused(str(e)) from None
        containers = ((snapshot.get("spec") or {}).get("source") or {}).get("podRef", {}).get("containers")
        captured = str(containers[0]) if containers else main
        if mapped != (captured, main):
            raise Refused(
                f"{protocol.ANNOTATION_RESTORE_CONTAINER_MAP}={mapping!r}: this agent restores the captured "
                f"container ({captured!r}) into the container called {main!r} only: write {captured}={main}"
            )
    return artifact_key(meta["namespace"], snapshot["metadata"]["uid"]), digest
