"""The agent's Kubernetes side: watch only pods bound to this node, run one task per pod, and report in
the pod's annotations (per container, as the controller reads them).

In local mode (no kubelet on the node, e.g. kwok nodes in the demo and tests) the agent also starts the
pod's main container itself through its runtime, and stops it when the pod goes away. A worker the agent
started or restored is watched while its pod exists: when it dies, the pod is annotated so the controller
replaces it (no kubelet would report the terminated container).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

from dynamo_snapshot.agent.executor import AgentError, Executor
from dynamo_snapshot.agent.runtime.base import (
    Runtime,
    Workload,
    WorkloadRuntimeError,
    WorkloadSpec,
    wait_exit,
)
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.artifact import Artifact, ArtifactError
from dynamo_snapshot.controller.kinds import CHECKPOINT
from dynamo_snapshot.controller.runtime import (
    DELETED,
    POD,
    ApiError,
    Informer,
    Kube,
    Obj,
    is_not_found,
    object_key,
)

log = logging.getLogger(__name__)
MAIN = "main"
RETRY_BASE_S, RETRY_CAP_S = 1.0, 60.0
S = protocol.SnapshotStatus
# Answers in 4xx that a retry can change: credentials since refreshed (401), a timeout (408), a
# conflict (409), throttling (429).
_RETRYABLE_4XX = frozenset({401, 408, 409, 429})


@dataclass
class AgentSettings:
    node_name: str
    launch_workloads: bool = True  # local mode: no kubelet here, the agent starts pods' main containers
    ready_timeout: float = 3600.0


def workload_key(pod: Obj) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"


def _backoff(attempt: int) -> float:
    return min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** (attempt - 1))


def _permanent(err: ApiError) -> bool:
    """Whether no retry can change the apiserver's answer: the agent may not write the pod (403), the
    pod is gone (404), the patch is invalid (422), say. 5xx, throttling and connection errors pass."""
    return 400 <= err.status < 500 and err.status not in _RETRYABLE_4XX


def _annotation(pod: Obj, key: str) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(protocol.per_container(key, MAIN))


def _status(pod: Obj, key: str) -> S | None:
    raw = _annotation(pod, key)
    try:
        return S.parse(raw) if raw else None
    except ValueError:
        return S.FAILED


class NodeAgent:
    def __init__(self, kube: Kube, executor: Executor, runtime: Runtime, settings: AgentSettings) -> None:
        self.kube = kube
        self.executor = executor
        self.runtime = runtime
        self.settings = settings
        self.pods = Informer(kube, POD, field_selector=f"spec.nodeName={settings.node_name}")
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Pods whose restore this process marked running: a retry after an unexpected error resumes
        # them, where a "running" left by an earlier agent process means that process died mid-restore.
        self._restoring: set[str] = set()
        self.pods.add_handler(self._on_pod)

    async def run_until(self, stop: asyncio.Event) -> None:
        self.pods.start()
        try:
            await stop.wait()
        finally:
            await self.pods.stop()
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await self.executor.aclose()

    async def _on_pod(self, etype: str, pod: Obj, old: Obj | None) -> None:
        uid = pod["metadata"]["uid"]
        if pod["spec"].get("nodeName") != self.settings.node_name:
            return  # never touch another node's pod, whatever the watch delivers
        if etype == DELETED or pod["metadata"].get("deletionTimestamp"):
            self._restoring.discard(uid)
            task = self._tasks.pop(uid, None)
            if task is not None:
                task.cancel()
            restored = (pod["metadata"].get("labels") or {}).get(
                protocol.LABEL_RESTORE_TARGET
            ) == protocol.TRUE
            if self.settings.launch_workloads or restored:
                # Whatever this agent started or restored goes with its pod (a kubelet stops only the
                # containers it started itself).
                stopping = asyncio.create_task(self.runtime.stop(workload_key(pod)))
                self._background.add(stopping)
                stopping.add_done_callback(self._background.discard)
            return
        if uid not in self._tasks:
            self._tasks[uid] = asyncio.create_task(self._handle(pod), name=f"pod-{workload_key(pod)}")

    # ------------------------------------------------------------------ per pod
    async def _handle(self, pod: Obj) -> None:
        """Dispatch the pod, retrying with backoff on unexpected errors (a transient apiserver error,
        say): checkpoints and restores report their own failures, anything else would otherwise leave
        the pod unhandled until the agent restarts. Each retry reads the pod afresh and dispatches it
        from the start, so every step up to supervision must be safe to repeat. The reports a repeat
        would get wrong are retried where they are made (_annotate_until_written): a finished restore,
        which a repeat would find still running and restore anew, a worker's exit, which a repeat would
        find gone and not yet reported, and a published checkpoint, which a repeat would find still
        running (it then reads the outcome from the store, as after an agent restart)."""
        attempt = 0
        while True:
            try:
                await self._dispatch(pod)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                attempt += 1
                delay = _backoff(attempt)
                log.exception(
                    "pod handling failed; retrying",
                    extra={"pod": workload_key(pod), "attempt": attempt, "retry_in_s": delay},
                )
                await asyncio.sleep(delay)
                latest = self.pods.get(object_key(pod))
                if (
                    latest is None
                    or latest["metadata"].get("uid") != pod["metadata"].get("uid")
                    or latest["metadata"].get("deletionTimestamp")
                ):
                    return
                pod = latest

    async def _dispatch(self, pod: Obj) -> None:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE:
            await self._restore(pod)
        elif labels.get(protocol.LABEL_CHECKPOINT_SOURCE) == protocol.TRUE:
            await self._checkpoint(pod)
        elif (
            self.settings.launch_workloads
            and labels.get(protocol.LABEL_MANAGED_BY) == protocol.MANAGED_BY_VALUE
            and _annotation(pod, protocol.ANNOTATION_WORKLOAD_EXITED) is None
        ):
            # A worker that died is reported, not restarted: the controller replaces the whole pod.
            await self._supervise(pod, await self._ensure_running(pod, snapshot=False))

    async def _supervise(self, pod: Obj, workload: Workload) -> None:
        """Wait for the worker to die and say so on its pod. Cancelled (before the agent stops the
        worker) when the pod is deleted, so a scale-down is never reported as a failure."""
        await wait_exit(workload.pid)
        await self._report_exit(pod, f"worker process {workload.pid} exited")

    async def _report_exit(self, pod: Obj, message: str) -> None:
        """Say on the pod that its worker is gone. Never raises: an error that reached _handle would
        dispatch the pod again, and with no exit on the pod yet a launched worker would be launched anew
        and a restored one reported with the wrong cause."""
        log.warning("worker gone", extra={"pod": workload_key(pod), "detail": message})
        key = protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, MAIN)
        await self._annotate_until_written(pod, {key: message}, "workload exit")

    async def _ensure_running(self, pod: Obj, *, snapshot: bool) -> Workload:
        key = workload_key(pod)
        found = await self.runtime.find(key)
        if found is not None:
            return found
        if not self.settings.launch_workloads:
            raise AgentError(f"no running container found for {key}")
        return await self.runtime.launch(_spec(pod, key, snapshot=snapshot))

    async def _checkpoint(self, pod: Obj) -> None:
        state = _status(pod, protocol.ANNOTATION_CHECKPOINT_STATUS)
        if state is not None and state.terminal:
            return
        labels = pod["metadata"]["labels"]
        identity_hash = labels.get(protocol.LABEL_CHECKPOINT_HASH, "")
        if state is S.RUNNING:
            # A checkpoint cut short (an agent that died, or a report of ours that never landed): the
            # store says how it ended. Publishing is the last step, so an artifact for this identity is
            # the checkpoint taken, and only its report was lost.
            artifact = await self._published(identity_hash)
            if artifact is not None:
                size = sum(f.size for f in artifact.manifest.files)
                timings = artifact.manifest.timings
                await self._report_checkpointed(
                    pod,
                    str(artifact.path),
                    timings,
                    f"checkpointed {size} bytes in {sum(timings.values()):.2f}s "
                    "(found published when the pod was handled again)",
                )
                return
            # Nothing published: the staging left behind never became an artifact.
            await asyncio.to_thread(self.executor.store.gc_partial)
            await self._report(
                pod,
                protocol.ANNOTATION_CHECKPOINT_STATUS,
                protocol.ANNOTATION_CHECKPOINT_MESSAGE,
                S.FAILED,
                "the checkpoint did not finish (the node agent restarted, or its attempt ended "
                "unexpectedly); nothing was published",
            )
            return
        try:
            workload = await self._ensure_running(pod, snapshot=True)
            await self.executor.wait_ready(workload, within=self.settings.ready_timeout)
            await self._report(
                pod,
                protocol.ANNOTATION_CHECKPOINT_STATUS,
                protocol.ANNOTATION_CHECKPOINT_MESSAGE,
                S.RUNNING,
                "checkpointing",
            )
            outcome = await self.executor.checkpoint(workload, identity_hash, await self._identity(pod))
        except (AgentError, WorkloadRuntimeError, ValueError) as e:
            await self._report(
                pod,
                protocol.ANNOTATION_CHECKPOINT_STATUS,
                protocol.ANNOTATION_CHECKPOINT_MESSAGE,
                S.FAILED,
                str(e),
            )
            return
        await self._report_checkpointed(
            pod,
            outcome.location,
            outcome.timings.phases,
            f"checkpointed {outcome.artifact_bytes} bytes in {outcome.timings.total():.2f}s",
        )

    async def _report_checkpointed(
        self, pod: Obj, location: str, timings: dict[str, float], message: str
    ) -> None:
        # Retried here, never raised: the outcome is in hand, where a dispatch anew would find the
        # checkpoint still running and have to read it back from the store.
        await self._report(
            pod,
            protocol.ANNOTATION_CHECKPOINT_STATUS,
            protocol.ANNOTATION_CHECKPOINT_MESSAGE,
            S.COMPLETED,
            message,
            extra={
                protocol.ANNOTATION_CHECKPOINT_LOCATION: location,
                protocol.ANNOTATION_CHECKPOINT_STORAGE_TYPE: "pvc",
                protocol.ANNOTATION_CHECKPOINT_TIMINGS: json.dumps(timings),
            },
            until_written=True,
        )

    async def _published(self, identity_hash: str) -> Artifact | None:
        """The artifact this node published for `identity_hash`, or None where there is none to use."""

        def find() -> Artifact | None:
            try:
                artifact = self.executor.store.open(identity_hash)
            except (ArtifactError, ValueError):
                # No artifact, an unreadable manifest or a label that is no hash: nothing a restore
                # could use, so the checkpoint did not succeed.
                return None
            # One published from another node (a shared store) says nothing of this pod's checkpoint:
            # its worker may still sit with its CUDA state suspended.
            return artifact if artifact.manifest.source_node == self.settings.node_name else None

        return await asyncio.to_thread(find)

    async def _restore(self, pod: Obj) -> None:
        state = _status(pod, protocol.ANNOTATION_RESTORE_STATUS)
        key = workload_key(pod)
        if state is S.COMPLETED:
            # A restored workload outlives an agent restart: watch it again, or report it gone.
            if _annotation(pod, protocol.ANNOTATION_WORKLOAD_EXITED) is None:
                found = await self.runtime.find(key)
                if found is not None:
                    await self._supervise(pod, found)
                else:
                    await self._report_exit(pod, "restored worker gone while the node agent was down")
            return
        if state is S.FAILED:
            return  # a failed restore was cleaned up when it failed
        if state is S.RUNNING:
            # A restore was cut short: clear what it left. Our own attempt (an unexpected error) is
            # tried again below; one of an earlier agent process, which died mid-restore, has failed.
            await self.runtime.stop(key)
            if pod["metadata"]["uid"] not in self._restoring:
                await self._report(
                    pod,
                    protocol.ANNOTATION_RESTORE_STATUS,
                    protocol.ANNOTATION_RESTORE_MESSAGE,
                    S.FAILED,
                    "node agent restarted during the restore; the partial restore was removed",
                )
                return
        identity_hash = (pod["metadata"].get("labels") or {}).get(protocol.LABEL_CHECKPOINT_HASH, "")
        await self._report(
            pod,
            protocol.ANNOTATION_RESTORE_STATUS,
            protocol.ANNOTATION_RESTORE_MESSAGE,
            S.RUNNING,
            "restoring",
        )
        self._restoring.add(pod["metadata"]["uid"])
        try:
            outcome = await self.executor.restore(
                key,
                identity_hash,
                identity_info={
                    "podName": pod["metadata"]["name"],
                    "namespace": pod["metadata"]["namespace"],
                    "podIP": (pod.get("status") or {}).get("podIP"),
                    "hostname": pod["metadata"]["name"][:63],
                    "env": {
                        "POD_NAME": pod["metadata"]["name"],
                        "POD_NAMESPACE": pod["metadata"]["namespace"],
                    },
                },
            )
        except (AgentError, WorkloadRuntimeError, ValueError) as e:
            with contextlib.suppress(Exception):
                await self.runtime.stop(key)
            await self._report(
                pod, protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE, S.FAILED, str(e)
            )
            return
        # Retried here, never raised: _handle would dispatch the pod again, find the restore still
        # running and tear the healthy restored worker down to restore it anew.
        await self._report(
            pod,
            protocol.ANNOTATION_RESTORE_STATUS,
            protocol.ANNOTATION_RESTORE_MESSAGE,
            S.COMPLETED,
            f"restored in {outcome.timings.total():.2f}s"
            + (" (node cache)" if outcome.source == "cache" else ""),
            extra={
                protocol.ANNOTATION_RESTORE_TIMINGS: json.dumps(outcome.timings.phases),
                protocol.ANNOTATION_RESTORE_CONTAINER_ID: outcome.workload.container_id
                or str(outcome.workload.pid),
            },
            until_written=True,
        )
        await self._supervise(pod, outcome.workload)

    async def _identity(self, pod: Obj) -> CheckpointIdentity | None:
        # The DynamoCheckpoint named by the pod's checkpoint-id label carries the identity; the artifact
        # records it so an artifact on shared storage explains itself.
        name = (pod["metadata"].get("labels") or {}).get(protocol.LABEL_CHECKPOINT_ID)
        if not name:
            return None
        try:
            ckpt = await self.kube.get(CHECKPOINT, name, pod["metadata"]["namespace"])
        except Exception as e:
            if is_not_found(e):
                return None
            raise
        return CheckpointIdentity.model_validate(ckpt["spec"]["identity"])

    async def _report(
        self,
        pod: Obj,
        status_key: str,
        message_key: str,
        state: S,
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
            if not await self._annotate_until_written(pod, ann, f"{status_key} {state.value}"):
                return
        else:
            await self._annotate(pod, ann)
        log.info("reported", extra={"pod": workload_key(pod), "status": state.value, "detail": message})

    async def _annotate_until_written(self, pod: Obj, ann: dict[str, str], what: str) -> bool:
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
                delay = _backoff(attempt)
                log.exception(
                    "writing the pod's annotations failed; retrying",
                    extra={"pod": workload_key(pod), "what": what, "attempt": attempt, "retry_in_s": delay},
                )
                await asyncio.sleep(delay)

    async def _annotate(self, pod: Obj, ann: dict[str, str]) -> None:
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


def _spec(pod: Obj, key: str, *, snapshot: bool) -> WorkloadSpec:
    """The pod's main container, to launch. The caller says whether it is a checkpoint source, the only
    launched worker told where its control dir is (a restore target is restored, never launched)."""
    containers = pod["spec"].get("containers") or []
    main = next((c for c in containers if c.get("name") == MAIN), containers[0] if containers else None)
    if main is None:
        raise AgentError("pod has no containers")
    command = [*(main.get("command") or []), *(main.get("args") or [])]
    if not command:
        raise AgentError("local mode needs the main container's command: images are not run here")
    env = {e["name"]: str(e.get("value", "")) for e in main.get("env") or [] if "value" in e}
    env.update(POD_NAME=pod["metadata"]["name"], POD_NAMESPACE=pod["metadata"]["namespace"])
    return WorkloadSpec(
        key=key,
        command=[str(c) for c in command],
        env=env,
        workdir=main.get("workingDir"),
        snapshot=snapshot,
    )
