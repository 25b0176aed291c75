"""PodSnapshot reconcile: bind each PodSnapshot to its PodSnapshotContent, and keep its Ready and Failed
conditions true to the content's, where the node agent writes the capture's outcome.

A PodSnapshot names a running pod of its own namespace. Its content is created once the pod is on a node
(the content names that node, whose agent captures it) and is called after the PodSnapshot's UID, so a
reconcile that crashed after creating it finds it again instead of making a second one. Failed is terminal.
Deleting a PodSnapshot deletes its content first (finalizer nvidia.com/podsnapshotcontent-cleanup), as
NVIDIA Snapshot's operator does.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.podsnapshot import PodSnapshot, PodSnapshotReason, content_name
from dynamo_snapshot.api.views import Meta, PodSnapshotContentView, PodSnapshotView, PodView
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.kube import (
    NORMAL,
    WARNING,
    Obj,
    Result,
    is_already_exists,
    is_not_found,
)
from dynamo_snapshot.kube.finalizers import add_finalizer, remove_finalizer
from dynamo_snapshot.kube.kinds import POD, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT

log = logging.getLogger(__name__)

PENDING_MESSAGE = "Waiting for node agent to capture the checkpoint"
UNSCHEDULED_MESSAGE = "Waiting for the source pod to be scheduled"
# How soon an unscheduled source pod, and a content being deleted, are looked at again.
RECHECK_S = 1.0


class PodSnapshotReconciler:
    def __init__(self, ctx: Context) -> None:
        self.kube = ctx.kube
        self.snapshots = ctx.snapshots
        self.contents = ctx.contents
        self.recorder = ctx.recorder
        self.pickup_timeout_s = ctx.settings.snapshot_pickup_timeout_seconds

    async def reconcile(self, key: str) -> Result | None:
        obj = self.snapshots.get(key)
        if obj is None:
            return None
        if Meta(obj).deleting:
            return await self._finalize(obj)
        await self._hold(obj)
        if cond.is_true(obj, cond.FAILED):
            return None  # terminal: a new PodSnapshot is a new capture
        try:
            snapshot = PodSnapshot.model_validate(obj)
        except ValidationError as e:
            return await self._fail(obj, PodSnapshotReason.INVALID_SPEC, validation_message(e))
        content = self.contents.get(content_name(Meta(obj).uid))
        if content is None:
            return await self._bind(obj, snapshot)
        return await self._mirror(obj, content)

    # ------------------------------------------------------------------ binding
    async def _bind(self, obj: Obj, snapshot: PodSnapshot) -> Result | None:
        meta = Meta(obj)
        ref = snapshot.spec.source.pod_ref
        try:
            pod = PodView(await self.kube.get(POD, ref.name, meta.namespace))
        except Exception as e:
            if not is_not_found(e):
                raise
            return await self._fail(
                obj, PodSnapshotReason.SOURCE_POD_NOT_FOUND, f"source pod {ref.name!r} does not exist"
            )
        if ref.uid and pod.meta.uid != ref.uid:
            return await self._fail(
                obj,
                PodSnapshotReason.STALE_POD_REFERENCE,
                f"source pod {ref.name!r} has UID {pod.meta.uid}, not {ref.uid}: it was replaced",
            )
        names = pod.container_names
        missing = [c for c in ref.containers if c not in names]
        if missing:
            has = ", ".join(names)
            return await self._fail(
                obj,
                PodSnapshotReason.INVALID_TARGET_CONTAINER,
                f"source pod {ref.name!r} has no container {missing[0]!r} (it has {has})",
            )
        node = pod.node_name
        if not node:
            await self._write(obj, _pending(obj, UNSCHEDULED_MESSAGE))
            return Result(requeue_after=RECHECK_S)
        content = _content(obj, pod, list(ref.containers), node)
        bound = Meta(content).name
        try:
            await self.kube.create(POD_SNAPSHOT_CONTENT, content)
        except Exception as e:
            if not is_already_exists(e):
                raise
            existing = await self.kube.get(POD_SNAPSHOT_CONTENT, bound)
            if PodSnapshotContentView(existing).snapshot_ref.get("uid") != meta.uid:
                return await self._fail(
                    obj,
                    PodSnapshotReason.CONTENT_CONFLICT,
                    f"PodSnapshotContent {bound} is bound to another PodSnapshot",
                )
        else:
            self.recorder.record(
                obj,
                NORMAL,
                "ContentBound",
                f"{bound} on node {node} captures {ref.name}",
            )
        status = _pending(obj, PENDING_MESSAGE)
        status["boundSnapshotContentName"] = bound
        await self._write(obj, status)
        return None

    # ------------------------------------------------------------------ mirroring
    async def _mirror(self, obj: Obj, content: Obj) -> Result | None:
        """The PodSnapshot says what its content says: Ready, Failed (terminal), or still pending."""
        view = PodSnapshotView(obj)
        status = dict(view.status)
        bound = PodSnapshotContentView(content)
        status["boundSnapshotContentName"] = bound.meta.name
        generation = view.meta.generation
        ready, failed = bound.condition(cond.READY), bound.condition(cond.FAILED)
        if bound.condition_true(cond.FAILED):
            reason, message = failed.get("reason") or "CheckpointFailed", failed.get("message") or ""
            return await self._fail(obj, reason, message, base=status)
        conditions = view.conditions
        if bound.condition_true(cond.READY):
            reason, message = ready.get("reason") or "Captured", ready.get("message") or ""
            conditions = cond.set_outcome(conditions, True, reason, message, generation)
            if not view.condition_true(cond.READY):
                self.recorder.record(obj, NORMAL, "SnapshotReady", message or "captured")
        elif ready:  # the node agent took it up
            reason, message = (
                ready.get("reason") or PodSnapshotReason.CAPTURE_IN_PROGRESS,
                ready.get("message") or "",
            )
            conditions = cond.set_condition(conditions, cond.READY, False, reason, message, generation)
        else:
            waited = _age_s(content)
            if waited >= self.pickup_timeout_s:
                node = bound.source_node
                return await self._fail(
                    obj,
                    PodSnapshotReason.NO_NODE_AGENT,
                    f"no node agent on node {node} took the capture up within {self.pickup_timeout_s:g}s: "
                    "is the snapshot agent running there?",
                    base=status,
                )
            conditions = cond.set_condition(
                conditions, cond.READY, False, PodSnapshotReason.PENDING, PENDING_MESSAGE, generation
            )
            status["conditions"] = conditions
            await self._write(obj, status)
            return Result(requeue_after=self.pickup_timeout_s - waited)
        status["conditions"] = conditions
        await self._write(obj, status)
        return None

    # ------------------------------------------------------------------ writes
    async def _hold(self, obj: Obj) -> None:
        await add_finalizer(self.kube, POD_SNAPSHOT, obj, protocol.FINALIZER_CONTENT_CLEANUP)

    async def _fail(
        self, obj: Obj, reason: str, message: str, *, base: dict[str, Any] | None = None
    ) -> Result | None:
        view = PodSnapshotView(obj)
        status = dict(base if base is not None else view.status)
        status["conditions"] = cond.set_outcome(
            list(status.get("conditions") or []), False, reason, message, view.meta.generation
        )
        if not cond.is_true(obj, cond.FAILED):
            self.recorder.record(obj, WARNING, reason, message)
        await self._write(obj, status)
        return None

    async def _write(self, obj: Obj, status: dict[str, Any]) -> None:
        view = PodSnapshotView(obj)
        if status == view.status:
            return
        # Only this reconcile writes a PodSnapshot's status, one at a time per object (the work queue).
        await self.kube.patch_status(POD_SNAPSHOT, view.meta.name, status, view.meta.namespace)

    async def _finalize(self, obj: Obj) -> Result | None:
        view = PodSnapshotView(obj)
        if protocol.FINALIZER_CONTENT_CLEANUP not in view.meta.finalizers:
            return None
        name = view.bound_content or content_name(view.meta.uid)
        try:
            await self.kube.get(POD_SNAPSHOT_CONTENT, name)
        except Exception as e:
            if not is_not_found(e):
                raise
        else:
            try:
                await self.kube.delete(POD_SNAPSHOT_CONTENT, name)
            except Exception as e:
                if not is_not_found(e):
                    raise
            return Result(requeue_after=RECHECK_S)  # released once the content is gone
        await remove_finalizer(self.kube, POD_SNAPSHOT, obj, protocol.FINALIZER_CONTENT_CLEANUP)
        return None


def _content(obj: Obj, pod: PodView, containers: list[str], node: str) -> Obj:
    meta = Meta(obj)
    return {
        "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
        "kind": "PodSnapshotContent",
        "metadata": {
            "name": content_name(meta.uid),
            "labels": {protocol.LABEL_SNAPSHOT_NODE: node},
        },
        "spec": {
            "snapshotRef": {"namespace": meta.namespace, "name": meta.name, "uid": meta.uid},
            "source": {
                "nodeName": node,
                "podRef": {
                    "name": pod.meta.name,
                    "uid": pod.meta.uid,
                    "containers": containers,
                },
            },
        },
    }


def _age_s(obj: Obj) -> float:
    created = Meta(obj).creation_timestamp
    if not created:
        return 0.0
    return (datetime.now(UTC) - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds()


def _pending(obj: Obj, message: str) -> dict[str, Any]:
    view = PodSnapshotView(obj)
    status = dict(view.status)
    status["conditions"] = cond.set_condition(
        view.conditions, cond.READY, False, PodSnapshotReason.PENDING, message, view.meta.generation
    )
    return status
