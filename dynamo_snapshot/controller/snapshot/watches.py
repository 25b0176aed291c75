"""The generic layer's reconcilers, and the events that wake them."""

from __future__ import annotations

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import Meta, PodSnapshotContentView
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.snapshot.podsnapshot_reconciler import PodSnapshotReconciler
from dynamo_snapshot.controller.snapshot.snapshotjob_reconciler import SnapshotJobReconciler
from dynamo_snapshot.controller.watch import Reconciles, Watch
from dynamo_snapshot.kube import DELETED, Obj, object_key
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, SNAPSHOT_JOB


def itself(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """The object itself, while it exists (a deleted one has nothing left to reconcile)."""
    return [] if etype == DELETED else [object_key(obj)]


def snapshot_job_of_snapshot(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """The SnapshotJob that made a PodSnapshot follows its outcome, and its deletion."""
    meta = Meta(obj)
    job = meta.labels.get(protocol.LABEL_SNAPSHOT_JOB)
    return [f"{meta.namespace}/{job}"] if job else []


def snapshot_job_of_part(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """A SnapshotJob's Job (its controller) and the Job's pod (labelled with the SnapshotJob's name)."""
    meta = Meta(obj)
    owner = meta.controller or {}
    name = owner.get("name") if owner.get("kind") == SNAPSHOT_JOB.kind else None
    name = name or meta.labels.get(protocol.LABEL_SNAPSHOT_JOB)
    return [f"{meta.namespace}/{name}"] if name else []


def bound_snapshot(ctx: Context, content: Obj) -> str | None:
    """The key of the PodSnapshot a content is bound to, when that is in the controller's namespace."""
    ref = PodSnapshotContentView(content).snapshot_ref
    if ref.get("namespace") and ref.get("name") and ctx.settings.namespace in (None, ref["namespace"]):
        return f"{ref['namespace']}/{ref['name']}"
    return None


def snapshot_of_content(ctx: Context, etype: str, obj: Obj, old: Obj | None) -> list[str]:
    """A content wakes the PodSnapshot it is bound to: its conditions are mirrored there."""
    key = bound_snapshot(ctx, obj)
    return [key] if key else []


RECONCILERS = (
    Reconciles(POD_SNAPSHOT.kind, lambda c: c.snapshots, PodSnapshotReconciler),
    Reconciles(SNAPSHOT_JOB.kind, lambda c: c.snapshot_jobs, SnapshotJobReconciler),
)

WATCHES = (
    Watch(lambda c: c.snapshots, POD_SNAPSHOT.kind, itself),
    Watch(lambda c: c.snapshots, SNAPSHOT_JOB.kind, snapshot_job_of_snapshot),
    Watch(lambda c: c.snapshot_jobs, SNAPSHOT_JOB.kind, itself),
    Watch(lambda c: c.jobs, SNAPSHOT_JOB.kind, snapshot_job_of_part),
    Watch(lambda c: c.pods, SNAPSHOT_JOB.kind, snapshot_job_of_part),
    Watch(lambda c: c.contents, POD_SNAPSHOT.kind, snapshot_of_content),
)
