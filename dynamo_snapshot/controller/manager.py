"""The controller process: informers feed one work queue (one reconcile per object at a time, different
objects in parallel), leader election guards writes, SIGTERM drains in-flight reconciles."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.config import CONTROLLER_NAME, ControllerConfig
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.dynamo.checkpoint_reconciler import CheckpointReconciler
from dynamo_snapshot.controller.dynamo.dgd_reconciler import DGDReconciler
from dynamo_snapshot.controller.dynamo.operator_failover import OperatorFailover
from dynamo_snapshot.controller.failover.losses import (
    FAILOVER_PAUSED,
    WAITING_FOR_NODE,
    node_down,
    node_healthy,
    unhealthy_since,
)
from dynamo_snapshot.controller.snapshot.podsnapshot_reconciler import PodSnapshotReconciler
from dynamo_snapshot.controller.snapshot.snapshotjob_reconciler import SnapshotJobReconciler
from dynamo_snapshot.kube import (
    DELETED,
    WARNING,
    EventRecorder,
    Informer,
    Kube,
    LeaderElector,
    Obj,
    Result,
    WorkQueue,
    controller_ref,
    object_key,
)
from dynamo_snapshot.kube.dgd_versions import DgdVersion
from dynamo_snapshot.kube.informer import compact
from dynamo_snapshot.kube.kinds import (
    CHECKPOINT,
    JOB,
    NODE,
    POD,
    POD_SNAPSHOT,
    POD_SNAPSHOT_CONTENT,
    SNAPSHOT_JOB,
)

# ControllerConfig lives in controller.config (Context reads it too); callers keep importing it from here.
__all__ = ["Controller", "ControllerConfig"]

log = logging.getLogger(__name__)

DGD_KEY, CHECKPOINT_KEY, POD_SNAPSHOT_KEY = "DynamoGraphDeployment", "DynamoCheckpoint", "PodSnapshot"
SNAPSHOT_JOB_KEY = "SnapshotJob"
QueueKey = tuple[str, str]
# Work that runs only while this replica leads, given the process's `stop`: started once the caches are
# synced, cancelled when `stop` is set or leadership is lost.
LeaderTask = Callable[[asyncio.Event], Coroutine[object, object, None]]


def _dgd_informer(kube: Kube, version: DgdVersion, namespace: str | None) -> Informer:
    """DGDs at ``version``, cached as views (v1alpha1's shape), compacted like every cached object."""

    def transform(obj: Obj) -> Obj:
        (obj.get("metadata") or {}).pop("managedFields", None)
        return compact(version.view(obj))

    return Informer(kube, version.kind, namespace=namespace, transform=transform)


@dataclass(frozen=True)
class _LeaderOnly:
    name: str
    run: LeaderTask


class Controller:
    def __init__(
        self,
        kube: Kube,
        config: ControllerConfig,
        *,
        left_to_others: frozenset[str] = frozenset(),
        dgd_version: DgdVersion | None = None,
    ) -> None:
        self.kube = kube
        self.config = config
        # The version DGDs are read and written at: v1beta1 where served (install_mode.check_install_mode).
        self.dgd_version = dgd_version or DgdVersion()
        # Kinds whose objects another operator runs (install_mode.kinds_left_to_others): never reconciled.
        self.left_to_others = left_to_others
        managed = f"{protocol.LABEL_MANAGED_BY}={protocol.MANAGED_BY_VALUE}"
        ns = config.namespace
        self.ctx = Context(
            kube=kube,
            dgds=_dgd_informer(kube, self.dgd_version, ns),
            checkpoints=Informer(
                kube, CHECKPOINT, namespace=ns, indexed_labels=[protocol.LABEL_CHECKPOINT_HASH]
            ),
            pods=Informer(
                kube,
                POD,
                namespace=ns,
                label_selector=managed,
                indexed_labels=[
                    protocol.LABEL_GRAPH,
                    protocol.LABEL_CHECKPOINT_ID,
                    protocol.LABEL_SNAPSHOT_JOB_UID,
                ],
            ),
            jobs=Informer(kube, JOB, namespace=ns, label_selector=managed),
            nodes=Informer(kube, NODE),
            recorder=EventRecorder(kube, CONTROLLER_NAME),
            settings=config,
            dgd_version=self.dgd_version,
        )
        # Mode dynamo-operator: NVIDIA's Dynamo operator runs the DGDs; their informer is never started
        # and no DGD is reconciled (no worker pods, no status writes).
        self.dgd_reconciler: DGDReconciler | None = DGDReconciler(self.ctx) if config.runs_dgds else None
        # The generic layer: PodSnapshots of the namespace, and their contents (cluster-scoped).
        self.snapshots = Informer(kube, POD_SNAPSHOT, namespace=ns)
        self.contents = Informer(kube, POD_SNAPSHOT_CONTENT)
        # SnapshotJobs: their Jobs and pods come through the managed-by informers above.
        self.snapshot_jobs = Informer(kube, SNAPSHOT_JOB, namespace=ns)
        self.checkpoint_reconciler = CheckpointReconciler(
            self.ctx, self.snapshot_jobs, self.snapshots, self.contents
        )
        self.podsnapshot_reconciler = PodSnapshotReconciler(
            kube,
            self.snapshots,
            self.contents,
            self.ctx.recorder,
            pickup_timeout_s=config.snapshot_pickup_timeout_seconds,
        )
        self.snapshotjob_reconciler = SnapshotJobReconciler(
            kube,
            self.snapshot_jobs,
            self.ctx.jobs,
            self.ctx.pods,
            self.snapshots,
            self.contents,
            self.ctx.recorder,
        )
        self._leader_only: list[_LeaderOnly] = []
        self._extra_informers: list[Informer] = []
        self.queue: WorkQueue[QueueKey] = WorkQueue(
            "controller", self._reconcile, workers=config.workers, kind_of=lambda k: k[0]
        )
        self.ctx.failover.wake = lambda dgd_key, delay: self.queue.add_after((DGD_KEY, dgd_key), delay)
        # None without leader election: then this replica leads from the start.
        self.elector: LeaderElector | None = (
            LeaderElector(kube, name=config.lease_name, namespace=config.lease_namespace)
            if config.leader_elect
            else None
        )
        self._wire()
        self.operator_failover = None if config.runs_dgds else self._operator_failover()

    def _operator_failover(self) -> OperatorFailover:
        """Mode dynamo-operator: the operator's lost workers of checkpointed components are deleted (while
        this replica leads) so that their owners create restore pods in their place."""
        failover = OperatorFailover(self.ctx, self.snapshots, self.snapshot_jobs)
        self.run_while_leading("operator-failover", failover.run_until, informers=[failover.pods])
        return failover

    def run_while_leading(self, name: str, task: LeaderTask, *, informers: Iterable[Informer] = ()) -> None:
        """Run `task` whenever this replica leads, once every informer (these too) has synced.

        `informers` are started and stopped with the controller's own and count in its readiness. Call
        before `run_until`."""
        self._leader_only.append(_LeaderOnly(name, task))
        self._extra_informers.extend(informers)

    @property
    def leading(self) -> bool:
        """Whether this replica does the work: always without leader election, else while it holds the
        Lease."""
        return self.elector is None or self.elector.is_leader

    def readiness(self) -> str | None:
        """None when ready: a standby replica is (it can take over), the leader once its caches are synced.

        A standby must count as ready, or a rolling update of a leader-elected Deployment would wait forever
        for a new pod that cannot lead while the old one holds the Lease.
        """
        if not self.leading:
            return None
        waiting = [inf.kind.kind for inf in self.informers if not inf.has_synced.is_set()]
        return f"leading; informer caches not synced yet: {', '.join(waiting)}" if waiting else None

    @property
    def informers(self) -> list[Informer]:
        c = self.ctx
        generic = [self.contents, self.snapshots, self.snapshot_jobs]
        dgds = [c.dgds] if self.dgd_reconciler is not None else []
        return [c.nodes, c.jobs, c.pods, *generic, c.checkpoints, *dgds, *self._extra_informers]

    def _wire(self) -> None:
        ctx = self.ctx

        async def on_dgd(etype: str, obj: Obj, old: Obj | None) -> None:
            key = object_key(obj)
            if etype == DELETED:
                ctx.dgd_seen_at.pop(key, None)
                ctx.status_written_over.pop(key, None)
                ctx.status_written_at.pop(key, None)
                ctx.failover.forget(key)
                return
            ctx.mark_dgd_seen(key)
            self.queue.add((DGD_KEY, key))

        async def on_checkpoint(etype: str, obj: Obj, old: Obj | None) -> None:
            self.queue.add((CHECKPOINT_KEY, object_key(obj)))
            ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
            for dgd in ctx.dgds.list():
                if dgd["metadata"]["namespace"] == ns and _dgd_uses(dgd, name, obj):
                    self.queue.add((DGD_KEY, object_key(dgd)))

        async def on_pod(etype: str, obj: Obj, old: Obj | None) -> None:
            meta = obj["metadata"]
            labels = meta.get("labels") or {}
            graph, service = labels.get(protocol.LABEL_GRAPH), labels.get(protocol.LABEL_SERVICE)
            if graph and service:
                owner = (f"{meta['namespace']}/{graph}", service)
                if _deletion_began(etype, obj, old) and not ctx.expectations.pending_delete(
                    owner, meta["name"]
                ):
                    self._deleted_unexpectedly(owner, obj)
                ctx.expectations.observed(owner, meta["name"], deleted=etype == DELETED)
                self.queue.add((DGD_KEY, owner[0]))

        async def on_node(etype: str, obj: Obj, old: Obj | None) -> None:
            if old is None or etype == DELETED or _node_shape(old) != _node_shape(obj):
                ctx.compatible_node_cache.clear()
            healthy = etype != DELETED and node_healthy(obj)
            if (
                old is None
                or etype == DELETED
                or node_healthy(old) != healthy
                or node_down(old) != node_down(obj)
            ):
                ctx.node_changed()
            elif not healthy and unhealthy_since(old) != unhealthy_since(obj):
                ctx.node_changed()  # NotReady became Unknown (or back): the grace counts from then
            else:
                return
            # Every DGD whose failover is paused looks again: this change may have lifted the pause. A node
            # that went bad, came back or is gone: so does every DGD with a worker there (the node grace
            # is counted in that reconcile). A new node has none, and at start every DGD is reconciled.
            keys = ctx.failover.in_state(FAILOVER_PAUSED) | ctx.failover.in_state(WAITING_FOR_NODE)
            name = obj["metadata"]["name"]
            for pod in ctx.pods.list() if old is not None else ():
                labels = pod["metadata"].get("labels") or {}
                if (pod.get("spec") or {}).get("nodeName") == name and labels.get(protocol.LABEL_GRAPH):
                    keys.add(f"{pod['metadata']['namespace']}/{labels[protocol.LABEL_GRAPH]}")
            for key in keys:
                self.queue.add((DGD_KEY, key))
            if old is not None or ctx.nodes.has_synced.is_set():
                ctx.node_health()  # the pause gauge follows the nodes even when no reconcile asks

        ctx.dgds.add_handler(on_dgd)
        ctx.checkpoints.add_handler(on_checkpoint)
        ctx.pods.add_handler(on_pod)
        ctx.nodes.add_handler(on_node)
        self._wire_snapshots()

    def _wire_snapshots(self) -> None:
        namespace = self.config.namespace

        def wake_checkpoint(obj: Obj) -> None:
            # A DynamoCheckpoint's SnapshotJob and PodSnapshot name it as their controller.
            owner = controller_ref(obj) or {}
            if owner.get("kind") == CHECKPOINT.kind and owner.get("name"):
                self.queue.add((CHECKPOINT_KEY, f"{obj['metadata']['namespace']}/{owner['name']}"))

        async def on_snapshot(etype: str, obj: Obj, old: Obj | None) -> None:
            if etype != DELETED:
                self.queue.add((POD_SNAPSHOT_KEY, object_key(obj)))
            # The SnapshotJob that made it follows its outcome, and its deletion.
            job = (obj["metadata"].get("labels") or {}).get(protocol.LABEL_SNAPSHOT_JOB)
            if job:
                self.queue.add((SNAPSHOT_JOB_KEY, f"{obj['metadata']['namespace']}/{job}"))
            wake_checkpoint(obj)

        async def on_snapshot_job(etype: str, obj: Obj, old: Obj | None) -> None:
            if etype != DELETED:
                self.queue.add((SNAPSHOT_JOB_KEY, object_key(obj)))
            wake_checkpoint(obj)

        async def on_snapshot_job_part(etype: str, obj: Obj, old: Obj | None) -> None:
            # A SnapshotJob's Job (its controller) and the Job's pod (labelled with the SnapshotJob's name).
            meta = obj["metadata"]
            owner = controller_ref(obj) or {}
            name = owner.get("name") if owner.get("kind") == SNAPSHOT_JOB.kind else None
            name = name or (meta.get("labels") or {}).get(protocol.LABEL_SNAPSHOT_JOB)
            if name:
                self.queue.add((SNAPSHOT_JOB_KEY, f"{meta['namespace']}/{name}"))

        async def on_content(etype: str, obj: Obj, old: Obj | None) -> None:
            # A content wakes the PodSnapshot it is bound to: its conditions are mirrored there.
            ref = (obj.get("spec") or {}).get("snapshotRef") or {}
            if ref.get("namespace") and ref.get("name") and namespace in (None, ref["namespace"]):
                key = f"{ref['namespace']}/{ref['name']}"
                self.queue.add((POD_SNAPSHOT_KEY, key))
                # A DynamoCheckpoint reads the artifact and compatibility off its PodSnapshot's content.
                snapshot = self.snapshots.get(key)
                if snapshot is not None:
                    wake_checkpoint(snapshot)

        self.snapshots.add_handler(on_snapshot)
        self.snapshot_jobs.add_handler(on_snapshot_job)
        self.ctx.jobs.add_handler(on_snapshot_job_part)
        self.ctx.pods.add_handler(on_snapshot_job_part)
        self.contents.add_handler(on_content)

    def _deleted_unexpectedly(self, owner: tuple[str, str], pod: Obj) -> None:
        """A worker pod deleted by someone else (a user, an eviction, node cleanup): a loss, unless its
        DGD is going away (the garbage collector deletes the pods of a deleted DGD)."""
        dgd = self.ctx.dgds.get(owner[0])
        finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if dgd is None or dgd["metadata"].get("deletionTimestamp") or finished:
            return
        name = pod["metadata"]["name"]
        if self.ctx.failover.observe(owner, name, "pod-deleted"):
            self.ctx.recorder.record(
                dgd,
                WARNING,
                "WorkerLost",
                f"service {owner[1]}: pod {name} was deleted; {self.ctx.failover.replacing(owner)}",
            )

    async def _reconcile(self, key: QueueKey) -> Result | None:
        kind, obj_key = key
        if kind in self.left_to_others:
            return None
        if kind == DGD_KEY:
            # A worker pod or node event may name a DGD in either mode; only standalone reconciles it.
            return None if self.dgd_reconciler is None else await self.dgd_reconciler.reconcile(obj_key)
        if kind == POD_SNAPSHOT_KEY:
            return await self.podsnapshot_reconciler.reconcile(obj_key)
        if kind == SNAPSHOT_JOB_KEY:
            return await self.snapshotjob_reconciler.reconcile(obj_key)
        return await self.checkpoint_reconciler.reconcile(obj_key)

    async def run_until(self, stop: asyncio.Event) -> None:
        """Run (as leader, when leader election is on) until `stop` is set, then drain and return."""
        if self.elector is None:
            await self._lead(stop)
            return
        leading = asyncio.create_task(self.elector.run(lambda: self._lead(stop)))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({leading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not leading.done():
            leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)
        stopped.cancel()

    async def _lead(self, stop: asyncio.Event) -> None:
        ctx = self.ctx
        leader_only: list[asyncio.Task[None]] = []
        for inf in self.informers:
            inf.start()
        try:
            await asyncio.gather(*(inf.wait_synced() for inf in self.informers))
            log.info(
                "caches synced",
                extra={"mode": str(self.config.mode), "dgds": len(ctx.dgds), "pods": len(ctx.pods)},
            )
            # The caches are long-lived: keep the cyclic GC from re-scanning them (0.5 s stalls at 10k pods).
            gc.freeze()
            self.queue.start()
            self.queue.resync(self._all_keys, self.config.resync_seconds)
            leader_only = [asyncio.create_task(t.run(stop), name=t.name) for t in self._leader_only]
            await stop.wait()
        finally:
            # Ended here on `stop` and on lost leadership alike; only reconciles get the drain below.
            for task in leader_only:
                task.cancel()
            await asyncio.gather(*leader_only, return_exceptions=True)
            # In-flight reconciles finish their writes; nothing new starts.
            await asyncio.shield(self.queue.shutdown(self.config.drain_timeout))
            for inf in self.informers:
                await inf.stop()
            await ctx.recorder.close()

    def _all_keys(self) -> list[QueueKey]:
        # Informer.keys() is a method returning the cache keys, not a dict view.
        keys: list[QueueKey] = [(CHECKPOINT_KEY, k) for k in self.ctx.checkpoints.keys()]  # noqa: SIM118
        keys += [(POD_SNAPSHOT_KEY, k) for k in self.snapshots.keys()]  # noqa: SIM118
        keys += [(SNAPSHOT_JOB_KEY, k) for k in self.snapshot_jobs.keys()]  # noqa: SIM118
        return keys + [(DGD_KEY, k) for k in self.ctx.dgds.keys()]  # noqa: SIM118


def _deletion_began(etype: str, pod: Obj, old: Obj | None) -> bool:
    """This event is the first sign of the pod's deletion: graceful (deletionTimestamp appears) or not."""
    if etype == DELETED:
        return not pod["metadata"].get("deletionTimestamp")
    return bool(pod["metadata"].get("deletionTimestamp")) and not (old or {}).get("metadata", {}).get(
        "deletionTimestamp"
    )


def _dgd_uses(dgd: Obj, ckpt_name: str, ckpt: Obj) -> bool:
    ckpt_hash = (ckpt["metadata"].get("labels") or {}).get(protocol.LABEL_CHECKPOINT_HASH)
    for svc_name, svc in ((dgd.get("spec") or {}).get("services") or {}).items():
        cfg = (svc or {}).get("checkpoint") or {}
        if cfg.get("checkpointRef") == ckpt_name:
            return True
        used = ((dgd.get("status") or {}).get("checkpoints") or {}).get(svc_name) or {}
        if used.get("checkpointName") == ckpt_name or (ckpt_hash and used.get("identityHash") == ckpt_hash):
            return True
        if cfg.get("identity") and cfg.get("enabled"):
            return True  # Auto mode before status names the checkpoint: cheap to check by reconciling
    return False


def _node_shape(node: Obj) -> tuple[object, ...]:
    labels = node["metadata"].get("labels") or {}
    ready = [
        c.get("status")
        for c in (node.get("status") or {}).get("conditions") or []
        if c.get("type") == "Ready"
    ]
    return (
        labels.get(protocol.LABEL_GPU_PRODUCT),
        labels.get(protocol.LABEL_CUDA_DRIVER_MAJOR),
        labels.get(protocol.LABEL_GPU_COUNT),
        tuple(ready),
        (node.get("spec") or {}).get("unschedulable"),
    )
