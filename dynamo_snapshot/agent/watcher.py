"""The agent's Kubernetes side: watch only pods bound to this node, run one task per pod, and report a
restore in the pod's annotations (per container, as the controller reads them) and its nvidia.com/Restored
condition; capture the PodSnapshotContents of this node (agent.snapshot_capture, the one capture path).

On a kubelet node (the default) the kubelet runs every container: a capture takes the container the pod's
status names, and a restore goes into the restore pod's own main container once it waits in standby.
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
import time
from dataclasses import dataclass

from dynamo_snapshot.agent.artifact_sweeper import ArtifactSweeper
from dynamo_snapshot.agent.authorize import (
    Refused,
    RestoreGrant,
    asks_to_be_restored,
    capture_checkpoint_name,
    name_to_restore,
    restore_grant,
    snapshot_to_restore,
)
from dynamo_snapshot.agent.errors import AgentError, Incompatible, backoff
from dynamo_snapshot.agent.executor import Executor, RestoreOutcome
from dynamo_snapshot.agent.kubelet_containers import KubeletContainers
from dynamo_snapshot.agent.metrics import PHASE_SECONDS
from dynamo_snapshot.agent.pod_container import running_container
from dynamo_snapshot.agent.pod_reports import PodReporter, restored_container_ids
from dynamo_snapshot.agent.pod_spec import (
    MAIN,
    annotation,
    declares_control_dir,
    pod_env,
    restore_attempts,
    status,
    workload_key,
    workload_spec,
)
from dynamo_snapshot.agent.runtime.base import Runtime, Workload, WorkloadRuntimeError, wait_exit
from dynamo_snapshot.agent.runtime.containerd import ContainerdRuntime
from dynamo_snapshot.agent.sentinels import write_sentinel
from dynamo_snapshot.agent.snapshot_capture import SnapshotCapture
from dynamo_snapshot.agent.timings import AWAIT_CONTAINER_PHASE
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.restore_outcome import REOPENED_MESSAGE, skip_compat_check
from dynamo_snapshot.api.views import Meta, PodSnapshotView, PodView, still_live
from dynamo_snapshot.kube import (
    DELETED,
    POD,
    EventRecorder,
    Informer,
    Kube,
    Obj,
    object_key,
)
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from dynamo_snapshot.kube.until_written import get_or_none

__all__ = ["AGENT_NAME", "MAIN", "NodeAgent", "workload_key"]

log = logging.getLogger(__name__)
AGENT_NAME = "dynamo-snapshot-agent"
Status = protocol.SnapshotStatus


@dataclass(frozen=True)
class _RestoreTarget:
    """What the restore container tells the restore: its image, its GPUs, its environment."""

    image_id: str | None
    visible_gpus: tuple[str, ...] | None
    env: dict[str, str]


def reopens_refused_restore(pod: Obj) -> bool:
    """A restore refused as incompatible whose pod has since asked to skip the compatibility checks: it
    is attempted again in place (the refusal came before anything was read or started). Any other
    failed restore needs a new pod."""
    view = PodView(pod)
    refused = view.condition(protocol.POD_CONDITION_RESTORED).get("reason")
    return (
        status(pod, protocol.ANNOTATION_RESTORE_STATUS) is Status.FAILED
        and refused == protocol.RestoredReason.INCOMPATIBLE
        and skip_compat_check(view.meta.annotations)
    )


class NodeAgent:
    def __init__(self, kube: Kube, executor: Executor, runtime: Runtime) -> None:
        self.kube = kube
        self.executor = executor
        self.runtime = runtime
        # This node, whether the agent starts pods' main containers itself (local mode: no kubelet
        # here), and how long it waits for them: the settings the executor was built with.
        config = executor.config
        self.node_name = config.node.node_name
        self.launch_workloads = config.containers.launch_workloads
        self.timeouts = config.timeouts
        # The kubelet's containers, where it runs them (no local launching).
        self.containers = (
            runtime if isinstance(runtime, ContainerdRuntime) and not self.launch_workloads else None
        )
        self.pods = Informer(kube, POD, field_selector=f"spec.nodeName={self.node_name}")
        self.kubelet = KubeletContainers(self.containers, self.pods) if self.containers is not None else None
        # Every namespace's PodSnapshots: their artifacts live as long as they do.
        self.snapshots = Informer(kube, POD_SNAPSHOT)
        self.recorder = EventRecorder(kube, AGENT_NAME)
        self.reports = PodReporter(kube, self.recorder, AGENT_NAME)
        self.sweeper = ArtifactSweeper(executor, [self.snapshots])
        self.capture = SnapshotCapture(
            kube,
            executor,
            self.pods,
            self.recorder,
            self.node_name,
            lambda pod, container: self._ensure_running(pod, snapshot=True, container=container),
            self.timeouts.ready_timeout_seconds,
        )
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Pods whose restore this process marked running: a retry after an unexpected error resumes
        # them, where a "running" left by an earlier agent process means that process died mid-restore.
        self._restoring: set[str] = set()
        self.pods.add_handler(self._on_pod)
        self.snapshots.add_handler(self.sweeper.on_owner)

    async def run_until(self, stop: asyncio.Event) -> None:
        await self.executor.remove_abandoned_scratch()
        # The staging of captures cut short (an agent that died mid-capture); writers still at work, on
        # this node or another sharing the store, hold their lock and are left alone.
        await asyncio.to_thread(self.executor.store.gc_partial)
        informers = [self.pods, self.snapshots, self.capture.contents]
        for informer in informers:
            informer.start()
        sweeping = asyncio.create_task(self.sweeper.sweep_forever(), name="artifact-sweep")
        try:
            await stop.wait()
        finally:
            sweeping.cancel()
            for informer in informers:
                await informer.stop()
            tasks = [
                *self._tasks.values(),
                *self._background,
                *self.sweeper.tasks,
                *self.capture.tasks.values(),
                sweeping,
            ]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.recorder.close()
            await self.executor.aclose()

    async def _on_pod(self, etype: str, pod: Obj, old: Obj | None) -> None:
        view = PodView(pod)
        uid = view.meta.uid
        if view.node_name != self.node_name:
            return  # never touch another node's pod, whatever the watch delivers
        if etype == DELETED or view.meta.deleting:
            self._restoring.discard(uid)
            self.reports.forget(uid)
            task = self._tasks.pop(uid, None)
            if task is not None:
                task.cancel()
            restored = view.meta.labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE
            key = workload_key(pod)
            containers = self.containers if etype == DELETED else None
            if self.launch_workloads or restored:
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
        task = self._tasks.get(uid)
        # A pod is dispatched once; a refused restore its pod has since asked to attempt anyway, again.
        if task is None or (task.done() and reopens_refused_restore(pod)):
            self._tasks[uid] = asyncio.create_task(self._handle(pod), name=f"pod-{workload_key(pod)}")

    # ------------------------------------------------------------------ per pod
    async def _handle(self, pod: Obj) -> None:
        """Dispatch the pod, retrying with backoff on unexpected errors (a transient apiserver error,
        say): restores report their own failures, anything else would otherwise leave the pod unhandled
        until the agent restarts. Each retry reads the pod afresh and dispatches it from the start, so
        every step up to supervision must be safe to repeat. The reports a repeat would get wrong are
        retried where they are made (annotate_until_written): a finished restore, which a repeat would
        find still running and restore anew, and a worker's exit, which a repeat would find gone and not
        yet reported."""
        attempt = 0
        while True:
            try:
                await self._dispatch(pod)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                attempt += 1
                delay = backoff(attempt)
                log.exception(
                    "pod handling failed; retrying",
                    extra={"pod": workload_key(pod), "attempt": attempt, "retry_in_s": delay},
                )
                await asyncio.sleep(delay)
                latest = self.pods.get(object_key(pod))
                if latest is None or not still_live(latest, pod):
                    return
                pod = latest

    async def _dispatch(self, pod: Obj) -> None:
        labels = Meta(pod).labels
        if asks_to_be_restored(pod):
            await self._restore(pod)
        elif (
            self.launch_workloads
            and labels.get(protocol.LABEL_MANAGED_BY) == protocol.MANAGED_BY_VALUE
            and annotation(pod, protocol.ANNOTATION_WORKLOAD_EXITED) is None
            # A pod given the snapshot control directory is a capture's source: the capture of its
            # content launches it, told where that directory is (a cold start never is).
            and not declares_control_dir(pod)
        ):
            try:
                workload_spec(pod, workload_key(pod), snapshot=False)
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
        await self.reports.report_exit(pod, f"worker process {workload.pid} exited")

    async def _ensure_running(self, pod: Obj, *, snapshot: bool, container: str | None = None) -> Workload:
        """The pod's main container (or ``container``), as the kubelet runs it or as launched here."""
        key = workload_key(pod)
        if self.kubelet is not None:
            return await self.kubelet.attach(pod, self.timeouts.container_start_timeout_seconds, container)
        found = await self.runtime.find(key)
        if found is not None:
            return found
        if not self.launch_workloads:
            raise AgentError(f"no running container found for {key}")
        return await self.runtime.launch(workload_spec(pod, key, snapshot=snapshot, container=container))

    # ------------------------------------------------------------------ restore
    async def _restore(self, pod: Obj) -> None:
        """Restore into the pod, from its status on: a finished restore is watched again, a failed one
        left alone, one cut short cleared and started again (unless that keeps happening)."""
        state = status(pod, protocol.ANNOTATION_RESTORE_STATUS)
        spent = await self._retake_container(pod, state)
        if state is Status.COMPLETED:
            await self._watch_restored(pod)
            return
        if state is Status.FAILED:
            if not reopens_refused_restore(pod):
                return  # a failed restore was cleaned up when it failed
            self.reports.event(pod, "RestoreCompatibilityCheckSkipped", REOPENED_MESSAGE)
        attempts = restore_attempts(pod)
        if state is Status.RUNNING and not await self._clear_cut_short(pod, attempts):
            return
        try:
            grant = await self._restore_grant(pod)
        except Refused as e:
            await self.reports.refuse(pod, str(e))
            return
        # Written before the running status: where it raises, the pod is dispatched anew without one, and
        # no restore is taken for cut short.
        await self.reports.set_restored(
            pod, protocol.RestoredReason.IN_PROGRESS, f"restoring from {grant.checkpoint_name}"
        )
        await self.reports.report(
            pod,
            protocol.ANNOTATION_RESTORE_STATUS,
            protocol.ANNOTATION_RESTORE_MESSAGE,
            Status.RUNNING,
            "restoring",
            extra={protocol.ANNOTATION_RESTORE_ATTEMPTS: str(attempts + 1)},
        )
        self._restoring.add(Meta(pod).uid)
        if self.kubelet is not None:
            # The artifact is read and hashed while the kubelet starts the pod's container.
            self.executor.check_ahead(grant.artifact_key, grant.manifest_digest)
        # The time until the kubelet runs the restore pod's container in standby: a restore in a pod pays
        # it and a restore as a process does not, so it is reported beside the executor's phases.
        waiting = time.monotonic()
        target = await self._restore_target(pod, spent)
        if target is None:
            return
        awaited = time.monotonic() - waiting
        PHASE_SECONDS.labels("restore", AWAIT_CONTAINER_PHASE).observe(awaited)
        outcome = await self._run_restore(pod, grant, target)
        if outcome is None:
            return
        await self.reports.report_restored(
            pod,
            f"restored from {grant.checkpoint_name} in {outcome.timings.total():.2f}s"
            + (" (node cache)" if outcome.source == "cache" else ""),
            {
                protocol.ANNOTATION_RESTORE_TIMINGS: json.dumps(
                    {AWAIT_CONTAINER_PHASE: round(awaited, 4), **outcome.timings.phases}
                ),
                protocol.ANNOTATION_RESTORE_CONTAINER_ID: outcome.workload.container_id
                or str(outcome.workload.pid),
                **restored_container_ids(pod, outcome.workload),
            },
        )
        # The work done beside the phases (not in the annotation, whose values sum to the restore).
        log.info(
            "restored",
            extra={
                "pod": workload_key(pod),
                "phases": outcome.timings.phases,
                "overlapped": outcome.timings.overlapped,
            },
        )
        await self._supervise(pod, outcome.workload)

    async def _restore_grant(self, pod: Obj) -> RestoreGrant:
        """The grant of what ``restore-from`` names in the pod's namespace: a DynamoCheckpoint (the Dynamo
        layer), read with the PodSnapshot it records, else a PodSnapshot (NVIDIA Snapshot's generic API);
        either way with the content that PodSnapshot is bound to."""
        namespace = Meta(pod).namespace
        name = name_to_restore(pod)
        ckpt = await get_or_none(self.kube, CHECKPOINT, name, namespace) if name else None
        snapshot_name = snapshot_to_restore(name, ckpt)
        snapshot = (
            await get_or_none(self.kube, POD_SNAPSHOT, snapshot_name, namespace) if snapshot_name else None
        )
        bound = PodSnapshotView(snapshot).bound_content if snapshot is not None else ""
        content = await get_or_none(self.kube, POD_SNAPSHOT_CONTENT, bound, "") if bound else None
        owner_name = capture_checkpoint_name(snapshot) if ckpt is None else None
        owner = await get_or_none(self.kube, CHECKPOINT, owner_name, namespace) if owner_name else None
        return restore_grant(pod, ckpt, snapshot, content, owner)

    async def _retake_container(self, pod: Obj, state: Status | None) -> str | None:
        """After an agent restart, on a kubelet node: take the pod's container again, to watch or clear
        it. The id of a container a restore cut short left processes in: it ends once they are cleared,
        and the next restore goes into the container the kubelet starts in its place."""
        if self.containers is None or state not in (Status.COMPLETED, Status.RUNNING):
            return None
        running = running_container(self.pods.get(object_key(pod)) or pod)
        if running is None:
            return None
        key = workload_key(pod)
        with contextlib.suppress(WorkloadRuntimeError):
            await self.containers.attach(key, running.container_id, image_id=running.image_id)
            if self.containers.holds_restored(key):
                return running.container_id
        return None

    async def _watch_restored(self, pod: Obj) -> None:
        """A restored workload outlives an agent restart: watch it again, or report it gone."""
        if annotation(pod, protocol.ANNOTATION_WORKLOAD_EXITED) is not None:
            return
        found = await self.runtime.find(workload_key(pod))
        if found is not None:
            await self._supervise(pod, found)
        else:
            await self.reports.report_exit(pod, "restored worker gone while the node agent was down")

    async def _clear_cut_short(self, pod: Obj, attempts: int) -> bool:
        """A restore was cut short: clear what it left; True to start it again. One of an earlier agent
        process (which died mid-restore) is no fault of the checkpoint's, so it is not reported as a
        failure unless it keeps happening."""
        await self.runtime.stop(workload_key(pod))
        if Meta(pod).uid not in self._restoring and attempts >= protocol.RESTORE_ATTEMPTS_MAX:
            await self.reports.report_restore_failed(
                pod,
                f"the restore was cut short {attempts} times (node agent restarts); "
                "the partial restore was removed",
            )
            return False
        return True

    async def _restore_target(self, pod: Obj, spent: str | None) -> _RestoreTarget | None:
        """What the restore goes into: on a kubelet node the pod's container in standby (None, reported,
        where it is refused or fails), else the pod spec's environment."""
        if self.kubelet is None:
            return _RestoreTarget(None, None, pod_env(pod))
        try:
            target = await self.kubelet.attach_restore_target(
                pod,
                self.timeouts.container_start_timeout_seconds,
                self.timeouts.standby_timeout_seconds,
                spent,
            )
        except Refused as e:
            await self.reports.refuse(pod, str(e))
            return None
        except (AgentError, WorkloadRuntimeError) as e:
            await self.reports.fail(pod, str(e))
            return None
        env = self.kubelet.runtime.container_env(workload_key(pod))
        return _RestoreTarget(target.image_id, target.visible_gpus, env)

    async def _say_restore_failed(self, key: str, message: str) -> None:
        """restore-failed in the container's control dir: a later container of the pod learns from it that
        the pod's restore was used (the pod's failed status says the same to the controller)."""
        try:
            ctl = self.runtime.control_dir(key)
            await asyncio.to_thread(write_sentinel, ctl / protocol.FILE_RESTORE_FAILED, {"message": message})
        except (OSError, WorkloadRuntimeError) as e:
            log.warning("restore-failed not written", extra={"key": key, "error": str(e)})

    async def _run_restore(
        self, pod: Obj, grant: RestoreGrant, target: _RestoreTarget
    ) -> RestoreOutcome | None:
        """The executor's restore; None where it failed (what it left stopped, the failure reported, a
        refused artifact among them)."""
        view = PodView(pod)
        key = workload_key(pod)
        try:
            return await self.executor.restore(
                key,
                grant.artifact_key,
                manifest_digest=grant.manifest_digest,
                identity_info={
                    "podName": view.meta.name,
                    "namespace": view.meta.namespace,
                    "podIP": view.pod_ip or None,
                    "hostname": view.meta.name[:63],
                    "env": {
                        "POD_NAME": view.meta.name,
                        "POD_NAMESPACE": view.meta.namespace,
                    },
                },
                image_id=target.image_id,
                visible_gpus=target.visible_gpus,
                restore_env=target.env,
                skip_compat=skip_compat_check(view.meta.annotations),
            )
        except Incompatible as e:
            # Refused before anything started: the container stays as it was, to be reopened in place.
            await self.reports.incompatible(pod, str(e))
            return None
        except (AgentError, WorkloadRuntimeError, ValueError) as e:
            await self._say_restore_failed(key, str(e))
            with contextlib.suppress(Exception):
                await self.runtime.stop(key)
            await self.reports.fail(pod, str(e))
            return None
