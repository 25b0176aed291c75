"""The Dynamo layer's reconcilers, and the events that wake them: their own kinds, the worker pods and
nodes under the DGDs, and the generic layer's objects a DynamoCheckpoint is made of."""

from __future__ import annotations

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.dynamo_views import GraphDeploymentView
from dynamo_snapshot.api.views import Meta, NodeView, PodView
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.dynamo.checkpoint_reconciler import CheckpointReconciler
from dynamo_snapshot.controller.dynamo.dgd_reconciler import DGDReconciler
from dynamo_snapshot.controller.failover.losses import FAILOVER_PAUSED, WAITING_FOR_NODE
from dynamo_snapshot.controller.failover.node_state import node_down, node_healthy, unhealthy_since
from dynamo_snapshot.controller.snapshot.watches import bound_snapshot
from dynamo_snapshot.controller.watch import Reconciles, Watch
from dynamo_snapshot.kube import DELETED, WARNING, Obj, controller_ref, object_key
from dynamo_snapshot.kube.kinds import CHECKPOINT, DGD


def dgd_itself(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """A DGD while it exists (noting when a change was seen, for the scale latency); a deleted one's
    memory is dropped."""
    key = object_key(obj)
    if etype == DELETED:
        ctx.dgd_seen_at.pop(key, None)
        ctx.status_written_over.pop(key, None)
        ctx.status_written_at.pop(key, None)
        ctx.failover.forget(key)
        return []
    ctx.mark_dgd_seen(key)
    return [key]


def checkpoint_itself(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    return [object_key(obj)]


def dgds_of_checkpoint(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """The DGDs of the checkpoint's namespace that use it, or may (Auto mode)."""
    meta = Meta(obj)
    return [
        object_key(dgd)
        for dgd in ctx.dgds.list()
        if Meta(dgd).namespace == meta.namespace and _dgd_uses(dgd, meta.name, obj)
    ]


def dgd_of_worker(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """A worker pod's DGD; the pod's creation or deletion is noted against what the DGD's reconcile
    expects, and a deletion by someone else is a loss."""
    meta = Meta(obj)
    graph, service = meta.labels.get(protocol.LABEL_GRAPH), meta.labels.get(protocol.LABEL_SERVICE)
    if not (graph and service):
        return []
    owner = (f"{meta.namespace}/{graph}", service)
    if _deletion_began(etype, obj, old) and not ctx.expectations.pending_delete(owner, meta.name):
        _deleted_unexpectedly(ctx, owner, obj)
    ctx.expectations.observed(owner, meta.name, deleted=etype == DELETED)
    return [owner[0]]


def dgds_of_node(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """On a change of a node's health: every DGD whose failover is paused or waits for a node looks
    again (this change may have lifted it), and so does every DGD with a worker on that node (the node
    grace is counted in that reconcile). A new node has none, and at start every DGD is reconciled."""
    if old is None or etype == DELETED or _node_shape(old) != _node_shape(obj):
        ctx.compatible_node_cache.clear()
    healthy = etype != DELETED and node_healthy(obj)
    if old is None or etype == DELETED or node_healthy(old) != healthy or node_down(old) != node_down(obj):
        ctx.node_changed()
    elif not healthy and unhealthy_since(old) != unhealthy_since(obj):
        ctx.node_changed()  # NotReady became Unknown (or back): the grace counts from then
    else:
        return []
    keys = ctx.failover.in_state(FAILOVER_PAUSED) | ctx.failover.in_state(WAITING_FOR_NODE)
    name = Meta(obj).name
    for pod in ctx.pods.list() if old is not None else ():
        view = PodView(pod)
        graph = view.meta.labels.get(protocol.LABEL_GRAPH)
        if view.node_name == name and graph:
            keys.add(f"{view.meta.namespace}/{graph}")
    if old is not None or ctx.nodes.has_synced.is_set():
        ctx.node_health()  # the pause gauge follows the nodes even when no reconcile asks
    return list(keys)


def checkpoint_controlling(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """A DynamoCheckpoint's SnapshotJob and PodSnapshot name it as their controller."""
    owner = controller_ref(obj) or {}
    if owner.get("kind") == CHECKPOINT.kind and owner.get("name"):
        return [f"{Meta(obj).namespace}/{owner['name']}"]
    return []


def checkpoint_of_content(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """A DynamoCheckpoint reads the artifact and compatibility off its PodSnapshot's content."""
    key = bound_snapshot(ctx, obj)
    snapshot = ctx.snapshots.get(key) if key else None
    return checkpoint_controlling(ctx, etype, snapshot, None) if snapshot is not None else []


RECONCILERS = (
    Reconciles(CHECKPOINT.kind, lambda c: c.checkpoints, CheckpointReconciler),
    # Mode dynamo-operator: NVIDIA's Dynamo operator runs the DGDs; their informer is never started and
    # no DGD is reconciled (no worker pods, no status writes).
    Reconciles(DGD.kind, lambda c: c.dgds, DGDReconciler, runs=lambda config: config.runs_dgds),
)

WATCHES = (
    Watch(lambda c: c.dgds, DGD.kind, dgd_itself),
    Watch(lambda c: c.checkpoints, CHECKPOINT.kind, checkpoint_itself),
    Watch(lambda c: c.checkpoints, DGD.kind, dgds_of_checkpoint),
    Watch(lambda c: c.pods, DGD.kind, dgd_of_worker),
    Watch(lambda c: c.nodes, DGD.kind, dgds_of_node),
    Watch(lambda c: c.snapshots, CHECKPOINT.kind, checkpoint_controlling),
    Watch(lambda c: c.snapshot_jobs, CHECKPOINT.kind, checkpoint_controlling),
    Watch(lambda c: c.contents, CHECKPOINT.kind, checkpoint_of_content),
)


def _deleted_unexpectedly(ctx: Context, owner: tuple[str, str], pod: Obj) -> None:
    """A worker pod deleted by someone else (a user, an eviction, node cleanup): a loss, unless its
    DGD is going away (the garbage collector deletes the pods of a deleted DGD)."""
    dgd = ctx.dgds.get(owner[0])
    worker = PodView(pod)
    if dgd is None or Meta(dgd).deleting or worker.finished:
        return
    name = worker.meta.name
    if ctx.failover.observe(owner, name, "pod-deleted"):
        ctx.recorder.record(
            dgd,
            WARNING,
            "WorkerLost",
            f"service {owner[1]}: pod {name} was deleted; {ctx.failover.replacing(owner)}",
        )


def _deletion_began(etype: str, pod: Obj, old: Obj | None) -> bool:
    """This event is the first sign of the pod's deletion: graceful (deletionTimestamp appears) or not."""
    if etype == DELETED:
        return not Meta(pod).deleting
    return Meta(pod).deleting and not (old is not None and Meta(old).deleting)


def _dgd_uses(dgd: Obj, ckpt_name: str, ckpt: Obj) -> bool:
    ckpt_hash = Meta(ckpt).labels.get(protocol.LABEL_CHECKPOINT_HASH)
    graph = GraphDeploymentView(dgd)
    for svc in graph.services.values():
        cfg = svc.checkpoint
        if cfg.checkpoint_ref == ckpt_name:
            return True
        used = graph.checkpoint_status(svc.name)
        if used.checkpoint_name == ckpt_name or (ckpt_hash and used.identity_hash == ckpt_hash):
            return True
        if cfg.identity and cfg.enabled:
            return True  # Auto mode before status names the checkpoint: cheap to check by reconciling
    return False


def _node_shape(node: Obj) -> tuple[object, ...]:
    view = NodeView(node)
    labels = view.meta.labels
    return (
        labels.get(protocol.LABEL_GPU_PRODUCT),
        labels.get(protocol.LABEL_CUDA_DRIVER_MAJOR),
        labels.get(protocol.LABEL_GPU_COUNT),
        view.ready,
        view.spec.get("unschedulable"),
    )
