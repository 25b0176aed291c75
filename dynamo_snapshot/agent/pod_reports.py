"""What the agent says on a pod: its restore status and message (per container, as the controller reads
them), a restore's outcome as the pod condition nvidia.com/Restored (which a pod may gate its readiness
on), Warning Events for refusals and failures, a Normal Event for a restore done, and a worker's exit;
retried where a dispatch of the pod anew must not stand in for the report. A capture's outcome is said on
its PodSnapshotContent (agent.snapshot_capture)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from dynamo_snapshot.agent.errors import backoff
from dynamo_snapshot.agent.pod_spec import per_target, workload_key
from dynamo_snapshot.agent.runtime.base import Workload
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import Meta, ObjectView, PodView
from dynamo_snapshot.kube import (
    NORMAL,
    POD,
    WARNING,
    EventRecorder,
    Kube,
    Obj,
    ObjectRef,
    is_not_found,
)
from dynamo_snapshot.kube.until_written import write_until_done

log = logging.getLogger(__name__)

__all__ = ["PodReporter", "restored_container_ids"]

Status = protocol.SnapshotStatus
Restored = protocol.RestoredReason
_MESSAGE_MAX = 4000


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def restored_container_ids(pod: Obj, workload: Workload) -> dict[str, str]:
    """The restored-container-ids annotation of a restore into ``workload``: the container the agent
    restored into, by name, as the restore-pod contract has consumers find it; none for a restore as a
    process (no container)."""
    if not workload.container_id:
        return {}
    ids = {PodView(pod).main_name: workload.container_id}
    return {protocol.ANNOTATION_RESTORED_CONTAINER_IDS: json.dumps(ids)}


class PodReporter:
    def __init__(self, kube: Kube, recorder: EventRecorder, field_manager: str) -> None:
        self.kube = kube
        self.recorder = recorder
        # The manager of the pods' nvidia.com/Restored condition (server-side apply owns it by manager).
        self.field_manager = field_manager
        # Pod UID -> (status, lastTransitionTime) of the Restored condition this agent wrote last, for
        # writes that follow it before the pod's watch shows it; dropped with an outcome or the pod.
        self._restored: dict[str, tuple[str, str]] = {}

    async def report(
        self,
        pod: Obj,
        status_key: str,
        message_key: str,
        state: Status,
        message: str,
        extra: dict[str, str] | None = None,
        *,
        until_written: bool = False,
    ) -> None:
        ann: dict[str, str] = {
            per_target(pod, status_key): state.value,
            per_target(pod, message_key): message[:_MESSAGE_MAX],
            **(extra or {}),
        }
        if until_written:
            if not await self.annotate_until_written(pod, ann, f"{status_key} {state.value}"):
                return
        else:
            await self.annotate(pod, ann)
        log.info("reported", extra={"pod": workload_key(pod), "status": state.value, "detail": message})

    async def report_restored(self, pod: Obj, message: str, extra: dict[str, str]) -> None:
        """A finished restore: the completed status, Restored True (RestoreSucceeded) and a Normal Event.
        Retried here, never raised: the pod's handler would dispatch the pod again, find the restore
        still running and tear the healthy restored worker down to restore it anew."""
        await self.report(
            pod,
            protocol.ANNOTATION_RESTORE_STATUS,
            protocol.ANNOTATION_RESTORE_MESSAGE,
            Status.COMPLETED,
            message,
            extra=extra,
            until_written=True,
        )
        await self.set_restored(pod, Restored.SUCCEEDED, message, until_written=True)
        self._event(pod, NORMAL, Restored.SUCCEEDED.value, message)

    async def report_restore_failed(self, pod: Obj, message: str) -> None:
        """A restore that ended without an Event of its own (cut short too often): the failed status and
        Restored False (RestoreFailed), both with ``message``."""
        keys = (protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE)
        await self.report(pod, *keys, Status.FAILED, message)
        await self.set_restored(pod, Restored.FAILED, message, until_written=True)

    async def set_restored(
        self, pod: Obj, reason: protocol.RestoredReason, message: str, *, until_written: bool = False
    ) -> bool:
        """Write the pod's nvidia.com/Restored condition: True for RestoreSucceeded, else False. A
        server-side apply to pods/status of this one entry of the conditions (a list keyed by type), so
        the kubelet's conditions stay its own. lastTransitionTime changes only with the status. With
        ``until_written`` retried like annotate_until_written and never raised (for an outcome, which no
        dispatch anew writes again); else a pod gone already is no error and others raise. True once
        written."""
        meta = Meta(pod)
        status = "True" if reason is Restored.SUCCEEDED else "False"
        since = self._transition_time(pod, status)
        condition = {
            "type": protocol.POD_CONDITION_RESTORED,
            "status": status,
            "reason": reason.value,
            "message": message[:_MESSAGE_MAX],
            "lastTransitionTime": since,
        }
        body = {
            "metadata": {"name": meta.name, "namespace": meta.namespace},
            "status": {"conditions": [condition]},
        }

        async def write() -> None:
            # Forced: the agent is the one writer of this condition, whoever set it before (a user, a
            # tool that fills in readiness gates).
            await self.kube.apply(
                POD, body, field_manager=self.field_manager, force=True, subresource="status"
            )

        if until_written:
            written = await self._until_written(pod, write, "Restored condition", reason.value)
        else:
            written = await self._once(write)
        uid = meta.uid
        if written and reason is Restored.IN_PROGRESS:
            self._restored[uid] = (status, since)
        else:
            self._restored.pop(uid, None)
        if written:
            log.info("restored condition", extra={"pod": workload_key(pod), "reason": reason.value})
        return written

    def forget(self, uid: str) -> None:
        """The pod is gone: nothing more is written on it."""
        self._restored.pop(uid, None)

    def _transition_time(self, pod: Obj, status: str) -> str:
        written = self._restored.get(Meta(pod).uid)
        if written is None:
            cond = ObjectView(pod).condition(protocol.POD_CONDITION_RESTORED)
            written = (cond.get("status", ""), cond.get("lastTransitionTime", "")) if cond else None
        if written is not None and written[0] == status and written[1]:
            return written[1]
        return _now()

    async def report_exit(self, pod: Obj, message: str) -> None:
        """Say on the pod that its worker is gone. Never raises: an error that reached the pod's handler
        would dispatch the pod again, and with no exit on the pod yet a launched worker would be launched
        anew and a restored one reported with the wrong cause."""
        log.warning("worker gone", extra={"pod": workload_key(pod), "detail": message})
        key = per_target(pod, protocol.ANNOTATION_WORKLOAD_EXITED)
        await self.annotate_until_written(pod, {key: message}, "workload exit")

    async def refuse(self, pod: Obj, message: str) -> None:
        """Say on the pod, as its restore status and as an Event, why the agent will not restore it."""
        await self.fail(pod, f"refused: {message}", reason="RestoreRefused")

    async def incompatible(self, pod: Obj, message: str) -> None:
        """``fail``, as Restored False (RestoreIncompatible): this node or container cannot run the
        checkpoint, and nothing was read or started."""
        await self.fail(pod, message, reason=Restored.INCOMPATIBLE.value, condition=Restored.INCOMPATIBLE)

    async def fail(
        self,
        pod: Obj,
        message: str,
        *,
        reason: str = Restored.FAILED.value,
        condition: protocol.RestoredReason = Restored.FAILED,
    ) -> None:
        """Say on the pod why its restore failed: the failed status, a Warning Event (``reason``) and
        Restored False (``condition``), all with ``message``. A failed status is never acted on again, so
        that condition is retried until written."""
        self._event(pod, WARNING, reason, message)
        keys = (protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE)
        await self.report(pod, *keys, Status.FAILED, message)
        await self.set_restored(pod, condition, message, until_written=True)

    def event(self, pod: Obj, reason: str, message: str) -> None:
        """A Normal Event on the pod."""
        self._event(pod, NORMAL, reason, message)

    def _event(self, pod: Obj, kind: str, reason: str, message: str) -> None:
        meta = Meta(pod)
        ref = ObjectRef("Pod", meta.name, meta.namespace, meta.uid, "v1")
        self.recorder.record(ref, kind, reason, message)

    async def annotate_until_written(self, pod: Obj, ann: dict[str, str], what: str) -> bool:
        """Write `ann` on the pod, retrying transient errors with backoff; True once written. Never
        raises, for reports that a dispatch of the pod anew must not stand in for. An answer no retry
        changes (``kube.until_written.permanent``; a 404 for a pod deleted meanwhile among them) is
        logged and gives up: False. A deleted pod's task is cancelled besides."""
        return await self._until_written(pod, lambda: self._patch(pod, ann), "annotations", what)

    async def _until_written(
        self, pod: Obj, write: Callable[[], Awaitable[Any]], subject: str, what: str
    ) -> bool:
        return await write_until_done(
            write,
            what=f"the pod's {subject}",
            extra={"pod": workload_key(pod), "what": what},
            backoff=backoff,
        )

    async def annotate(self, pod: Obj, ann: dict[str, str]) -> None:
        """Write `ann` on the pod; a pod gone already is no error."""
        await self._once(lambda: self._patch(pod, ann))

    @staticmethod
    async def _once(write: Callable[[], Awaitable[Any]]) -> bool:
        """One write; False for a pod gone already, other errors raised."""
        try:
            await write()
        except Exception as e:
            if not is_not_found(e):
                raise
            return False
        return True

    async def _patch(self, pod: Obj, ann: dict[str, str]) -> None:
        meta = Meta(pod)
        await self.kube.merge_patch(POD, meta.name, {"metadata": {"annotations": ann}}, meta.namespace)
