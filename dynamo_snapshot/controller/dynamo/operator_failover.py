"""Failover by restore of the worker pods NVIDIA's Dynamo operator creates (mode dynamo-operator).

In mode dynamo-operator this controller creates no DGD pod. Dynamo's operator (ai-dynamo/dynamo
deploy/operator) makes each component's pods through a DynamoComponentDeployment and a Deployment (its
ReplicaSet creates the pods), a LeaderWorkerSet (StatefulSets), or Grove (PodClique), and labels them
nvidia.com/dynamo-graph-deployment-name, nvidia.com/dynamo-component and nvidia.com/dynamo-component-type.
A checkpointed component's pod template carries nvidia.com/dynamo-checkpoint-restore-candidate=true with
the checkpoint's name and kind (PodSnapshot, or the SnapshotJob producing one); the operator's pod-CREATE
webhook (PodCheckpointRestoreMutator) turns each new pod of it into a restore pod (nvidia.com/restore-from)
once that checkpoint is Ready, and mutates no pod on UPDATE. Where the PodSnapshots or DynamoCheckpoints
are this project's, a template naming one in nvidia.com/restore-from is shaped by this project's restore
webhook (snapshot.restore_mutation) the same way. So only a new pod restores; what a lost worker gets
without help is a cold start: the kubelet restarts a crashed container in place, and a pod on a dead node
is replaced by its ReplicaSet only once the node lifecycle controller evicts it (after 300 s of NotReady)
or a StatefulSet's only once the pod is gone.

Mechanism: a lost worker (failover.worker_loss.judge_loss, the judgement the controller's own DGD
failover uses: pod Failed, crash-looping, its worker process gone, its node deleted, or NotReady past the
node grace while failover is not paused) of an operator-made pod of a component whose next pod restores from a
Ready checkpoint of the pod's own namespace is deleted, with its UID as precondition and no grace, so
that its owner creates the new pod at once and the admission path makes it a restore pod. Nothing else
is acted on: a pod whose controller chain does not lead to its DGD (operator_chain.controller_chain), or
whose component's next pod would not restore from a Ready checkpoint of its namespace, is left alone.
Deletions draw from failover.losses.Failover's per-component and cluster token buckets and wait out its
crash-loop backoff; its FailoverPaused, CrashLoopBackOff and WorkerLost Events go to the pod's DGD, and
its metrics count the losses, the time to the owner's new pod and to that pod being Ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from datetime import UTC, datetime

from cachetools import TTLCache
from prometheus_client import Counter

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import Meta, PodView
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.dynamo.operator_chain import (
    Chain,
    checkpoint_of,
    controller_chain,
    next_pod_annotations,
)
from dynamo_snapshot.controller.failover.losses import FAILOVER_PAUSED, WORKER_LOST, Failover
from dynamo_snapshot.controller.failover.node_state import node_healthy
from dynamo_snapshot.controller.failover.worker_loss import judge_loss, worker_lifetime
from dynamo_snapshot.kube import (
    DELETED,
    NORMAL,
    WARNING,
    Obj,
    ResourceKind,
    Result,
    WorkQueue,
    controller_ref,
    is_conflict,
    is_not_found,
)
from dynamo_snapshot.kube.kinds import POD
from dynamo_snapshot.kube.pods import pod_ready

__all__ = ["LOST_WORKER_DELETED", "OperatorFailover"]

log = logging.getLogger(__name__)

DELETIONS = Counter(
    "dynsnap_operator_failover_deletions_total",
    "Lost worker pods of Dynamo operator components deleted so that their owner creates a restore pod",
    ["cause"],
)
LEFT_ALONE = Counter(
    "dynsnap_operator_failover_left_alone_total",
    "Lost pods labelled as Dynamo components and not deleted: not the operator's, or no Ready checkpoint",
    ["why"],
)

LOST_WORKER_DELETED = "LostWorkerDeleted"
# A deleted pod whose owner made no new pod in this long (scaled down meanwhile) is no loss any more.
REPLACEMENT_WAIT_SECONDS = 300.0
# The controller chain of one creator is read again after this long (an owner deleted, a UID changed).
CHAIN_TTL_SECONDS = 10.0

Owner = tuple[str, str]  # ("namespace/dgd", component)


def component_of(pod: Obj) -> Owner | None:
    """The DGD (key) and component a pod's Dynamo labels claim; None without both labels."""
    meta = Meta(pod)
    graph = meta.labels.get(protocol.LABEL_DYNAMO_GRAPH)
    component = meta.labels.get(protocol.LABEL_DYNAMO_COMPONENT)
    if not graph or not component:
        return None
    return f"{meta.namespace}/{graph}", component


class OperatorFailover:
    """Watches the pods labelled nvidia.com/dynamo-component (one component per queue key) and deletes
    the lost ones that may be failed over by restore. Runs only while the controller leads."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.snapshots = ctx.snapshots
        self.snapshot_jobs = ctx.snapshot_jobs
        # Labelled nvidia.com/dynamo-component, indexed by nvidia.com/dynamo-graph-deployment-name.
        self.pods = ctx.component_pods
        self.failover = Failover(settings=ctx.settings, wake=self._wake)
        # Lost pods deleted whose owner has not made their successor yet: name -> (creator UID, when).
        self.deleted: dict[Owner, dict[str, tuple[str, float]]] = defaultdict(dict)
        # The DGD last seen for each component, for the Events that say a state ended.
        self.dgds: dict[Owner, Obj] = {}
        self._chains: TTLCache[str, Chain | str] = TTLCache(maxsize=4_096, ttl=CHAIN_TTL_SECONDS)
        self._told: TTLCache[tuple[str, str], bool] = TTLCache(maxsize=4_096, ttl=600.0)
        self.queue: WorkQueue[Owner] = self._new_queue()
        self.pods.add_handler(self._on_pod)
        ctx.nodes.add_handler(self._on_node)

    def _new_queue(self) -> WorkQueue[Owner]:
        return WorkQueue(
            "operator-failover",
            self.reconcile,
            workers=min(4, self.ctx.settings.workers),
            kind_of=lambda _: "DynamoComponent",
        )

    async def run_until(self, stop: asyncio.Event) -> None:
        """Reconcile until `stop` (or cancellation, when leadership is lost); in-flight deletions finish."""
        self.queue = self._new_queue()
        self.queue.start()
        self.queue.resync(self._owners, self.ctx.settings.resync_seconds)
        for owner in self._owners():
            self.queue.add(owner)
        try:
            await stop.wait()
        finally:
            await asyncio.shield(self.queue.shutdown(self.ctx.settings.drain_timeout))

    def _owners(self) -> list[Owner]:
        return sorted({o for p in self.pods.list() if (o := component_of(p)) is not None})

    def _pods_of(self, owner: Owner) -> list[Obj]:
        namespace, graph = owner[0].split("/", 1)
        return [
            p
            for p in self.pods.by_label(protocol.LABEL_DYNAMO_GRAPH, graph)
            if Meta(p).namespace == namespace and component_of(p) == owner
        ]

    def _wake(self, dgd_key: str, delay: float) -> None:
        for owner in self._owners():
            if owner[0] == dgd_key:
                self.queue.add_after(owner, delay)

    async def _on_pod(self, etype: str, obj: Obj, old: Obj | None) -> None:
        owner = component_of(obj)
        if owner is None:
            return
        if etype != DELETED and old is None:
            self._successor_appeared(owner, obj)
        self.queue.add(owner)

    def _successor_appeared(self, owner: Owner, pod: Obj) -> None:
        """A new pod of a creator whose lost pod was deleted: the loss is replaced."""
        creator = (controller_ref(pod) or {}).get("uid")
        waiting = self.deleted.get(owner) or {}
        for name, (uid, _) in list(waiting.items()):
            if uid == creator:
                del waiting[name]
                self.failover.replaced(owner, [Meta(pod).name])
                return

    async def _on_node(self, etype: str, obj: Obj, old: Obj | None) -> None:
        if old is None and etype != DELETED:
            return  # a new node holds no pod yet
        if etype != DELETED and node_healthy(old) == node_healthy(obj):
            return
        name = Meta(obj).name
        paused = self.failover.in_state(FAILOVER_PAUSED)
        for pod in self.pods.list():
            owner = component_of(pod)
            if owner is not None and (PodView(pod).node_name == name or owner[0] in paused):
                self.queue.add(owner)

    # ------------------------------------------------------------------ one component
    async def reconcile(self, owner: Owner) -> Result | None:
        pods = self._pods_of(owner)
        self._forget_stale_deletions(owner)
        names = {Meta(p).name for p in pods}
        self.failover.track_ready(owner, {Meta(p).name for p in pods if pod_ready(p)}, names)
        if not pods and not self.deleted.get(owner):
            self.failover.forget_service(owner)
            self.dgds.pop(owner, None)
            return None
        now = datetime.now(UTC)
        paused = self.ctx.node_health().paused
        lost: list[tuple[Obj, str, str | None, Chain]] = []
        grace: dict[str, datetime] = {}
        kept: dict[str, str] = {}
        for pod in pods:
            view = PodView(pod)
            if view.meta.deleting or view.meta.name in self.deleted.get(owner, {}):
                continue
            node_name = view.node_name or None
            node = self.ctx.nodes.get(node_name) if node_name else None
            verdict = judge_loss(pod, node, now, self.ctx.node_grace_ends, paused is not None)
            if verdict.cause is None and verdict.grace_ends is None and not verdict.kept:
                continue
            chain = await self._eligible(pod)
            if chain is None:
                continue
            self.dgds[owner] = chain.dgd
            if verdict.grace_ends is not None and node_name:
                grace[node_name] = verdict.grace_ends
            elif verdict.kept and node_name:
                kept[view.meta.name] = node_name
            elif verdict.cause is not None:
                lost.append((pod, verdict.cause, node_name, chain))
        self._drop_losses_but(owner, {Meta(item[0]).name for item in lost})
        dgd = self.dgds.get(owner)
        if dgd is not None:
            for event in self.failover.review(owner, grace=grace, paused=paused if kept else None, kept=kept):
                self.ctx.recorder.record(dgd, *event)
        return await self._delete_lost(owner, lost, len(pods), now) if lost else None

    def _drop_losses_but(self, owner: Owner, lost: set[str]) -> None:
        """Forget the noted losses that are neither lost now nor deleted and waiting for their successor:
        a pod gone by other hands, or one no longer to be failed over (its checkpoint not Ready any more)."""
        pending = self.failover.pending.get(owner)
        if not pending:
            return
        for name in list(pending):
            if name not in lost and name not in self.deleted.get(owner, {}):
                del pending[name]

    async def _eligible(self, pod: Obj) -> Chain | None:
        """The pod's controller chain when the pod may be failed over by restore; None (and said once)
        when it is to be left alone."""
        meta = Meta(pod)
        creator_uid = (controller_ref(pod) or {}).get("uid") or f"pod:{meta.uid}"
        chain = self._chains.get(creator_uid)
        if chain is None:
            chain = self._chains[creator_uid] = await controller_chain(self.ctx.kube, pod)
        if isinstance(chain, str):
            self._leave_alone(pod, "not-operator-made", chain)
            return None
        annotations = next_pod_annotations(chain, pod)
        namespace = meta.namespace
        ready, why = checkpoint_of(
            namespace, annotations, lambda kind, name: self._get(kind, namespace, name)
        )
        if ready is None:
            self._leave_alone(pod, "no-ready-checkpoint", f"{chain.describe()}: {why}")
            return None
        return chain

    def _get(self, kind: ResourceKind, namespace: str, name: str) -> Obj | None:
        caches = {
            "DynamoCheckpoint": self.ctx.checkpoints,
            "PodSnapshot": self.snapshots,
            "SnapshotJob": self.snapshot_jobs,
        }
        return caches[kind.kind].get(f"{namespace}/{name}")

    def _leave_alone(self, pod: Obj, why: str, message: str) -> None:
        meta = Meta(pod)
        if self._told.get((meta.uid, message)):
            return
        self._told[(meta.uid, message)] = True
        LEFT_ALONE.labels(why).inc()
        log.info(
            "lost pod left alone",
            extra={"namespace": meta.namespace, "pod": meta.name, "why": why, "detail": message},
        )

    async def _delete_lost(
        self, owner: Owner, lost: list[tuple[Obj, str, str | None, Chain]], pods: int, now: datetime
    ) -> Result | None:
        component = owner[1]
        for pod, cause, node_name, chain in lost:
            name = Meta(pod).name
            if self.failover.observe(owner, name, cause, node_name, worker_lifetime(pod, now)):
                self.ctx.recorder.record(
                    chain.dgd,
                    WARNING,
                    WORKER_LOST,
                    f"component {component}: pod {name} lost ({cause}, node {node_name or '-'}); "
                    f"{self.failover.replacing(owner)}",
                )
        allowed, later = self.failover.allowance(owner, len(lost), pods)
        seen = {name: loss.seen for name, loss in self.failover.pending.get(owner, {}).items()}
        oldest = sorted(lost, key=lambda item: seen.get(Meta(item[0]).name, 0.0))
        for pod, cause, _, chain in oldest[:allowed]:
            await self._delete(owner, pod, cause, chain)
        return Result(requeue_after=later) if later else None

    async def _delete(self, owner: Owner, pod: Obj, cause: str, chain: Chain) -> None:
        meta = Meta(pod)
        name = meta.name
        try:
            await self.ctx.kube.delete(
                POD, name, meta.namespace, uid=meta.uid or None, grace_period_seconds=0
            )
        except Exception as e:
            if not (is_not_found(e) or is_conflict(e)):
                raise
            # Gone already, or a pod of the same name with another UID: not this loss any more.
            self.failover.pending.get(owner, {}).pop(name, None)
            return
        self.deleted[owner][name] = (Meta(chain.creator).uid, time.monotonic())
        DELETIONS.labels(cause).inc()
        self.ctx.recorder.record(
            chain.dgd,
            NORMAL,
            LOST_WORKER_DELETED,
            f"component {owner[1]}: deleted lost pod {name} ({cause}); {chain.describe()} creates its "
            "successor, which restores from the component's checkpoint",
        )
        log.info(
            "lost worker deleted for restore",
            extra={"namespace": meta.namespace, "pod": name, "cause": cause, "creator": chain.describe()},
        )

    def _forget_stale_deletions(self, owner: Owner) -> None:
        waiting = self.deleted.get(owner)
        if not waiting:
            return
        now = time.monotonic()
        for name, (_, when) in list(waiting.items()):
            if now - when > REPLACEMENT_WAIT_SECONDS:
                del waiting[name]
                self.failover.pending.get(owner, {}).pop(name, None)
