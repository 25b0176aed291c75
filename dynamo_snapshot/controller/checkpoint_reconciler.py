"""DynamoCheckpoint reconcile: run the checkpoint Job, watch the node agent's verdict on its pod, and keep
`status` (phase, hash, location, compatibility, conditions) true to what the cluster shows.

Pending -> Creating (Job exists) -> Ready (agent reported `completed`) | Failed (Job deadline or backoff,
agent reported `failed`, or too many restores from it failed).
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
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.podspec import (
    MAIN_CONTAINER,
    checkpoint_job,
    checkpoint_job_name,
    gpus_of_pod,
)
from dynamo_snapshot.kube import (
    NORMAL,
    WARNING,
    Obj,
    Result,
    controller_ref,
    is_already_exists,
    is_not_found,
    object_key,
)
from dynamo_snapshot.kube.finalizers import remove_finalizer
from dynamo_snapshot.kube.kinds import CHECKPOINT, JOB
from dynamo_snapshot.kube.pods import pod_active

log = logging.getLogger(__name__)
FINALIZE_RECHECK_S = 2.0
_SHA256 = re.compile(r"[0-9a-f]{64}")


def agent_verdict(pod: Obj, status_key: str, message_key: str) -> tuple[protocol.SnapshotStatus | None, str]:
    """The node agent's status for the pod's target containers: failed if any failed, completed if all
    completed, else the furthest state seen."""
    ann = pod["metadata"].get("annotations") or {}
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


def _restore_under_way(pod: Obj) -> bool:
    """A restore pod the node agent may be restoring into, or is about to: alive and without a final
    verdict."""
    if not pod_active(pod):
        return False
    verdict, _ = agent_verdict(pod, protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE)
    return verdict is None or not verdict.terminal


def _job_failure(job: Obj) -> str | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            name = job["metadata"]["name"]
            return f"checkpoint Job {name} failed: {c.get('reason', '')}: {c.get('message', '')}"
    return None


class CheckpointReconciler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def reconcile(self, key: str) -> Result | None:
        ctx = self.ctx
        obj = ctx.checkpoints.get(key)
        if obj is None:
            return None
        if obj["metadata"].get("deletionTimestamp"):
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
        if (obj["metadata"].get("labels") or {}).get(protocol.LABEL_CHECKPOINT_HASH) != identity_hash:
            # The hash label is how Auto mode finds checkpoints, pre-warmed ones included.
            meta_patch["labels"] = {protocol.LABEL_CHECKPOINT_HASH: identity_hash}
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if protocol.FINALIZER not in finalizers:
            # Held until no restore reads the artifact; the resourceVersion makes the list write safe.
            meta_patch["finalizers"] = [*finalizers, protocol.FINALIZER]
            meta_patch["resourceVersion"] = obj["metadata"]["resourceVersion"]
        if meta_patch:
            await ctx.kube.merge_patch(CHECKPOINT, name, {"metadata": meta_patch}, namespace)

        status: dict[str, Any] = dict(obj.get("status") or {})
        phase = status.get("phase") or CheckpointPhase.PENDING.value
        new = dict(status, identityHash=identity_hash)
        job_name = checkpoint_job_name(name)
        job = ctx.jobs.get(f"{namespace}/{job_name}")
        generation = obj["metadata"].get("generation")

        if phase == CheckpointPhase.READY.value:
            failures = status.get("failedRestores") or []
            if len(failures) >= ctx.settings.restore_failure_threshold:
                msg = (
                    f"{len(failures)} restores from this checkpoint failed (last: {failures[-1]}); "
                    "it is no longer used. Delete it to take a fresh one."
                )
                new.update(phase=CheckpointPhase.FAILED.value, message=msg)
                ctx.recorder.record(obj, WARNING, "TooManyRestoreFailures", msg)
            elif job is not None:
                # The source worker has served its purpose; free its GPU.
                await self._delete_job(namespace, job_name)
        elif phase == CheckpointPhase.FAILED.value:
            if job is not None and not _job_failure(job):
                await self._delete_job(namespace, job_name)
        elif job is None:
            try:
                await ctx.kube.create(JOB, checkpoint_job(obj, ckpt, identity_hash))
                ctx.recorder.record(obj, NORMAL, "JobCreated", f"created checkpoint Job {job_name}")
            except Exception as e:
                if not is_already_exists(e):
                    raise
            new.update(
                phase=CheckpointPhase.CREATING.value,
                jobName=job_name,
                message="starting the worker to checkpoint",
            )
        else:
            new.update(self._progress(obj, job, new))

        new["conditions"] = cond.set_condition(
            list(status.get("conditions") or []),
            cond.READY,
            new.get("phase") == CheckpointPhase.READY.value,
            new.get("phase") or CheckpointPhase.PENDING.value,
            new.get("message") or "",
            generation,
        )
        if new != status:
            if new.get("phase") != status.get("phase"):
                self._announce(obj, new)
            await ctx.kube.patch_status(CHECKPOINT, name, new, namespace)
        return None

    def _progress(self, obj: Obj, job: Obj, status: dict[str, Any]) -> dict[str, Any]:
        """Creating -> Ready/Failed from the Job's conditions and the agent's annotations on its pod."""
        ctx = self.ctx
        namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        failure = _job_failure(job)
        if failure:
            return {"phase": CheckpointPhase.FAILED.value, "message": failure}
        # Only the Job's own pods count: a pod that merely carries the labels proves nothing.
        job_uid = job["metadata"].get("uid")
        sources = [
            p
            for p in ctx.pods.by_label(protocol.LABEL_CHECKPOINT_ID, name)
            if p["metadata"]["namespace"] == namespace
            and (p["metadata"].get("labels") or {}).get(protocol.LABEL_CHECKPOINT_SOURCE) == protocol.TRUE
            and controlled_by(p, job_uid)
        ]
        for pod in sources:
            verdict, message = agent_verdict(
                pod, protocol.ANNOTATION_CHECKPOINT_STATUS, protocol.ANNOTATION_CHECKPOINT_MESSAGE
            )
            if verdict is protocol.SnapshotStatus.COMPLETED:
                ann = pod["metadata"].get("annotations") or {}
                digest = ann.get(protocol.ANNOTATION_ARTIFACT_DIGEST) or ""
                if not _SHA256.fullmatch(digest):
                    return {
                        "phase": CheckpointPhase.FAILED.value,
                        "message": f"the node agent reported pod {pod['metadata']['name']} checkpointed "
                        f"without a valid {protocol.ANNOTATION_ARTIFACT_DIGEST} annotation "
                        "(an agent older than the controller?): no restore could verify the artifact",
                    }
                return {
                    "phase": CheckpointPhase.READY.value,
                    "message": f"checkpointed from pod {pod['metadata']['name']}",
                    "location": ann.get(protocol.ANNOTATION_CHECKPOINT_LOCATION),
                    "artifactDigest": digest,
                    "sourcePod": pod["metadata"]["name"],
                    "storageType": ann.get(protocol.ANNOTATION_CHECKPOINT_STORAGE_TYPE) or "pvc",
                    "createdAt": cond.now_rfc3339(),
                    "compatibility": self._compatibility(pod).model_dump(by_alias=True, exclude_none=True),
                    "jobName": job["metadata"]["name"],
                }
            if verdict is protocol.SnapshotStatus.FAILED:
                return {
                    "phase": CheckpointPhase.FAILED.value,
                    "message": f"node agent failed to checkpoint pod {pod['metadata']['name']}: {message}",
                }
        waiting = "waiting for the worker to become ready and the node agent to checkpoint it"
        return {
            "phase": CheckpointPhase.CREATING.value,
            "jobName": job["metadata"]["name"],
            "message": waiting,
        }

    def _compatibility(self, pod: Obj) -> CheckpointCompatibility:
        """The GPU environment of the node the checkpoint was taken on, as GPU feature discovery labels it."""
        node = self.ctx.nodes.get(pod.get("spec", {}).get("nodeName") or "") or {}
        labels = (node.get("metadata") or {}).get("labels") or {}
        return CheckpointCompatibility(
            gpu_product=labels.get(protocol.LABEL_GPU_PRODUCT),
            cuda_driver_major=labels.get(protocol.LABEL_CUDA_DRIVER_MAJOR),
            gpu_count=gpus_of_pod(pod) or None,
        )

    async def _finalize(self, obj: Obj) -> Result | None:
        """A deleted checkpoint keeps its finalizer while a restore from it is under way, so its artifact
        is never removed under a reader; the node agents remove the artifact once the object is gone."""
        ctx = self.ctx
        meta = obj["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        if protocol.FINALIZER not in finalizers:
            return None
        restoring = [p["metadata"]["name"] for p in self._restore_pods(obj) if _restore_under_way(p)]
        if restoring:
            msg = f"deleting once no restore reads it; restores under way: {', '.join(sorted(restoring))}"
            ctx.recorder.record(obj, NORMAL, "DeletionWaits", msg)
            return Result(requeue_after=FINALIZE_RECHECK_S)
        await remove_finalizer(ctx.kube, CHECKPOINT, obj, protocol.FINALIZER)
        log.info("checkpoint released for deletion", extra={"checkpoint": object_key(obj)})
        return None

    def _restore_pods(self, obj: Obj) -> list[Obj]:
        namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        return [
            p
            for p in self.ctx.pods.by_label(protocol.LABEL_CHECKPOINT_ID, name)
            if p["metadata"]["namespace"] == namespace
            and (p["metadata"].get("labels") or {}).get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE
        ]

    async def _delete_job(self, namespace: str, job_name: str) -> None:
        try:
            await self.ctx.kube.delete(JOB, job_name, namespace, propagation_policy="Background")
        except Exception as e:
            if not is_not_found(e):
                raise

    def _announce(self, obj: Obj, status: dict[str, Any]) -> None:
        phase = status.get("phase")
        if phase == CheckpointPhase.READY.value:
            self.ctx.recorder.record(obj, NORMAL, "CheckpointReady", status.get("message") or "ready")
        elif phase == CheckpointPhase.FAILED.value:
            self.ctx.recorder.record(obj, WARNING, "CheckpointFailed", status.get("message") or "failed")
