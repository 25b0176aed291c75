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
import logging

from dynamo_snapshot.agent.artifact_prefetch import ArtifactPrefetch
from dynamo_snapshot.agent.artifact_sweeper import ArtifactSweeper
from dynamo_snapshot.agent.authorize import asks_to_be_restored
from dynamo_snapshot.agent.errors import AgentError, backoff
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.kubelet_containers import KubeletContainers
from dynamo_snapshot.agent.pod_reports import PodReporter
from dynamo_snapshot.agent.pod_restore import PodRestore, reopens_refused_restore
from dynamo_snapshot.agent.pod_spec import (
    MAIN,
    Destination,
    annotation,
    declares_control_dir,
    workload_key,
    workload_spec,
)
from dynamo_snapshot.agent.runtime.base import Runtime, Workload, wait_exit
from dynamo_snapshot.agent.runtime.containerd import ContainerdRuntime
from dynamo_snapshot.agent.snapshot_capture import SnapshotCapture
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import Meta, PodView, still_live
from dynamo_snapshot.kube import (
    DELETED,
    POD,
    EventRecorder,
    Informer,
    Kube,
    Obj,
    object_key,
)
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT

__all__ = ["AGENT_NAME", "MAIN", "NodeAgent", "reopens_refused_restore", "workload_key"]

log = logging.getLogger(__name__)
AGENT_NAME = "dynamo-snapshot-agent"
Status = protocol.SnapshotStatus


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
        self.restores = PodRestore(
            kube, executor, runtime, self.kubelet, self.pods, self.reports, self._supervise
        )
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.pods.add_handler(self._on_pod)
        self.snapshots.add_handler(self.sweeper.on_owner)
        if executor.objects is not None and config.s3.s3_prefetch == "all":
            self.snapshots.add_handler(ArtifactPrefetch(kube, executor).on_snapshot)

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
            keys = self.restores.keys(pod) if asks_to_be_restored(pod) else [workload_key(pod)]
            self.restores.forget(uid)
            self.reports.forget(uid)
            task = self._tasks.pop(uid, None)
            if task is not None:
                task.cancel()
            restored = view.meta.labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE
            containers = self.containers if etype == DELETED else None
            for key in keys:
                self._let_go(key, containers, stop=self.launch_workloads or restored)
            return
        task = self._tasks.get(uid)
        # A pod is dispatched once; a refused restore its pod has since asked to attempt anyway, again.
        if task is None or (task.done() and reopens_refused_restore(pod)):
            self._tasks[uid] = asyncio.create_task(self._handle(pod), name=f"pod-{workload_key(pod)}")

    def _let_go(self, key: str, containers: ContainerdRuntime | None, *, stop: bool) -> None:
        """A pod is going: with ``stop`` what this agent started or restored as ``key`` goes with it (a
        kubelet stops only the containers it started itself); its container is forgotten once deleted."""
        if stop:
            stopping = asyncio.create_task(self.runtime.stop(key))
            self._background.add(stopping)
            stopping.add_done_callback(self._background.discard)
            if containers is not None:
                stopping.add_done_callback(lambda _: containers.forget(key))
        elif containers is not None:
            containers.forget(key)  # the pod is gone: nothing of its container is needed again

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
            await self.restores.restore(pod)
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

    async def _supervise(self, pod: Obj, workload: Workload, dest: Destination | None = None) -> None:
        """Wait for the worker (the one restored into ``dest``) to die and say so on its pod. Cancelled
        (before the agent stops the worker) when the pod is deleted, so a scale-down is never reported
        as a failure."""
        await wait_exit(workload.pid)
        await self.reports.report_exit(pod, f"worker process {workload.pid} exited", dest)

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
