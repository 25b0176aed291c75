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
from dynamo_snapshot.api.conditions import FAILED, READY
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.api.podsnapshot import PodSnapshotReason, content_artifact
from dynamo_snapshot.api.restore_request import name_problem, restore_destinations
from dynamo_snapshot.api.views import (
    CheckpointView,
    ObjectView,
    PodSnapshotContentView,
    PodSnapshotView,
    PodView,
)
from dynamo_snapshot.artifact import Binding, artifact_key
from dynamo_snapshot.kube import Obj

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
    "ready_artifact",
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
    # The pod's containers the artifact is restored into, each on its own (restore-container-map).
    destinations: tuple[str, ...] = (protocol.DEFAULT_TARGET_CONTAINER,)


def asks_to_be_restored(pod: Obj) -> bool:
    """A restore pod of ours is labelled; any other pod asks with nvidia.com/restore-from alone. Asking
    grants nothing: the object it names does (``restore_grant``)."""
    view = PodView(pod)
    return view.meta.labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE or bool(view.restore_from)


def name_to_restore(pod: Obj) -> str:
    """What a restore pod asks to be restored from: its ``nvidia.com/restore-from`` as written ("" when
    it has none); ``restore_grant`` refuses one that is no name of the pod's namespace."""
    return PodView(pod).restore_from or ""


def _same(a: str, b: str) -> bool:
    """Two UIDs name the same object: equal, and not both missing."""
    return bool(a) and a == b


def _controlled_by_checkpoint(obj: ObjectView) -> dict[str, str] | None:
    ref = obj.meta.controller
    if ref is None or ref.get("kind") != CHECKPOINT_KIND:
        return None
    if ref.get("apiVersion", "").split("/")[0] != protocol.API_GROUP:
        return None
    return ref


def capture_checkpoint_name(snapshot: Obj | None) -> str | None:
    """The DynamoCheckpoint (of the PodSnapshot's namespace) whose identity a capture of ``snapshot`` is
    sealed with: its controller, where that is a DynamoCheckpoint; else None."""
    ref = _controlled_by_checkpoint(PodSnapshotView(snapshot)) if snapshot is not None else None
    return ref.get("name") if ref is not None else None


def snapshot_to_restore(name: str, ckpt: Obj | None) -> str:
    """The PodSnapshot a restore from ``name`` reads: the one the DynamoCheckpoint of that name records
    (``status.podSnapshotName``, "" while it records none), else the PodSnapshot of that name."""
    return CheckpointView(ckpt).pod_snapshot_name if ckpt is not None else name


def _snapshot_grants_content(content: PodSnapshotContentView, snapshot: PodSnapshotView | None) -> None:
    """The PodSnapshot a content names exists, lives, has not failed, is bound to this content (or not yet
    to any) and asks for the pod and container the content names; ``ContentRefused`` otherwise."""
    ref = content.snapshot_ref
    namespace, name = str(ref.get("namespace") or ""), str(ref.get("name") or "")
    if snapshot is None or not _same(snapshot.meta.uid, str(ref.get("uid") or "")):
        raise ContentRefused(
            PodSnapshotReason.SNAPSHOT_NOT_FOUND,
            f"PodSnapshot {namespace}/{name} of this content does not exist",
        )
    if snapshot.meta.deleting:
        raise ContentRefused(
            PodSnapshotReason.SNAPSHOT_DELETED, f"PodSnapshot {namespace}/{name} is being deleted"
        )
    failed = snapshot.condition(FAILED)
    if failed.get("status") == "True":
        raise ContentRefused(
            PodSnapshotReason.SNAPSHOT_FAILED,
            f"PodSnapshot {namespace}/{name} failed already ({failed.get('reason')}): nothing to capture",
        )
    bound = snapshot.bound_content
    if bound and bound != content.meta.name:
        raise ContentRefused(
            PodSnapshotReason.CONTENT_CONFLICT, f"PodSnapshot {namespace}/{name} is bound to {bound}"
        )
    # Whoever made the content, the PodSnapshot says which pod and container it asks for.
    asked, named = snapshot.source, content.source
    if (
        asked.name != named.name
        or (asked.uid and asked.uid != named.uid)
        or asked.containers != named.containers
    ):
        raise ContentRefused(
            PodSnapshotReason.CONTENT_CONFLICT,
            f"PodSnapshot {namespace}/{name} asks for pod {asked.name!r} "
            f"{asked.containers}, not what this content names",
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
    view = PodSnapshotContentView(content)
    ref, pod_ref = view.snapshot_ref, view.source
    namespace, name = str(ref.get("namespace") or ""), str(ref.get("name") or "")
    snap = PodSnapshotView(snapshot) if snapshot is not None else None
    _snapshot_grants_content(view, snap)
    assert snap is not None  # _snapshot_grants_content refuses a missing PodSnapshot
    identity = _capture_identity(snap, CheckpointView(ckpt) if ckpt is not None else None)
    if view.source_node != node_name:
        raise ContentRefused(
            PodSnapshotReason.INVALID_DESTINATION, f"the content names node {view.source_node!r}"
        )
    pod_name = pod_ref.name
    if pod is None:
        raise ContentRefused(
            PodSnapshotReason.SOURCE_POD_NOT_FOUND, f"source pod {namespace}/{pod_name} does not exist"
        )
    source = PodView(pod)
    if not _same(source.meta.uid, pod_ref.uid):
        raise ContentRefused(
            PodSnapshotReason.STALE_POD_REFERENCE,
            f"source pod {namespace}/{pod_name} was replaced (its UID differs)",
        )
    if source.meta.deleting:
        raise ContentRefused(
            PodSnapshotReason.SOURCE_POD_GONE, f"source pod {namespace}/{pod_name} is being deleted"
        )
    if source.node_name != node_name:
        raise ContentRefused(
            PodSnapshotReason.INVALID_DESTINATION, f"source pod {namespace}/{pod_name} is not on this node"
        )
    containers = pod_ref.containers
    if len(containers) != 1 or containers[0] not in source.container_names:
        raise ContentRefused(
            PodSnapshotReason.INVALID_TARGET_CONTAINER,
            f"source pod {namespace}/{pod_name} has no container {containers!r}",
        )
    binding = Binding(
        namespace=namespace,
        checkpoint_name=name,
        checkpoint_uid=snap.meta.uid,
        source_pod=pod_name,
        source_pod_uid=source.meta.uid,
    )
    return CaptureGrant(binding, identity)


def _capture_identity(snapshot: PodSnapshotView, ckpt: CheckpointView | None) -> CheckpointIdentity | None:
    """The identity a capture of ``snapshot`` is sealed with: that of the DynamoCheckpoint controlling it
    (``ckpt``, read by name in its namespace; None: not there), which must be that very one (same UID),
    live and hold a valid identity; None for a PodSnapshot no DynamoCheckpoint controls."""
    ref = _controlled_by_checkpoint(snapshot)
    if ref is None:
        return None
    where = f"DynamoCheckpoint {snapshot.meta.namespace}/{ref.get('name')}"
    if ckpt is None:
        raise ContentRefused(
            PodSnapshotReason.CHECKPOINT_NOT_FOUND, f"{where}, which controls the PodSnapshot, does not exist"
        )
    if not _same(ckpt.meta.uid, ref.get("uid", "")):
        raise ContentRefused(
            PodSnapshotReason.CHECKPOINT_NOT_FOUND,
            f"{where} is not the one that controls the PodSnapshot (its UID differs)",
        )
    if ckpt.meta.deleting:
        raise ContentRefused(PodSnapshotReason.CHECKPOINT_DELETED, f"{where} is being deleted")
    try:
        return CheckpointIdentity.model_validate(ckpt.identity)
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
    target = PodView(pod)
    name = target.restore_from or ""
    if not name:
        raise Refused(
            f"the pod names nothing to restore from (annotation {protocol.ANNOTATION_RESTORE_FROM})"
        )
    problem = name_problem(name, target.meta.namespace)
    if problem:
        raise Refused(problem)
    snap = PodSnapshotView(snapshot) if snapshot is not None else None
    found = PodSnapshotContentView(content) if content is not None else None
    if ckpt is None:
        if snap is None:
            raise Refused(
                f"neither a DynamoCheckpoint nor a PodSnapshot named {name!r} exists in namespace "
                f"{target.meta.namespace}: a pod is restored only from one of its own namespace"
            )
        controller = _controlled_by_checkpoint(snap)
        if controller is None:
            key, digest, destinations = _snapshot_grant(target, snap, found)
            return RestoreGrant(name, key, digest, destinations)
        if owner is None or not _same(CheckpointView(owner).meta.uid, controller.get("uid", "")):
            raise Refused(
                f"PodSnapshot {name!r} belongs to DynamoCheckpoint {controller.get('name')!r}, "
                "which no longer exists"
            )
        ckpt = owner  # its rules (Ready, a graph's checkpoint only into that graph's pods) hold here too
    checkpoint = CheckpointView(ckpt)
    ckpt_name = checkpoint.meta.name
    recorded = _checkpoint_grant(target, checkpoint)
    snapshot_name = checkpoint.pod_snapshot_name
    if not snapshot_name:
        raise Refused(f"DynamoCheckpoint {ckpt_name!r} records no PodSnapshot (status.podSnapshotName)")
    if snap is None or snap.meta.name != snapshot_name:
        raise Refused(f"PodSnapshot {snapshot_name!r} of DynamoCheckpoint {ckpt_name!r} does not exist")
    controller = _controlled_by_checkpoint(snap)
    if controller is None or not _same(controller.get("uid", ""), checkpoint.meta.uid):
        raise Refused(f"PodSnapshot {snapshot_name!r} is not controlled by DynamoCheckpoint {ckpt_name!r}")
    key, digest, destinations = _snapshot_grant(target, snap, found)
    if digest != recorded:
        raise Refused(
            f"artifact digest mismatch: the content of PodSnapshot {snapshot_name!r} records {digest}, "
            f"DynamoCheckpoint {ckpt_name!r} records {recorded} (status.artifactDigest)"
        )
    return RestoreGrant(name, key, digest, destinations)


def _checkpoint_grant(pod: PodView, ckpt: CheckpointView) -> str:
    """The DynamoCheckpoint part of a restore: it lives, is Ready, records the digest of its artifact
    (returned), and a DGD's own checkpoint goes only into that DGD's pods."""
    name = ckpt.meta.name
    if ckpt.meta.deleting:
        raise Refused(f"DynamoCheckpoint {name!r} is being deleted")
    if ckpt.phase != CheckpointPhase.READY.value:
        raise Refused(f"DynamoCheckpoint {name!r} is not Ready (phase {ckpt.phase or 'Pending'})")
    digest = ckpt.artifact_digest
    if not _SHA256.fullmatch(digest):
        raise Refused(
            f"DynamoCheckpoint {name!r} records no artifact digest (status.artifactDigest): "
            "take the checkpoint again"
        )
    dgd = ckpt.meta.controller
    if dgd is not None and dgd.get("kind") == DGD_KIND and dgd.get("uid") not in pod.meta.owner_uids:
        raise Refused(
            f"DynamoCheckpoint {name!r} belongs to DynamoGraphDeployment {dgd.get('name')!r}; "
            f"pod {pod.meta.name} is not one of its pods"
        )
    return digest


def _snapshot_grant(
    pod: PodView, snapshot: PodSnapshotView, content: PodSnapshotContentView | None
) -> tuple[str, str, tuple[str, ...]]:
    """The PodSnapshot part of a restore, whether the pod names it or a DynamoCheckpoint records it: it
    lives, is Ready, is bound to a content of the pod's namespace that records the artifact's digest, and
    the pod asks for no container map this agent cannot follow. The artifact's key and digest, and the
    containers it goes into."""
    key, digest = ready_artifact(snapshot, content, pod.meta.namespace)
    destinations = check_destinations(
        pod, (snapshot.source.containers or [protocol.DEFAULT_TARGET_CONTAINER])[0]
    )
    return key, digest, destinations


def ready_artifact(
    snapshot: PodSnapshotView, content: PodSnapshotContentView | None, namespace: str
) -> tuple[str, str]:
    """The key and digest of the artifact of a PodSnapshot of ``namespace`` that lives, is Ready and is
    bound to a content of that namespace recording the digest; ``Refused`` otherwise."""
    name = snapshot.meta.name
    if snapshot.meta.deleting:
        raise Refused(f"PodSnapshot {name!r} is being deleted")
    ready = snapshot.condition(READY)
    if ready.get("status") != "True":
        why = ready.get("message") or ready.get("reason") or "not captured yet"
        raise Refused(f"PodSnapshot {name!r} is not Ready ({why})")
    ref = content.snapshot_ref if content is not None else {}
    if (
        content is None
        or not _same(str(ref.get("uid") or ""), snapshot.meta.uid)
        or ref.get("namespace") != namespace
        or snapshot.meta.namespace != namespace
    ):
        raise Refused(f"PodSnapshot {name!r} has no content bound to it")
    try:
        facts = content_artifact(dict(content.raw))
    except ValueError as e:
        raise Refused(f"the content of PodSnapshot {name!r}: {e}") from None
    digest = str((facts.digest if facts else None) or "")
    if not _SHA256.fullmatch(digest):
        raise Refused(
            f"the content of PodSnapshot {name!r} records no artifact digest (status.artifact, "
            f"else annotation {protocol.ANNOTATION_CONTENT_ARTIFACT})"
        )
    return artifact_key(namespace, snapshot.meta.uid), digest


def check_destinations(pod: PodView, captured: str) -> tuple[str, ...]:
    """The containers a restore of container ``captured`` goes into; ``Refused`` where the pod does not
    name them rightly: they are restore-container-map's destinations (whose source must be ``captured``),
    else the container of the captured name; the pod must have each, and the first must be the container
    the pod names as its target (the webhook lists them all in snapshot-target-containers)."""
    try:
        destinations = restore_destinations(pod.container_map, captured)
    except ValueError as e:
        raise Refused(str(e)) from None
    missing = [dest for dest in destinations if dest not in pod.container_names]
    if missing:
        raise Refused(
            f"the pod has no container {missing[0]!r} to restore container {captured!r} into (it has "
            f"{', '.join(pod.container_names) or 'none'}): name one with "
            f"{protocol.ANNOTATION_RESTORE_CONTAINER_MAP}: {captured}=<container>"
        )
    if pod.main_name != destinations[0]:
        raise Refused(
            f"the restore goes into container {destinations[0]!r}, but the pod names {pod.main_name!r} as "
            f"its target: set {protocol.ANNOTATION_TARGET_CONTAINERS}: {','.join(destinations)}, or map it "
            f"with {protocol.ANNOTATION_RESTORE_CONTAINER_MAP}: {captured}={pod.main_name}"
        )
    return destinations
