"""SnapshotJob reconcile: run the SnapshotJob's pod as a batch/v1 Job until it is ready, capture it into a
PodSnapshot, then remove the pod; or fail with the reason, publishing nothing.

Each reconcile reads the world and moves one step: the Job (named like the SnapshotJob, controlled by it),
then, once its pod is Ready, the PodSnapshot (named like the SnapshotJob, labelled with its UID), then, once
the PodSnapshot is Ready, Completed and the Job deleted. The PodSnapshot is never owned by the SnapshotJob
(the artifact outlives the job) but carries the SnapshotJob's own controller ownerReference when it has one
(a DynamoCheckpoint's SnapshotJob): it goes with the SnapshotJob's owner. Names are deterministic, so a
reconcile that crashed after a create finds what it made instead of making a second one. Completed=True and
Failed=True are terminal. A failure deletes the Job and any PodSnapshot it made that is not Ready, so a
capture still under way cannot publish afterwards. Status writes are conditional on the version read, and a
terminal one comes before its cleanup: a reconcile from a stale cache acts on nothing, and a crash after the
write leaves the cleanup to the next reconcile.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.api.snapshotjob import SnapshotJob, SnapshotJobCondition, SnapshotJobReason
from dynamo_snapshot.api.views import Meta, ObjectView, PodSnapshotView, PodView, SnapshotJobView
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.podspec import snapshot_job_labels, snapshot_job_source
from dynamo_snapshot.kube import (
    NORMAL,
    WARNING,
    ApiError,
    Obj,
    Result,
    is_already_exists,
    is_conflict,
    is_not_found,
)
from dynamo_snapshot.kube.kinds import JOB, POD_SNAPSHOT, SNAPSHOT_JOB

log = logging.getLogger(__name__)

RUNNING, CAPTURED, COMPLETED = (
    SnapshotJobCondition.RUNNING,
    SnapshotJobCondition.CAPTURED,
    SnapshotJobCondition.COMPLETED,
)
Reason = SnapshotJobReason
POD_PENDING_MESSAGE = "waiting for the source pod to become ready"
POD_READY_MESSAGE = "source pod is ready"
# How soon a wait on another object's change is looked at again when no event may announce it.
RECHECK_S = 1.0


class SnapshotJobReconciler:
    def __init__(self, ctx: Context) -> None:
        # ctx.pods indexes protocol.LABEL_SNAPSHOT_JOB_UID; ctx.jobs and ctx.pods select on the managed-by
        # label (the Job and its pod carry it).
        self.kube = ctx.kube
        self.snapshot_jobs = ctx.snapshot_jobs
        self.jobs = ctx.jobs
        self.pods = ctx.pods
        self.snapshots = ctx.snapshots
        self.contents = ctx.contents
        self.recorder = ctx.recorder

    async def reconcile(self, key: str) -> Result | None:
        obj = self.snapshot_jobs.get(key)
        if obj is None or Meta(obj).deleting:
            return None  # the garbage collector takes the Job; the PodSnapshot stays
        try:
            return await self._step(obj)
        except ApiError as e:
            if not is_conflict(e):
                raise
            # The cache was behind the SnapshotJob (a status this reconcile did not see): look again.
            return Result(requeue=True)

    async def _step(self, obj: Obj) -> Result | None:
        view = SnapshotJobView(obj)
        if view.condition_true(COMPLETED) or view.condition_true(cond.FAILED):
            # What a crash after the terminal status write left (the cache only: this runs every resync).
            left = self.jobs.get(f"{view.meta.namespace}/{view.meta.name}")
            if left is not None and _ours(left, obj):
                await self._delete_job(left)
            failed = view.condition(cond.FAILED)
            if failed.get("status") == "True" and failed.get("reason") != Reason.POD_SNAPSHOT_FAILED:
                await self._unpublish(obj, cached_only=True)
            return None
        job = await self._job(obj)
        try:
            sj = SnapshotJob.model_validate(obj)
        except ValidationError as e:
            return await self._fail(obj, Reason.INVALID_SPEC, validation_message(e), job)
        if job is not None and not _ours(job, obj):
            if Meta(job).deleting:
                return Result(requeue_after=RECHECK_S)  # an earlier SnapshotJob's Job, going away
            message = f"Job {Meta(job).name} exists and is not controlled by this SnapshotJob"
            return await self._fail(obj, Reason.JOB_NAME_CONFLICT, message, None)
        if view.pod_snapshot_uid:
            snapshot = await self._made_snapshot(view)
            if isinstance(snapshot, str):
                return await self._fail(obj, Reason.POD_SNAPSHOT_DELETED, snapshot, job)
            outcome = await self._snapshot_outcome(obj, snapshot, job)
            if outcome is not None:
                return outcome
        remaining = _remaining_s(obj, sj.spec.active_deadline_seconds)
        if remaining <= 0:
            message = (
                f"not captured within activeDeadlineSeconds ({sj.spec.active_deadline_seconds}s) of the "
                "SnapshotJob's creation"
            )
            return await self._fail(obj, Reason.DEADLINE_EXCEEDED, message + _never_ready(view), job)
        if job is None:
            if view.source_job_uid:
                message = f"Job {view.meta.name} was deleted before the capture completed"
                return await self._fail(obj, Reason.JOB_DELETED, message, None)
            return await self._create_job(obj, sj, remaining)
        return await self._follow_job(obj, sj, job, remaining)

    # ------------------------------------------------------------------ the Job
    async def _job(self, obj: Obj) -> Obj | None:
        """The Job of the SnapshotJob's name, whoever made it; the cache first, then the apiserver (the
        cache holds only Jobs with the managed-by label, and may not have seen a Job just made)."""
        meta = Meta(obj)
        cached = self.jobs.get(f"{meta.namespace}/{meta.name}")
        if cached is not None:
            return cached
        try:
            job: Obj = await self.kube.get(JOB, meta.name, meta.namespace)
        except ApiError as e:
            if is_not_found(e):
                return None
            raise
        return job

    async def _create_job(self, obj: Obj, sj: SnapshotJob, remaining: float) -> Result | None:
        target = sj.spec.pod_snapshot_template.target_containers[0]
        try:
            manifest = snapshot_job_source(obj, target, sj.spec.active_deadline_seconds)
        except ValueError as e:
            return await self._fail(obj, Reason.INVALID_SPEC, f"podTemplate: {e}", None)
        try:
            job: Obj = await self.kube.create(JOB, manifest)
        except ApiError as e:
            if is_already_exists(e):
                return Result(requeue=True)  # made by a reconcile that crashed, or by someone else
            if e.status in (400, 422):
                return await self._fail(obj, Reason.INVALID_SPEC, f"the Job was refused: {e.message}", None)
            raise
        self.recorder.record(obj, NORMAL, "JobCreated", f"created Job {Meta(job).name}")
        status = _with(obj, RUNNING, False, Reason.POD_PENDING, POD_PENDING_MESSAGE)
        status["sourceJobUid"] = Meta(job).uid
        await self._write(obj, status)
        return Result(requeue_after=remaining)

    async def _follow_job(self, obj: Obj, sj: SnapshotJob, job: Obj, remaining: float) -> Result | None:
        """A Job of ours: its failure or end, else its pod's readiness and then the PodSnapshot."""
        view, job_meta = SnapshotJobView(obj), Meta(job)
        if job_meta.deleting:
            return await self._fail(obj, Reason.JOB_DELETED, f"Job {job_meta.name} is being deleted", job)
        status = dict(view.status)
        ended = _job_ended(job)
        if ended is not None:
            if view.pod_snapshot_uid and self._content_has_outcome(view.pod_snapshot_uid):
                return Result(requeue_after=RECHECK_S)  # the outcome is on its way to the PodSnapshot
            reason, message = ended
            if reason == Reason.DEADLINE_EXCEEDED:
                message += _never_ready(view)
            return await self._fail(obj, reason, message, job)
        status["sourceJobUid"] = job_meta.uid
        pods = self._pods_of(obj, job)
        if view.pod_snapshot_uid:
            return await self._capturing(obj, status, pods, job, remaining)
        pod = next((p for p in pods if _pod_ready(p)), None)
        if pod is None:
            done = next((p for p in pods if _phase(p) == "Succeeded"), None)
            if done is not None:
                message = f"source pod {Meta(done).name} exited before it was captured"
                return await self._fail(obj, Reason.SOURCE_COMPLETED_WITHOUT_CAPTURE, message, job)
            status["conditions"] = _set(obj, RUNNING, False, Reason.POD_PENDING, POD_PENDING_MESSAGE)
            await self._write(obj, status)
            return Result(requeue_after=remaining)
        return await self._create_snapshot(obj, sj, status, pod, job, remaining)

    def _pods_of(self, obj: Obj, job: Obj) -> list[Obj]:
        """The Job's own pods: a pod that merely carries the labels proves nothing."""
        meta, job_uid = Meta(obj), Meta(job).uid
        return [
            p
            for p in self.pods.by_label(protocol.LABEL_SNAPSHOT_JOB_UID, meta.uid)
            if Meta(p).namespace == meta.namespace and (Meta(p).controller or {}).get("uid") == job_uid
        ]

    # ------------------------------------------------------------------ the PodSnapshot
    async def _create_snapshot(
        self, obj: Obj, sj: SnapshotJob, status: dict[str, Any], pod: Obj, job: Obj, remaining: float
    ) -> Result | None:
        meta = Meta(obj)
        containers = list(sj.spec.pod_snapshot_template.target_containers)
        manifest = _pod_snapshot(obj, pod, containers)
        try:
            snapshot: Obj = await self.kube.create(POD_SNAPSHOT, manifest, meta.namespace)
        except ApiError as e:
            if not is_already_exists(e):
                raise
            snapshot = await self.kube.get(POD_SNAPSHOT, meta.name, meta.namespace)
            if Meta(snapshot).labels.get(protocol.LABEL_SNAPSHOT_JOB_UID) != meta.uid:
                message = f"PodSnapshot {meta.name} exists and was not made by this SnapshotJob"
                return await self._fail(obj, Reason.POD_SNAPSHOT_NAME_CONFLICT, message, job)
        else:
            message = f"created PodSnapshot {meta.name} of pod {Meta(pod).name}"
            self.recorder.record(obj, NORMAL, "PodSnapshotCreated", message)
        status.setdefault("startedAt", cond.now_rfc3339())
        status.update(podSnapshotName=meta.name, podSnapshotUid=Meta(snapshot).uid)
        conditions = _set(obj, RUNNING, True, Reason.POD_READY, POD_READY_MESSAGE)
        status["conditions"] = cond.set_condition(
            conditions,
            CAPTURED,
            False,
            Reason.CAPTURE_IN_PROGRESS,
            f"waiting for PodSnapshot {meta.name} to be captured",
            meta.generation,
        )
        await self._write(obj, status)
        return Result(requeue_after=remaining)

    async def _made_snapshot(self, view: SnapshotJobView) -> Obj | str:
        """The PodSnapshot this SnapshotJob made, or why it is gone."""
        name, namespace = view.pod_snapshot_name or view.meta.name, view.meta.namespace
        snapshot = self.snapshots.get(f"{namespace}/{name}")
        if snapshot is None or Meta(snapshot).uid != view.pod_snapshot_uid:
            try:  # the cache may not have seen it made yet, or seen it replaced
                snapshot = await self.kube.get(POD_SNAPSHOT, name, namespace)
            except ApiError as e:
                if not is_not_found(e):
                    raise
                return f"PodSnapshot {name} was deleted before the capture completed"
        if Meta(snapshot).uid != view.pod_snapshot_uid:
            return (
                f"PodSnapshot {name} was deleted before the capture completed (one of that name replaced it)"
            )
        if Meta(snapshot).deleting and not cond.is_true(snapshot, cond.READY):
            return f"PodSnapshot {name} is being deleted before the capture completed"
        return snapshot

    async def _snapshot_outcome(self, obj: Obj, snapshot: Obj, job: Obj | None) -> Result | None:
        """Completed when the PodSnapshot is Ready, Failed when it failed; None while it is pending."""
        made = ObjectView(snapshot)
        name = made.meta.name
        if made.condition_true(cond.FAILED):
            failed = made.condition(cond.FAILED)
            why = f"{failed.get('reason') or 'Failed'}: {failed.get('message') or ''}".rstrip(": ")
            message = f"PodSnapshot {name} failed: {why}"
            return await self._fail(obj, Reason.POD_SNAPSHOT_FAILED, message, job, keep_snapshot=True)
        if not made.condition_true(cond.READY):
            return None
        view = ObjectView(obj)
        status, generation = dict(view.status), view.meta.generation
        message = f"PodSnapshot {name} is Ready"
        conditions = _set(obj, CAPTURED, True, Reason.CAPTURE_COMPLETED, message)
        status["conditions"] = cond.set_condition(
            conditions,
            COMPLETED,
            True,
            Reason.JOB_COMPLETED,
            f"{message}; the source pod is removed",
            generation,
        )
        status.setdefault("completedAt", cond.now_rfc3339())
        await self._write(obj, status)
        if job is not None:
            await self._delete_job(job)
        self.recorder.record(obj, NORMAL, "Completed", f"captured into PodSnapshot {name}")
        log.info("snapshot job completed", extra={"snapshot_job": view.meta.name, "podsnapshot": name})
        return None

    async def _capturing(
        self, obj: Obj, status: dict[str, Any], pods: list[Obj], job: Obj, remaining: float
    ) -> Result | None:
        """The PodSnapshot is pending: its source pod must stay until the capture's outcome."""
        view = SnapshotJobView(obj)
        snapshot = self.snapshots.get(f"{view.meta.namespace}/{view.pod_snapshot_name}")
        source_uid = PodSnapshotView(snapshot).source.uid if snapshot is not None else ""
        source = next((PodView(p) for p in pods if Meta(p).uid == source_uid), None)
        if source is None or source.meta.deleting or source.phase in _ENDED:
            if self._content_has_outcome(view.pod_snapshot_uid):
                return Result(requeue_after=RECHECK_S)  # the outcome is on its way to the PodSnapshot
            pod = (source.meta.name if source is not None else "") or "the source pod"
            if source is not None and source.phase == "Succeeded":
                message = f"source pod {pod} exited before the capture completed"
                return await self._fail(obj, Reason.SOURCE_COMPLETED_WITHOUT_CAPTURE, message, job)
            message = f"{pod} was deleted or failed before the capture completed"
            return await self._fail(obj, Reason.JOB_FAILED, message, job)
        await self._write(obj, status)
        return Result(requeue_after=remaining)

    def _content_has_outcome(self, snapshot_uid: str) -> bool:
        """Whether the node agent wrote the capture's outcome on the PodSnapshot's content, which the
        PodSnapshot reconcile has not mirrored onto the PodSnapshot yet."""
        content = self.contents.get(content_name(snapshot_uid)) or {}
        return cond.is_true(content, cond.READY) or cond.is_true(content, cond.FAILED)

    # ------------------------------------------------------------------ failure and writes
    async def _fail(
        self, obj: Obj, reason: str, message: str, job: Obj | None, *, keep_snapshot: bool = False
    ) -> Result | None:
        """Failed=True, terminal, with the conditions never set back-filled as upstream does; then the Job
        deleted, and a PodSnapshot it made that is not Ready (nothing is published).

        The status is written first, conditional on the version read: a reconcile from a stale cache fails
        there before touching anything, and a crash after it leaves the cleanup to the terminal path."""
        view = ObjectView(obj)
        status, generation, conditions = dict(view.status), view.meta.generation, view.conditions
        have = {c.get("type") for c in conditions}
        backfill = [
            (
                RUNNING,
                Reason.POD_PENDING,
                "source pod was never observed ready before this SnapshotJob failed",
            ),
            (CAPTURED, reason, f"capture was never started before this SnapshotJob failed: {message}"),
            (COMPLETED, reason, f"the SnapshotJob failed before completing: {message}"),
        ]
        for type_, why, text in backfill:
            if type_ not in have:
                conditions = cond.set_condition(conditions, type_, False, why, text, generation)
        status["conditions"] = cond.set_condition(conditions, cond.FAILED, True, reason, message, generation)
        status.setdefault("completedAt", cond.now_rfc3339())
        await self._write(obj, status)
        if job is not None and _ours(job, obj):
            await self._delete_job(job)
        if not keep_snapshot:
            await self._unpublish(obj)
        self.recorder.record(obj, WARNING, reason, message)
        log.info(
            "snapshot job failed",
            extra={"snapshot_job": view.meta.name, "reason": reason, "detail": message},
        )
        return None

    async def _unpublish(self, obj: Obj, *, cached_only: bool = False) -> None:
        """Delete the PodSnapshot this SnapshotJob made unless it is Ready: a failed job publishes nothing."""
        view = SnapshotJobView(obj)
        meta = view.meta
        name = view.pod_snapshot_name or meta.name
        snapshot = self.snapshots.get(f"{meta.namespace}/{name}")
        if snapshot is None and cached_only:
            return
        if snapshot is None:
            try:  # made by a reconcile that crashed before its status write, and not cached yet
                snapshot = await self.kube.get(POD_SNAPSHOT, name, meta.namespace)
            except ApiError as e:
                if is_not_found(e):
                    return
                raise
        made = ObjectView(snapshot)
        if made.meta.labels.get(protocol.LABEL_SNAPSHOT_JOB_UID) != meta.uid:
            return
        if made.condition_true(cond.READY) or made.meta.deleting:
            return
        try:
            await self.kube.delete(POD_SNAPSHOT, name, meta.namespace, uid=made.meta.uid)
        except ApiError as e:
            if not is_not_found(e):
                raise

    async def _delete_job(self, job: Obj) -> None:
        meta = Meta(job)
        if meta.deleting:
            return
        try:
            # Background: the Job goes at once and the garbage collector takes its pod.
            await self.kube.delete(JOB, meta.name, meta.namespace, propagation_policy="Background")
        except ApiError as e:
            if not is_not_found(e):
                raise

    async def _write(self, obj: Obj, status: dict[str, Any]) -> None:
        view = ObjectView(obj)
        if status == view.status:
            return
        meta = view.meta
        # Conditional on the version read: a reconcile from a cache that has not seen the last write (a
        # terminal one above all) must not write over it.
        patch = {"metadata": {"resourceVersion": meta.resource_version}, "status": status}
        await self.kube.merge_patch(SNAPSHOT_JOB, meta.name, patch, meta.namespace, subresource="status")


def _ours(job: Obj, obj: Obj) -> bool:
    return bool((Meta(job).controller or {}).get("uid") == Meta(obj).uid)


_ENDED = ("Succeeded", "Failed")


def _phase(pod: Obj) -> str:
    return PodView(pod).phase


def _pod_ready(pod: Obj) -> bool:
    view = PodView(pod)
    return not view.meta.deleting and view.phase == "Running" and view.condition_true("Ready")


def _never_ready(view: SnapshotJobView) -> str:
    """What a deadline message adds when the pod never became ready: the worker never said it may be
    captured (its readiness probe reads the ready file)."""
    if view.started_at:
        return ""
    return (
        f"; its pod never became ready: the worker wrote no {protocol.FILE_READY_FOR_SNAPSHOT} in "
        f"{protocol.CONTROL_MOUNT_PATH}"
    )


def _job_ended(job: Obj) -> tuple[str, str] | None:
    """The Job's own verdict, when it has one: the reason and message a SnapshotJob fails with."""
    view = ObjectView(job)
    name = view.meta.name
    for c in view.conditions:
        if c.get("status") != "True":
            continue
        detail = f"{c.get('reason') or ''}: {c.get('message') or ''}".strip(": ")
        if c.get("type") == "Failed":
            if c.get("reason") == "DeadlineExceeded":
                return Reason.DEADLINE_EXCEEDED, f"Job {name} ran past its activeDeadlineSeconds: {detail}"
            return Reason.JOB_FAILED, f"Job {name} failed: {detail}"
        if c.get("type") == "Complete":
            return Reason.SOURCE_COMPLETED_WITHOUT_CAPTURE, f"Job {name}'s pod exited before it was captured"
    return None


def _remaining_s(obj: Obj, deadline_s: int) -> float:
    """Seconds left of activeDeadlineSeconds, counted from the SnapshotJob's creation."""
    created = cond.parse_rfc3339(Meta(obj).creation_timestamp)
    return deadline_s - (datetime.now(UTC) - created).total_seconds()


def _set(obj: Obj, type_: str, status: bool, reason: str, message: str) -> list[dict[str, Any]]:
    view = ObjectView(obj)
    return cond.set_condition(view.conditions, type_, status, reason, message, view.meta.generation)


def _with(obj: Obj, type_: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    return {**ObjectView(obj).status, "conditions": _set(obj, type_, status, reason, message)}


def _pod_snapshot(obj: Obj, pod: Obj, containers: list[str]) -> Obj:
    meta = Meta(obj)
    labels = snapshot_job_labels(meta.name, meta.uid)
    snapshot_meta: Obj = {"name": meta.name, "namespace": meta.namespace, "labels": labels}
    owner = next((ref for ref in meta.owner_references if ref.get("controller")), None)
    if owner is not None:
        snapshot_meta["ownerReferences"] = [dict(owner)]
    return {
        "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
        "kind": "PodSnapshot",
        "metadata": snapshot_meta,
        "spec": {
            "source": {
                "podRef": {
                    "name": Meta(pod).name,
                    "uid": Meta(pod).uid,
                    "containers": containers,
                }
            }
        },
    }
