"""What the agent says on a pod: its checkpoint or restore status and message (per container, as the
controller reads them), Warning Events for refusals and failures, and a worker's exit; retried where a
dispatch of the pod anew must not stand in for the report."""

from __future__ import annotations

import asyncio
import json
import logging

from dynamo_snapshot.agent.pod_spec import MAIN, workload_key
from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import POD, WARNING, ApiError, EventRecorder, Kube, Obj, ObjectRef, is_not_found

log = logging.getLogger(__name__)

__all__ = ["RETRY_BASE_S", "RETRY_CAP_S", "PodReporter", "backoff"]

RETRY_BASE_S, RETRY_CAP_S = 1.0, 60.0
Status = protocol.SnapshotStatus
# Answers in 4xx that a retry can change: credentials since refreshed (401), a timeout (408), a
# conflict (409), throttling (429).
_RETRYABLE_4XX = frozenset({401, 408, 409, 429})


def backoff(attempt: int) -> float:
    return min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** (attempt - 1))


def _permanent(err: ApiError) -> bool:
    """Whether no retry can change the apiserver's answer: the agent may not write the pod (403), the
    pod is gone (404), the patch is invalid (422), say. 5xx, throttling and connection errors pass."""
    return 400 <= err.status < 500 and err.status not in _RETRYABLE_4XX


class PodReporter:
    def __init__(self, kube: Kube, recorder: EventRecorder) -> None:
        self.kube = kube
        self.recorder = recorder

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
            protocol.per_container(status_key, MAIN): state.value,
            protocol.per_container(message_key, MAIN): message[:4000],
            **(extra or {}),
        }
        if until_written:
            if not await self.annotate_until_written(pod, ann, f"{status_key} {state.value}"):
                return
        else:
            await self.annotate(pod, ann)
        log.info("reported", extra={"pod": workload_key(pod), "status": state.value, "detail": message})

    async def report_checkpointed(
        self, pod: Obj, location: str, digest: str, timings: dict[str, float], message: str
    ) -> None:
        # Retried here, never raised: the outcome is in hand, where a dispatch anew would find the
        # checkpoint still running and have to read it back from the store.
        await self.report(
            pod,
            protocol.ANNOTATION_CHECKPOINT_STATUS,
            protocol.ANNOTATION_CHECKPOINT_MESSAGE,
            Status.COMPLETED,
            message,
            extra={
                protocol.ANNOTATION_CHECKPOINT_LOCATION: location,
                protocol.ANNOTATION_CHECKPOINT_STORAGE_TYPE: "pvc",
                protocol.ANNOTATION_CHECKPOINT_TIMINGS: json.dumps(timings),
                protocol.ANNOTATION_ARTIFACT_DIGEST: digest,
            },
            until_written=True,
        )

    async def report_exit(self, pod: Obj, message: str) -> None:
        """Say on the pod that its worker is gone. Never raises: an error that reached the pod's handler
        would dispatch the pod again, and with no exit on the pod yet a launched worker would be launched
        anew and a restored one reported with the wrong cause."""
        log.warning("worker gone", extra={"pod": workload_key(pod), "detail": message})
        key = protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, MAIN)
        await self.annotate_until_written(pod, {key: message}, "workload exit")

    async def refuse(self, pod: Obj, reason: str, status_key: str, message: str) -> None:
        """Say on the pod, as its status and as an Event, why the agent will not act on it."""
        await self.fail(pod, reason, status_key, f"refused: {message}")

    async def fail(self, pod: Obj, reason: str, status_key: str, message: str) -> None:
        """Say on the pod, as its status and as a Warning Event, why its checkpoint or restore failed."""
        meta = pod["metadata"]
        self.recorder.record(
            ObjectRef("Pod", meta["name"], meta["namespace"], meta.get("uid", ""), "v1"),
            WARNING,
            reason,
            message,
        )
        message_key = (
            protocol.ANNOTATION_CHECKPOINT_MESSAGE
            if status_key == protocol.ANNOTATION_CHECKPOINT_STATUS
            else protocol.ANNOTATION_RESTORE_MESSAGE
        )
        await self.report(pod, status_key, message_key, Status.FAILED, message)

    async def annotate_until_written(self, pod: Obj, ann: dict[str, str], what: str) -> bool:
        """Write `ann` on the pod, retrying transient errors with backoff; True once written. Never
        raises, for reports that a dispatch of the pod anew must not stand in for. An answer no retry
        changes (_permanent; a 404 for a pod deleted meanwhile among them) is logged and gives up: False.
        A deleted pod's task is cancelled besides."""
        attempt = 0
        while True:
            try:
                await self._patch(pod, ann)
                return True
            except Exception as e:
                if isinstance(e, ApiError) and _permanent(e):
                    log.log(
                        logging.WARNING if is_not_found(e) else logging.ERROR,
                        "giving up on the pod's annotations: the apiserver refused them for good",
                        extra={
                            "pod": workload_key(pod),
                            "what": what,
                            "attempt": attempt + 1,
                            "http_status": e.status,
                            "reason": e.reason,
                            "detail": e.message,
                        },
                    )
                    return False
                attempt += 1
                delay = backoff(attempt)
                log.exception(
                    "writing the pod's annotations failed; retrying",
                    extra={"pod": workload_key(pod), "what": what, "attempt": attempt, "retry_in_s": delay},
                )
                await asyncio.sleep(delay)

    async def annotate(self, pod: Obj, ann: dict[str, str]) -> None:
        """Write `ann` on the pod; a pod gone already is no error."""
        try:
            await self._patch(pod, ann)
        except Exception as e:
            if not is_not_found(e):
                raise

    async def _patch(self, pod: Obj, ann: dict[str, str]) -> None:
        await self.kube.merge_patch(
            POD, pod["metadata"]["name"], {"metadata": {"annotations": ann}}, pod["metadata"]["namespace"]
        )
