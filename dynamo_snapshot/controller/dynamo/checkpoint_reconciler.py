"""DynamoCheckpoint reconcile: take the checkpoint with a SnapshotJob, and keep `status` (phase, hash,
location, compatibility, conditions) true to what its PodSnapshot and that snapshot's content show.

Pending -> Creating (the SnapshotJob exists) -> Ready (its PodSnapshot is Ready: the artifact, its digest
and the GPU environment come from the bound PodSnapshotContent) | Failed (the SnapshotJob failed, with its
reason, or too many restores from the checkpoint failed). The SnapshotJob and the PodSnapshot it makes are
controlled by the checkpoint: deleting the checkpoint deletes both, once no restore reads it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from pydantic import ValidationError

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointCompatibility, CheckpointPhase, DynamoCheckpoint
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.api.podsnapshot import (
    PodSnapshotArtifact,
    PodSnapshotCompatibility,
    content_artifact,
    content_compatibility,
)
from dynamo_snapshot.api.views import (
    CheckpointView,
    Meta,
    PodSnapshotContentView,
    PodSnapshotView,
    SnapshotJobView,
)
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.podspec import (
    MAIN_CONTAINER,
    checkpoint_job_name,
    checkpoint_snapshot_job,
)
from dynamo_snapshot.kube import (
    NORMAL,
    WARNING,
    ApiError,
    Obj,
    Result,
    controller_ref,
    is_already_exists,
    object_key,
)
from dynamo_snapshot.kube.finalizers import remove_finalizer
from dynamo_snapshot.kube.kinds import CHECKPOINT, SNAPSHOT_JOB
from dynamo_snapshot.kube.pods import pod_active

log = logging.getLogger(__name__)
FINALIZE_RECHECK_S = 2.0
LEGACY_CHECKPOINT_MESSAGE = (
    "Ready without status.podSnapshotName: taken by an earlier dynamo-snapshot, whose artifact no node "
    "agent restores any more. Delete it to take a fresh one."
)
# How soon a wait on an object going away is looked at again (its deletion may send no event we watch).
RECHECK_S = 1.0
_SHA256 = re.compile(r"[0-9a-f]{64}")
WAITING_MESSAGE = "waiting for the worker to become ready and the node agent to checkpoint it"


def agent_verdict(pod: Obj, status_key: str, message_key: str) -> tuple[protocol.SnapshotStatus | None, str]:
    """The node agent's status for the pod's target containers: failed if any failed, completed if all
    completed, else the furthest state seen."""
    ann = Meta(pod).annotations
    targets = (ann.get(protocol.ANNOTATION_TARGET_CONTAINERS) or MAIN_CONTAINER).split(",")
    states: list[protocol.SnapshotStatus] = []
    message = ""
    for container in targets:
        raw = ann.get(protocol.per_container(status_key, container.strip()))
        if raw is None:
            continue
        try:
            states.append(protocol.SnapshotStatus.parse(raw))
        except ValueError:
            states.append(protocol.SnapshotStatus.FAILED)
            message = f"unknown agent status {raw!r}"
        message = ann.get(protocol.per_container(message_key, container.strip())) or message
    if protocol.SnapshotStatus.FAILED in states:
        return protocol.SnapshotStatus.FAILED, message
    if states and len(states) == len(targets) and all(s is protocol.SnapshotStatus.COMPLETED for s in states):
        return protocol.SnapshotStatus.COMPLETED, message
    return (protocol.SnapshotStatus.RUNNING if states else None), message


def controlled_by(obj: Obj, owner_uid: str | None) -> bool:
    """Whether `obj`'s controller ownerReference is the object with `owner_uid`."""
    return bool(owner_uid) and (controller_ref(obj) or {}).get("uid") == owner_uid


def _earlier(obj: Obj, ckpt: Obj) -> bool:
    """`obj` is controlled by an earlier DynamoCheckpoint of `ckpt`'s name (deleted, and made again)."""
    ref, meta = controller_ref(obj) or {}, Meta(ckpt)
    return ref.get("kind") == CHECKPOINT.kind and ref.get("name") == meta.name and ref.get("uid") != meta.uid


def _restore_under_way(pod: Obj) -> bool:
    """A restore pod the node agent may be restoring into, or is about to: alive and without a final
    verdict."""
    if not pod_active(pod):
        return False
    verdict, _ = agent_verdict(pod, protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE)
    return verdict is None or not verdict.terminal


class CheckpointReconciler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.snapshot_jobs = ctx.snapshot_jobs
        self.snapshots = ctx.snapshots
        self.contents = ctx.contents

    async def reconcile(self, key: str) -> Result | None:
        ctx = self.ctx
        obj = ctx.checkpoints.get(key)
        if obj is None:
            return None
        view = CheckpointView(obj)
        if view.meta.deleting:
            return await self._finalize(obj)
        namespace, name = key.split("/", 1)
        try:
            ckpt = DynamoCheckpoint.model_validate(obj)
        except ValidationError as e:
            # The CRD schema admits it but our models do not (e.g. an older schema): say so, touch nothing.
            ctx.recorder.record(obj, WARNING, "InvalidSpec", validation_message(e))
            return None
        identity_hash = compute_identity_hash(ckpt.spec.identity)
        meta_patch: dict[str, Any] = {}
        if view.meta.labels.get(protocol.LABEL_CHECKPOINT_HASH) != identity_hash:
            # The hash label is how Auto mode finds checkpoints, pre-warmed ones included.
            meta_patch["labels"] = {protocol.LABEL_CHECKPOINT_HASH: identity_hash}
        held = view.meta.finalizers
        if protocol.FINALIZER not in held:
            # Held until no restore reads the artifact; the resourceVersion makes the list write safe.
            meta_patch["finalizers"] = [*held, protocol.FINALIZER]
            meta_patch["resourceVersion"] = view.meta.resource_version or None
        if meta_patch:
            await ctx.kube.merge_patch(CHECKPOINT, name, {"metadata": meta_patch}, namespace)

        status: dict[str, Any] = dict(view.status)
        phase = status.get("phase") or CheckpointPhase.PENDING.value
        new = dict(status, identityHash=identity_hash)
        result: Result | None = None
        if phase == CheckpointPhase.READY.value:
            failures = status.get("failedRestores") or []
            if not status.get("podSnapshotName"):
                # Taken before checkpoints were PodSnapshots: no agent restores from it any more.
                msg = LEGACY_CHECKPOINT_MESSAGE
                new.update(phase=CheckpointPhase.FAILED.value, message=msg)
                ctx.recorder.record(obj, WARNING, "CheckpointOutdated", msg)
            elif len(failures) >= ctx.settings.restore_failure_threshold:
                msg = (
                    f"{len(failures)} restores from this checkpoint failed (last: {failures[-1]}); "
                    "it is no longer used. Delete it to take a fresh one."
                )
                new.update(phase=CheckpointPhase.FAILED.value, message=msg)
                ctx.recorder.record(obj, WARNING, "TooManyRestoreFailures", msg)
        elif phase != CheckpointPhase.FAILED.value:
            update, result = await self._take(obj, ckpt, identity_hash)
            new.update(update)

        new["conditions"] = cond.set_condition(
            list(status.get("conditions") or []),
            cond.READY,
            new.get("phase") == CheckpointPhase.READY.value,
            new.get("phase") or CheckpointPhase.PENDING.value,
            new.get("message") or "",
            view.meta.generation,
        )
        if new != status:
            if new.get("phase") != status.get("phase"):
                self._announce(obj, new)
            await ctx.kube.patch_status(CHECKPOINT, name, new, namespace)
        return result

    async def _take(
        self, obj: Obj, ckpt: DynamoCheckpoint, identity_hash: str
    ) -> tuple[dict[str, Any], Result | None]:
        """Pending or Creating: make the SnapshotJob, or follow the one made."""
        meta = Meta(obj)
        namespace, name = meta.namespace, meta.name
        job_name = checkpoint_job_name(name)
        job = self.snapshot_jobs.get(f"{namespace}/{job_name}")
        if job is not None and controlled_by(job, meta.uid):
            return self._progress(job), None
        snapshot = self.snapshots.get(f"{namespace}/{job_name}")
        left = [k for k, o in (("SnapshotJob", job), ("PodSnapshot", snapshot)) if o and _earlier(o, obj)]
        if left:
            # A checkpoint of this name was deleted and made again (Auto mode does): the garbage collector
            # removes what the earlier one owned, and the names are free after that.
            kinds = " and ".join(left)
            waiting = f"waiting for the {kinds} {job_name} of an earlier checkpoint of this name to go away"
            return {"phase": CheckpointPhase.PENDING.value, "message": waiting}, Result(
                requeue_after=RECHECK_S
            )
        if job is None:
            return await self._create_job(obj, ckpt, identity_hash), None
        message = (
            f"SnapshotJob {job_name} exists and is not controlled by this DynamoCheckpoint; delete it or "
            "give the checkpoint another name"
        )
        return {"phase": CheckpointPhase.FAILED.value, "message": message}, None

    async def _create_job(self, obj: Obj, ckpt: DynamoCheckpoint, identity_hash: str) -> dict[str, Any]:
        ctx = self.ctx
        manifest = checkpoint_snapshot_job(obj, ckpt, identity_hash)
        job_name = manifest["metadata"]["name"]
        try:
            await ctx.kube.create(SNAPSHOT_JOB, manifest, Meta(obj).namespace)
        except ApiError as e:
            if e.status in (400, 422):
                # The SnapshotJob's schema checks the pod template (a container named main, above all).
                message = f"spec.job.podTemplateSpec: the SnapshotJob {job_name} was refused: {e.message}"
                return {"phase": CheckpointPhase.FAILED.value, "message": message}
            if not is_already_exists(e):
                raise
        else:
            ctx.recorder.record(obj, NORMAL, "SnapshotJobCreated", f"created SnapshotJob {job_name}")
        return {
            "phase": CheckpointPhase.CREATING.value,
            "jobName": job_name,
            "message": "starting the worker to checkpoint",
        }

    def _progress(self, job: Obj) -> dict[str, Any]:
        """Creating -> Ready/Failed from the SnapshotJob's conditions, its PodSnapshot and that PodSnapshot's
        content."""
        view = SnapshotJobView(job)
        job_name = view.meta.name
        if view.condition_true(cond.FAILED):
            failed = view.condition(cond.FAILED)
            why = f"{failed.get('reason') or 'Failed'}: {failed.get('message') or ''}".rstrip(": ")
            return {"phase": CheckpointPhase.FAILED.value, "message": f"SnapshotJob {job_name} failed: {why}"}
        creating: dict[str, Any] = {
            "phase": CheckpointPhase.CREATING.value,
            "jobName": job_name,
            "message": WAITING_MESSAGE,
        }
        snapshot = self._snapshot_of(job)
        if snapshot is None:
            return creating
        taken = PodSnapshotView(snapshot)
        creating["podSnapshotName"] = taken.meta.name
        if not taken.condition_true(cond.READY):
            creating["message"] = f"waiting for the node agent to checkpoint pod {taken.source.name or None}"
            return creating
        content = self._content_of(snapshot)
        if content is None:
            return creating  # the content's Ready reaches this cache a moment after the PodSnapshot's
        return ready_status(snapshot, content)

    def _snapshot_of(self, job: Obj) -> Obj | None:
        """The PodSnapshot the SnapshotJob made (by its recorded UID), once it is in the cache."""
        view = SnapshotJobView(job)
        name, uid = view.pod_snapshot_name, view.pod_snapshot_uid
        if not name or not uid:
            return None
        snapshot = self.snapshots.get(f"{view.meta.namespace}/{name}")
        return snapshot if snapshot is not None and Meta(snapshot).uid == uid else None

    def _content_of(self, snapshot: Obj) -> Obj | None:
        """The Ready content bound to `snapshot`, once it is in the cache."""
        bound = PodSnapshotView(snapshot).bound_content
        content = self.contents.get(bound) if bound else None
        if content is None:
            return None
        view = PodSnapshotContentView(content)
        if view.snapshot_ref.get("uid") != Meta(snapshot).uid or not view.condition_true(cond.READY):
            return None
        return content

    async def _finalize(self, obj: Obj) -> Result | None:
        """A deleted checkpoint keeps its finalizer while a restore from it is under way, so its artifact
        is never removed under a reader; the node agents remove the artifact once the object is gone."""
        ctx = self.ctx
        if protocol.FINALIZER not in Meta(obj).finalizers:
            return None
        restoring = [Meta(p).name for p in self._restore_pods(obj) if _restore_under_way(p)]
        if restoring:
            msg = f"deleting once no restore reads it; restores under way: {', '.join(sorted(restoring))}"
            ctx.recorder.record(obj, NORMAL, "DeletionWaits", msg)
            return Result(requeue_after=FINALIZE_RECHECK_S)
        await remove_finalizer(ctx.kube, CHECKPOINT, obj, protocol.FINALIZER)
        log.info("checkpoint released for deletion", extra={"checkpoint": object_key(obj)})
        return None

    def _restore_pods(self, obj: Obj) -> list[Obj]:
        meta = Meta(obj)
        return [
            p
            for p in self.ctx.pods.by_label(protocol.LABEL_CHECKPOINT_ID, meta.name)
            if Meta(p).namespace == meta.namespace
            and Meta(p).labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE
        ]

    def _announce(self, obj: Obj, status: dict[str, Any]) -> None:
        phase = status.get("phase")
        if phase == CheckpointPhase.READY.value:
            self.ctx.recorder.record(obj, NORMAL, "CheckpointReady", status.get("message") or "ready")
        elif phase == CheckpointPhase.FAILED.value:
            self.ctx.recorder.record(obj, WARNING, "CheckpointFailed", status.get("message") or "failed")


def ready_status(snapshot: Obj, content: Obj) -> dict[str, Any]:
    """The status of a DynamoCheckpoint whose PodSnapshot is Ready with ``content``: Ready with the
    artifact's location, digest and compatibility (the content's status, else the annotations the node
    agent keeps where another operator's CRD prunes them), else Failed saying what is missing."""
    view = PodSnapshotContentView(content)
    content_name = view.meta.name
    try:
        artifact = content_artifact(content) or PodSnapshotArtifact()
        compat = content_compatibility(content) or PodSnapshotCompatibility()
    except ValueError as e:
        return {
            "phase": CheckpointPhase.FAILED.value,
            "message": f"PodSnapshotContent {content_name} is Ready, but its {e}",
        }
    digest = artifact.digest or ""
    if not _SHA256.fullmatch(digest):
        return {
            "phase": CheckpointPhase.FAILED.value,
            "message": f"PodSnapshotContent {content_name} is Ready without a valid artifact digest "
            f"(status.artifact, else annotation {protocol.ANNOTATION_CONTENT_ARTIFACT}; a node agent "
            "older than the controller?): no restore could verify the artifact",
        }
    compatibility = CheckpointCompatibility(
        gpu_product=compat.gpu_product,
        cuda_driver_major=compat.cuda_driver_major,
        # 0 GPUs asks nothing of a node, as a checkpoint that names no count.
        gpu_count=compat.gpu_count or None,
    )
    source = view.source.name or None
    snapshot_name = Meta(snapshot).name
    return {
        "phase": CheckpointPhase.READY.value,
        "message": f"checkpointed from pod {source} into PodSnapshot {snapshot_name}",
        "location": artifact.location,
        "artifactDigest": digest,
        "sourcePod": source,
        "storageType": "pvc",
        "createdAt": cond.now_rfc3339(),
        "compatibility": compatibility.model_dump(by_alias=True, exclude_none=True),
        "podSnapshotName": snapshot_name,
    }
