"""The agent's Kubernetes side: watch only pods bound to this node, run one task per pod, and report in
the pod's annotations (per container, as the controller reads them).

On a kubelet node (the default) the kubelet runs every container: the agent checkpoints the container the
pod's status names, and restores into the restore pod's own main container once it waits in standby.
In local mode (no kubelet on the node, e.g. kwok nodes in the demo and tests) the agent also starts the
pod's main container itself through its runtime, and stops it when the pod goes away. A worker the agent
started or restored is watched while its pod exists: when it dies, the pod is annotated so the controller
replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

from dynamo_snapshot.agent.authorize import (
    Refused,
    checkpoint_grant,
    checkpoint_name_to_restore,
    restore_grant,
)
from dynamo_snapshot.agent.executor import AgentError, Executor
from dynamo_snapshot.agent.pod_container import RunningContainer, ended, running_container
from dynamo_snapshot.agent.runtime.base import (
    Runtime,
    Workload,
    WorkloadRuntimeError,
    WorkloadSpec,
    wait_exit,
)
from dynamo_snapshot.agent.runtime.containerd import ContainerdRuntime
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import ArtifactStore, artifact_key, validate_artifact_key
from dynamo_snapshot.artifact.store import is_bound_key
from dynamo_snapshot.kube import (
    DELETED,
    POD,
    WARNING,
    ApiError,
    EventRecorder,
    Informer,
    Kube,
    Obj,
    ObjectRef,
    ResourceKind,
    controller_ref,
    is_not_found,
    object_key,
)
from dynamo_snapshot.kube.kinds import CHECKPOINT, JOB

log = logging.getLogger(__name__)
MAIN = "main"
AGENT_NAME = "dynamo-snapshot-agent"
RETRY_BASE_S, RETRY_CAP_S = 1.0, 60.0
# How often an artifact whose checkpoint is gone is tried again while a restore on this node reads it,
# and how often the store is swept for artifacts of checkpoints deleted while no agent watched.
REMOVE_RETRY_S, SWEEP_EVERY_S = 5.0, 600.0
S = protocol.SnapshotStatus
# Answers in 4xx that a retry can change: credentials since refreshed (401), a timeout (408), a
# conflict (409), throttling (429).
_RETRYABLE_4XX = frozenset({401, 408, 409, 429})


@dataclass
class AgentSettings:
    node_name: str
    launch_workloads: bool = True  # local mode: no kubelet here, the agent starts pods' main containers
    ready_timeout: float = 3600.0
    # Kubelet node: how long a pod's main container may take to start (image pulls), and a restore
    # container to say it waits in standby.
    container_start_timeout: float = 600.0
    standby_timeout: float = 120.0


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


def _attempts(pod: Obj) -> int:
    """Restores into the pod started so far (by any agent process)."""
    raw = (pod["metadata"].get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_ATTEMPTS)
    if raw is None:
        return 0
    try:
        return max(0, int(raw))
    except ValueError:
        # An unreadable count is taken as used up rather than as a fresh start.
        return protocol.RESTORE_ATTEMPTS_MAX


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
        # The kubelet's containers, where it runs them (no local launching).
        self.containers = (
            runtime if isinstance(runtime, ContainerdRuntime) and not settings.launch_workloads else None
        )
        self.pods = Informer(kube, POD, field_selector=f"spec.nodeName={settings.node_name}")
        # Every namespace's checkpoints: an artifact is removed once its checkpoint is gone.
        self.checkpoints = Informer(kube, CHECKPOINT)
        self.recorder = EventRecorder(kube, AGENT_NAME)
        self._removing: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Pods whose restore this process marked running: a retry after an unexpected error resumes
        # them, where a "running" left by an earlier agent process means that process died mid-restore.
        self._restoring: set[str] = set()
        self.pods.add_handler(self._on_pod)
        self.checkpoints.add_handler(self._on_checkpoint)

    async def run_until(self, stop: asyncio.Event) -> None:
        self.pods.start()
        self.checkpoints.start()
        sweeping = asyncio.create_task(self._sweep_forever(), name="artifact-sweep")
        try:
            await stop.wait()
        finally:
            sweeping.cancel()
            await self.pods.stop()
            await self.checkpoints.stop()
            tasks = [*self._tasks.values(), *self._background, sweeping]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.recorder.close()
            await self.executor.aclose()

    # ------------------------------------------------------------------ artifacts of deleted checkpoints
    async def _on_checkpoint(self, etype: str, ckpt: Obj, old: Obj | None) -> None:
        if etype == DELETED:
            meta = ckpt["metadata"]
            self._remove_soon(artifact_key(meta["namespace"], meta["uid"]))

    async def _sweep_forever(self) -> None:
        """Remove the artifacts whose checkpoint no longer exists: after the first sync (checkpoints
        deleted while no agent ran), then now and then (deletions whose event was missed)."""
        await self.checkpoints.wait_synced()
        while True:
            live = {
                artifact_key(c["metadata"]["namespace"], c["metadata"]["uid"])
                for c in self.checkpoints.list()
            }
            for key in await asyncio.to_thread(self._namespaced_keys):
                if key not in live:
                    self._remove_soon(key)
            await asyncio.sleep(SWEEP_EVERY_S)

    def _stores(self) -> list[ArtifactStore]:
        return [self.executor.store] + ([self.executor.cache.store] if self.executor.cache else [])

    def _namespaced_keys(self) -> set[str]:
        # Keys of the `<namespace>/<uid>` form belong to checkpoint objects; bare hashes are CLI artifacts.
        return {key for store in self._stores() for key in store.list() if is_bound_key(key)}

    def _holds(self, key: str) -> bool:
        return any(store.exists(key) for store in self._stores())

    def _remove_soon(self, key: str) -> None:
        if key in self._removing:
            return
        self._removing.add(key)
        task = asyncio.create_task(self._remove_artifact(key), name=f"remove-{key}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _remove_artifact(self, key: str) -> None:
        """Delete `key`'s artifact from the store and the node cache, waiting while a restore reads it."""
        try:
            validate_artifact_key(key)
            if not await asyncio.to_thread(self._holds, key):
                return  # most deleted checkpoints left nothing in this node's store
            # Nothing signals the end of a restore that reads it: look again now and then.
            while not await self.executor.delete_artifact(key):  # noqa: ASYNC110
                await asyncio.sleep(REMOVE_RETRY_S)
            log.info("removed the artifact of a deleted checkpoint", extra={"key": key})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("could not remove the artifact of a deleted checkpoint", extra={"key": key})
        finally:
            self._removing.discard(key)

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
            key = workload_key(pod)
            containers = self.containers if etype == DELETED else None
            if self.settings.launch_workloads or restored:
                # Whatever this agent started or restored goes with its pod (a kubelet stops only the
                # containers it started itself).
                stopping = asyncio.create_task(self.runtime.stop(key))
                self._background.add(stopping)
                stopping.add_done_callback(self._background.discard)
                if containers is not None:
                    stopping.add_done_callback(lambda _: containers.forget(key))
            elif containers is not None:
                containers.forget(key)  # the pod is gone: nothing of its container is needed again
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
            try:
                _spec(pod, workload_key(pod), snapshot=False)
            except AgentError as e:
                # Local mode runs commands, not images: a pod without one (a service relying on its image's
                # entrypoint) is said once and left alone, not retried with a traceback for ever.
                log.warning("pod not launched", extra={"pod": workload_key(pod), "detail": str(e)})
                return
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
        if self.containers is not None:
            running = await self._running_container(pod, self.settings.container_start_timeout)
            return await self.containers.attach(key, running.container_id, image_id=running.image_id)
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
        try:
            grant = checkpoint_grant(pod, *await self._checkpoint_objects(pod))
        except Refused as e:
            await self._refuse(pod, "CheckpointRefused", protocol.ANNOTATION_CHECKPOINT_STATUS, str(e))
            return
        key = artifact_key(grant.binding.namespace, grant.binding.checkpoint_uid)
        if state is S.RUNNING:
            # A checkpoint cut short (an agent that died, or a report of ours that never landed): the
            # store says how it ended. Publishing is the last step, so an artifact bound to this pod is
            # the checkpoint taken, and only its report was lost.
            artifact = await asyncio.to_thread(self.executor.published, key)
            binding = artifact.manifest.binding if artifact is not None else None
            if (
                artifact is not None
                and binding is not None
                and binding.source_pod_uid == pod["metadata"]["uid"]
            ):
                size = sum(f.size for f in artifact.manifest.files)
                timings = artifact.manifest.timings
                await self._report_checkpointed(
                    pod,
                    str(artifact.path),
                    artifact.manifest.digest or "",
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
            outcome = await self.executor.checkpoint(
                workload, grant.identity_hash, grant.identity, binding=grant.binding
            )
        except (AgentError, WorkloadRuntimeError, ValueError) as e:
            await self._fail(pod, "CheckpointFailed", protocol.ANNOTATION_CHECKPOINT_STATUS, str(e))
            return
        await self._report_checkpointed(
            pod,
            outcome.location,
            outcome.manifest_digest,
            outcome.timings.phases,
            f"checkpointed {outcome.artifact_bytes} bytes in {outcome.timings.total():.2f}s",
        )

    async def _running_container(self, pod: Obj, within: float, spent: str | None = None) -> RunningContainer:
        """The pod's main container once the kubelet runs it (read from the watch cache); not ``spent``."""
        deadline = asyncio.get_running_loop().time() + within
        while True:
            latest = self.pods.get(object_key(pod)) or pod
            if latest["metadata"].get("uid") != pod["metadata"].get("uid") or latest["metadata"].get(
                "deletionTimestamp"
            ):
                raise AgentError("the pod is being deleted")
            running = running_container(latest)
            if running is not None and running.container_id != spent:
                return running
            why = ended(latest)
            if why is not None and spent is None:
                raise AgentError(why)
            if asyncio.get_running_loop().time() > deadline:
                raise AgentError(f"container {MAIN} did not start within {within:.0f}s")
            await asyncio.sleep(0.1)

    async def _attach_restore_target(
        self, pod: Obj, containers: ContainerdRuntime, spent: str | None = None
    ) -> Workload:
        """The restore pod's main container (not the ``spent`` one), once its placeholder says it waits in
        standby."""
        key = workload_key(pod)
        running = await self._running_container(pod, self.settings.container_start_timeout, spent)
        workload = await containers.attach(key, running.container_id, image_id=running.image_id)
        env = containers.container_env(key)
        if not any(env.get(name) == "1" for name in protocol.ENV_RESTORE_STANDBYS):
            raise Refused(
                f"container {MAIN} is not in standby: it runs without {protocol.ENV_RESTORE_STANDBY}=1, so "
                "its image's entrypoint may have cold-started the worker (the controller sets it on the "
                "restore pods it makes)"
            )
        deadline = asyncio.get_running_loop().time() + self.settings.standby_timeout
        while not containers.standby(key):
            if asyncio.get_running_loop().time() > deadline:
                raise Refused(
                    f"container {MAIN} is not in standby: no {protocol.FILE_RESTORE_STANDBY} or "
                    f"{protocol.FILE_RESTORE_CONTEXT} in its control dir after "
                    f"{self.settings.standby_timeout:.0f}s (its entrypoint must wait for the restore when "
                    f"{protocol.ENV_RESTORE_STANDBY}=1: dynamo_snapshot.workload.run_standby, or Dynamo's "
                    "maybe_run_restore_standby_mode)"
                )
            if ended(self.pods.get(object_key(pod)) or pod) is not None:
                raise AgentError(f"container {MAIN} exited before the restore")
            await asyncio.sleep(0.05)
        return workload

    async def _checkpoint_objects(self, pod: Obj) -> tuple[Obj | None, Obj | None]:
        """The DynamoCheckpoint a source pod names and the Job that controls the pod, read in the pod's
        namespace (None for either that does not exist)."""
        meta = pod["metadata"]
        name = (meta.get("labels") or {}).get(protocol.LABEL_CHECKPOINT_ID)
        ckpt = await self._get(CHECKPOINT, name, meta["namespace"]) if name else None
        owner = controller_ref(pod)
        job = None
        if owner is not None and owner.get("kind") == "Job" and owner.get("name"):
            job = await self._get(JOB, str(owner["name"]), meta["namespace"])
        return ckpt, job

    async def _get(self, kind: ResourceKind, name: str, namespace: str) -> Obj | None:
        try:
            return await self.kube.get(kind, name, namespace)
        except Exception as e:
            if is_not_found(e):
                return None
            raise

    async def _report_checkpointed(
        self, pod: Obj, location: str, digest: str, timings: dict[str, float], message: str
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
                protocol.ANNOTATION_ARTIFACT_DIGEST: digest,
            },
            until_written=True,
        )

    async def _refuse(self, pod: Obj, reason: str, status_key: str, message: str) -> None:
        """Say on the pod, as its status and as an Event, why the agent will not act on it."""
        await self._fail(pod, reason, status_key, f"refused: {message}")

    async def _fail(self, pod: Obj, reason: str, status_key: str, message: str) -> None:
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
        await self._report(pod, status_key, message_key, S.FAILED, message)

    async def _restore(self, pod: Obj) -> None:
        state = _status(pod, protocol.ANNOTATION_RESTORE_STATUS)
        key = workload_key(pod)
        # A container a restore cut short left processes in: it ends once they are cleared, and the next
        # restore goes into the container the kubelet starts in its place.
        spent: str | None = None
        if self.containers is not None and state in (S.COMPLETED, S.RUNNING):
            # After an agent restart: take the pod's container again, to watch or clear it.
            running = running_container(self.pods.get(object_key(pod)) or pod)
            if running is not None:
                with contextlib.suppress(WorkloadRuntimeError):
                    await self.containers.attach(key, running.container_id, image_id=running.image_id)
                    if self.containers.holds_restored(key):
                        spent = running.container_id
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
        attempts = _attempts(pod)
        if state is S.RUNNING:
            # A restore was cut short: clear what it left, then start it again. One of an earlier agent
            # process (which died mid-restore) is no fault of the checkpoint's, so it is not reported as
            # a failure unless it keeps happening.
            await self.runtime.stop(key)
            if pod["metadata"]["uid"] not in self._restoring and attempts >= protocol.RESTORE_ATTEMPTS_MAX:
                await self._report(
                    pod,
                    protocol.ANNOTATION_RESTORE_STATUS,
                    protocol.ANNOTATION_RESTORE_MESSAGE,
                    S.FAILED,
                    f"the restore was cut short {attempts} times (node agent restarts); "
                    "the partial restore was removed",
                )
                return
        meta = pod["metadata"]
        name = checkpoint_name_to_restore(pod)
        try:
            grant = restore_grant(pod, await self._get(CHECKPOINT, name, meta["namespace"]) if name else None)
        except Refused as e:
            await self._refuse(pod, "RestoreRefused", protocol.ANNOTATION_RESTORE_STATUS, str(e))
            return
        await self._report(
            pod,
            protocol.ANNOTATION_RESTORE_STATUS,
            protocol.ANNOTATION_RESTORE_MESSAGE,
            S.RUNNING,
            "restoring",
            extra={protocol.ANNOTATION_RESTORE_ATTEMPTS: str(attempts + 1)},
        )
        self._restoring.add(meta["uid"])
        image_id: str | None = None
        visible_gpus: tuple[str, ...] | None = None
        restore_env: dict[str, str] = _pod_env(pod)
        if self.containers is not None:
            try:
                target = await self._attach_restore_target(pod, self.containers, spent)
            except Refused as e:
                await self._refuse(pod, "RestoreRefused", protocol.ANNOTATION_RESTORE_STATUS, str(e))
                return
            except (AgentError, WorkloadRuntimeError) as e:
                await self._fail(pod, "RestoreFailed", protocol.ANNOTATION_RESTORE_STATUS, str(e))
                return
            image_id, visible_gpus = target.image_id, target.visible_gpus
            restore_env = self.containers.container_env(key)
        try:
            outcome = await self.executor.restore(
                key,
                grant.artifact_key,
                manifest_digest=grant.manifest_digest,
                identity_info={
                    "podName": meta["name"],
                    "namespace": meta["namespace"],
                    "podIP": (pod.get("status") or {}).get("podIP"),
                    "hostname": meta["name"][:63],
                    "env": {
                        "POD_NAME": meta["name"],
                        "POD_NAMESPACE": meta["namespace"],
                    },
                },
                image_id=image_id,
                visible_gpus=visible_gpus,
                restore_env=restore_env,
            )
        except (AgentError, WorkloadRuntimeError, ValueError) as e:
            with contextlib.suppress(Exception):
                await self.runtime.stop(key)
            await self._fail(pod, "RestoreFailed", protocol.ANNOTATION_RESTORE_STATUS, str(e))
            return
        # Retried here, never raised: _handle would dispatch the pod again, find the restore still
        # running and tear the healthy restored worker down to restore it anew.
        await self._report(
            pod,
            protocol.ANNOTATION_RESTORE_STATUS,
            protocol.ANNOTATION_RESTORE_MESSAGE,
            S.COMPLETED,
            f"restored from {grant.checkpoint_name} in {outcome.timings.total():.2f}s"
            + (" (node cache)" if outcome.source == "cache" else ""),
            extra={
                protocol.ANNOTATION_RESTORE_TIMINGS: json.dumps(outcome.timings.phases),
                protocol.ANNOTATION_RESTORE_CONTAINER_ID: outcome.workload.container_id
                or str(outcome.workload.pid),
            },
            until_written=True,
        )
        await self._supervise(pod, outcome.workload)

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


def _main_container(pod: Obj) -> Obj:
    containers = pod["spec"].get("containers") or []
    main = next((c for c in containers if c.get("name") == MAIN), containers[0] if containers else None)
    if main is None:
        raise AgentError("pod has no containers")
    return dict(main)


def _pod_env(pod: Obj) -> dict[str, str]:
    """The main container's environment as far as the pod spec says it (literal values), with the pod's
    identity: what a worker the agent launches gets, and a restore's env where no kubelet resolved one."""
    main = _main_container(pod)
    env = {e["name"]: str(e.get("value", "")) for e in main.get("env") or [] if "value" in e}
    meta = pod["metadata"]
    env.update(POD_NAME=meta["name"], POD_NAMESPACE=meta["namespace"], POD_UID=meta.get("uid", ""))
    return env


def _spec(pod: Obj, key: str, *, snapshot: bool) -> WorkloadSpec:
    """The pod's main container, to launch. The caller says whether it is a checkpoint source, the only
    launched worker told where its control dir is (a restore target is restored, never launched)."""
    main = _main_container(pod)
    command = [*(main.get("command") or []), *(main.get("args") or [])]
    if not command:
        raise AgentError("local mode needs the main container's command: images are not run here")
    return WorkloadSpec(
        key=key,
        command=[str(c) for c in command],
        env=_pod_env(pod),
        workdir=main.get("workingDir"),
        snapshot=snapshot,
    )
