"""What the agent says on a pod: its restore status and message (per container, as the controller reads
them), a restore's outcome as the pod condition nvidia.com/Restored (which a pod may gate its readiness
on), Warning Events for refusals and failures, a Normal Event for a restore done, and a worker's exit;
retried where a dispatch of the pod anew must not stand in for the report. A capture's outcome is said on
its PodSnapshotContent (agent.snapshot_capture)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from dynamo_snapshot.agent.errors import backoff
from dynamo_snapshot.agent.pod_spec import Destination, annotation, per_target, status, workload_key
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

__all__ = ["PodReporter", "combined_outcome", "restored_container_ids"]

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


def combined_outcome(ended: Sequence[tuple[str, Restored, str]]) -> tuple[Restored, str]:
    """The pod's Restored reason and message over its destinations' ``(container, reason, message)``:
    RestoreSucceeded where every one was restored, RestorePartiallySucceeded where some were (the others
    named first), else RestoreFailed (RestoreIncompatible where every one was refused as such)."""
    failed = [e for e in ended if e[1] is not Restored.SUCCEEDED]
    said = "; ".join(
        f"{name}: {message}" for name, _, message in [*failed, *(e for e in ended if e not in failed)]
    )
    if not failed:
        return Restored.SUCCEEDED, f"restored into {len(ended)} containers: {said}"
    if len(failed) < len(ended):
        restored = len(ended) - len(failed)
        return Restored.PARTIALLY_SUCCEEDED, f"{restored} of {len(ended)} containers restored: {said}"
    if all(reason is Restored.INCOMPATIBLE for _, reason, _ in failed):
        return Restored.INCOMPATIBLE, said
    return Restored.FAILED, f"no container restored: {said}"


class PodReporter:
    def __init__(self, kube: Kube, recorder: EventRecorder, field_manager: str) -> None:
        self.kube = kube
        self.recorder = recorder
        # The manager of the pods' nvidia.com/Restored condition (server-side apply owns it by manager).
        self.field_manager = field_manager
        # Pod UID -> (status, lastTransitionTime) of the Restored condition this agent wrote last, for
        # writes that follow it before the pod's watch shows it; dropped with an outcome or the pod.
        self._restored: dict[str, tuple[str, str]] = {}
        # Pod UID -> container -> (reason, message): how the restores into a pod's shared destinations
        # ended, until ``conclude`` says the pod's condition over all of them.
        self._ended: dict[str, dict[str, tuple[Restored, str]]] = {}

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
        dest: Destination | None = None,
    ) -> None:
        container = dest.annotated if dest is not None else None
        ann: dict[str, str] = {
            per_target(pod, status_key, container): state.value,
            per_target(pod, message_key, container): message[:_MESSAGE_MAX],
            **(extra or {}),
        }
        if until_written:
            if not await self.annotate_until_written(pod, ann, f"{status_key} {state.value}"):
                return
        else:
            await self.annotate(pod, ann)
        log.info(
            "reported",
            extra={
                "pod": workload_key(pod),
                "container": container,
                "status": state.value,
                "detail": message,
            },
        )

    async def report_restored(
        self, pod: Obj, message: str, extra: dict[str, str], dest: Destination | None = None
    ) -> None:
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
            dest=dest,
        )
        await self._outcome(pod, Restored.SUCCEEDED, message, dest)
        self._event(pod, NORMAL, Restored.SUCCEEDED.value, _of(dest, message))

    async def report_restore_failed(self, pod: Obj, message: str, dest: Destination | None = None) -> None:
        """A restore that ended without an Event of its own (cut short too often): the failed status and
        Restored False (RestoreFailed), both with ``message``."""
        keys = (protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE)
        await self.report(pod, *keys, Status.FAILED, message, dest=dest)
        await self._outcome(pod, Restored.FAILED, message, dest)

    async def _outcome(
        self, pod: Obj, reason: protocol.RestoredReason, message: str, dest: Destination | None
    ) -> None:
        """How a restore ended: the pod's Restored condition, or, for one of several destinations, kept
        until ``conclude``."""
        if dest is not None and dest.shared:
            self._ended.setdefault(Meta(pod).uid, {})[dest.container] = (reason, message)
            return
        await self.set_restored(pod, reason, message, until_written=True)

    async def conclude(self, pod: Obj, dests: Sequence[Destination], restored_ids: Mapping[str, str]) -> None:
        """The pod's Restored condition over its shared destinations, once the restore into each has
        ended (``combined_outcome``; one that ended before this dispatch as its status annotation says),
        and restored-container-ids with the containers restored into (``restored_ids``) added. Nothing
        where none ended in this dispatch: the condition says it already."""
        ended = self._ended.pop(Meta(pod).uid, {})
        if not ended:
            return
        outcomes: list[tuple[str, Restored, str]] = []
        ids = dict(restored_ids)
        earlier = _restored_ids(pod)
        for dest in dests:
            found = ended.get(dest.container)
            if found is None:
                done = status(pod, protocol.ANNOTATION_RESTORE_STATUS, dest.container) is Status.COMPLETED
                said = annotation(pod, protocol.ANNOTATION_RESTORE_MESSAGE, dest.container) or "no outcome"
                found = (Restored.SUCCEEDED if done else Restored.FAILED, said)
                if done and dest.container in earlier:
                    ids[dest.container] = earlier[dest.container]
            outcomes.append((dest.container, *found))
        if restored_ids:
            key = protocol.ANNOTATION_RESTORED_CONTAINER_IDS
            await self.annotate_until_written(pod, {key: json.dumps(ids, sort_keys=True)}, key)
        reason, message = combined_outcome(outcomes)
        await self.set_restored(pod, reason, message, until_written=True)
        if reason is Restored.SUCCEEDED:
            self._event(pod, NORMAL, reason.value, message)
        elif reason is Restored.PARTIALLY_SUCCEEDED:
            self._event(pod, WARNING, reason.value, message)

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
        if written and reason in (Restored.IN_PROGRESS, Restored.REPLENISHING):
            self._restored[uid] = (status, since)
        else:
            self._restored.pop(uid, None)
        if written:
            log.info("restored condition", extra={"pod": workload_key(pod), "reason": reason.value})
        return written

    def forget(self, uid: str) -> None:
        """The pod is gone: nothing more is written on it."""
        self._restored.pop(uid, None)
        self._ended.pop(uid, None)

    def _transition_time(self, pod: Obj, status: str) -> str:
        written = self._restored.get(Meta(pod).uid)
        if written is None:
            cond = ObjectView(pod).condition(protocol.POD_CONDITION_RESTORED)
            written = (cond.get("status", ""), cond.get("lastTransitionTime", "")) if cond else None
        if written is not None and written[0] == status and written[1]:
            return written[1]
        return _now()

    async def report_exit(self, pod: Obj, message: str, dest: Destination | None = None) -> None:
        """Say on the pod that its worker (the one in ``dest``) is gone. Never raises: an error that
        reached the pod's handler would dispatch the pod again, and with no exit on the pod yet a
        launched worker would be launched anew and a restored one reported with the wrong cause."""
        container = dest.annotated if dest is not None else None
        log.warning(
            "worker gone", extra={"pod": workload_key(pod), "container": container, "detail": message}
        )
        key = per_target(pod, protocol.ANNOTATION_WORKLOAD_EXITED, container)
        await self.annotate_until_written(pod, {key: message}, "workload exit")

    async def clear_exit(self, pod: Obj, dest: Destination) -> None:
        """The worker restored into ``dest`` is gone and a restore into its replacement begins: its exit
        is no longer what the container says."""
        key = per_target(pod, protocol.ANNOTATION_WORKLOAD_EXITED, dest.annotated)
        if key in Meta(pod).annotations:
            await self.annotate_until_written(pod, {key: None}, "workload exit cleared")

    def restored_id(self, pod: Obj, dest: Destination) -> str | None:
        """The container id restored-container-ids records for ``dest`` (None: none)."""
        return _restored_ids(pod).get(dest.container)

    async def refuse(self, pod: Obj, message: str, dest: Destination | None = None) -> None:
        """Say on the pod, as its restore status and as an Event, why the agent will not restore it."""
        await self.fail(pod, f"refused: {message}", reason="RestoreRefused", dest=dest)

    async def incompatible(self, pod: Obj, message: str, dest: Destination | None = None) -> None:
        """``fail``, as Restored False (RestoreIncompatible): this node or container cannot run the
        checkpoint, and nothing was read or started."""
        await self.fail(
            pod, message, reason=Restored.INCOMPATIBLE.value, condition=Restored.INCOMPATIBLE, dest=dest
        )

    async def fail(
        self,
        pod: Obj,
        message: str,
        *,
        reason: str = Restored.FAILED.value,
        condition: protocol.RestoredReason = Restored.FAILED,
        dest: Destination | None = None,
    ) -> None:
        """Say on the pod why its restore (into ``dest``) failed: the failed status, a Warning Event
        (``reason``) and Restored False (``condition``), all with ``message``. A failed status is never
        acted on again, so that condition is retried until written."""
        self._event(pod, WARNING, reason, _of(dest, message))
        keys = (protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE)
        await self.report(pod, *keys, Status.FAILED, message, dest=dest)
        await self._outcome(pod, condition, message, dest)

    def event(self, pod: Obj, reason: str, message: str) -> None:
        """A Normal Event on the pod."""
        self._event(pod, NORMAL, reason, message)

    def _event(self, pod: Obj, kind: str, reason: str, message: str) -> None:
        meta = Meta(pod)
        ref = ObjectRef("Pod", meta.name, meta.namespace, meta.uid, "v1")
        self.recorder.record(ref, kind, reason, message)

    async def annotate_until_written(self, pod: Obj, ann: Mapping[str, str | None], what: str) -> bool:
        """Write `ann` on the pod (None removes a key), retrying transient errors with backoff; True once
        written. Never raises, for reports that a dispatch of the pod anew must not stand in for. An
        answer no retry
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

    async def annotate(self, pod: Obj, ann: Mapping[str, str | None]) -> None:
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

    async def _patch(self, pod: Obj, ann: Mapping[str, str | None]) -> None:
        meta = Meta(pod)
        await self.kube.merge_patch(POD, meta.name, {"metadata": {"annotations": ann}}, meta.namespace)


def _of(dest: Destination | None, message: str) -> str:
    """An Event's message about the restore into ``dest``: which container, where several take it."""
    return f"container {dest.container}: {message}" if dest is not None and dest.shared else message


def _restored_ids(pod: Obj) -> dict[str, str]:
    """restored-container-ids as the pod has it (the agent's own writing; anything else read as none)."""
    try:
        found = json.loads(Meta(pod).annotations.get(protocol.ANNOTATION_RESTORED_CONTAINER_IDS) or "{}")
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {str(k): str(v) for k, v in found.items()}
