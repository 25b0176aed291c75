"""Which DynamoCheckpoint a checkpointed service restores from: the one its checkpointRef names, or in Auto
mode the one its identity hashes to, created (owned by the DGD) when there is none yet."""

from __future__ import annotations

from pydantic import ValidationError

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointPhase, DynamoCheckpoint
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.dynamo_views import GraphDeploymentView
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment, ServiceSpec, checkpoint_identity
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.api.views import Meta
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.dynamo.dgd_status import ServiceOutcome
from dynamo_snapshot.controller.podspec import auto_checkpoint_name, checkpoint_job_template, owner_reference
from dynamo_snapshot.kube import NORMAL, WARNING, Obj, is_already_exists
from dynamo_snapshot.kube.kinds import CHECKPOINT


async def resolve_checkpoint(
    ctx: Context,
    obj: Obj,
    dgd: DynamoGraphDeployment,
    svc_name: str,
    svc: ServiceSpec,
    out: ServiceOutcome,
) -> tuple[Obj | None, DynamoCheckpoint | None]:
    """Find (checkpointRef) or find-or-create (Auto) the service's DynamoCheckpoint."""
    namespace = dgd.metadata.namespace or ""
    cfg = svc.checkpoint
    assert cfg is not None
    graph = GraphDeploymentView(obj)
    previous_hash = graph.checkpoint_status(svc_name).identity_hash
    if cfg.checkpoint_ref:
        ckpt_obj = ctx.checkpoints.get(f"{namespace}/{cfg.checkpoint_ref}")
        if ckpt_obj is None:
            msg = (
                f"DynamoCheckpoint {cfg.checkpoint_ref!r} not found in namespace {namespace}; "
                f"service {svc_name} waits for it"
            )
            ctx.recorder.record(obj, WARNING, "CheckpointNotFound", msg)
            out.waiting.append(msg)
            out.checkpoint_ready = False
            out.checkpoint = {"checkpointName": cfg.checkpoint_ref, "ready": False}
            return None, None
    else:
        if not cfg.auto:
            out.checkpoint_ready = False
            return None, None
        identity = checkpoint_identity(dgd.spec, svc_name)
        identity_hash = compute_identity_hash(identity)
        if previous_hash and previous_hash != identity_hash:
            ctx.recorder.record(
                obj,
                WARNING,
                "IdentityChanged",
                f"service {svc_name}: checkpoint identity changed from {previous_hash} to "
                f"{identity_hash}; running replicas are kept, "
                "new replicas use the new checkpoint once Ready",
            )
        ckpt_obj = ctx.checkpoint_by_hash(namespace, identity_hash, graph.meta.uid)
        if ckpt_obj is None:
            ckpt_obj = await create_checkpoint(ctx, obj, dgd, svc_name, identity)
    try:
        ckpt = DynamoCheckpoint.model_validate(ckpt_obj)
    except ValidationError as e:
        out.degraded.append(f"DynamoCheckpoint {Meta(ckpt_obj).name} is invalid: {validation_message(e)}")
        out.checkpoint_ready = False
        return None, None
    phase = ckpt.status.phase if ckpt.status else None
    deleting = Meta(ckpt_obj).deleting
    ready = phase == CheckpointPhase.READY and not deleting
    out.checkpoint_ready = ready
    out.checkpoint = {
        "checkpointName": ckpt.metadata.name,
        "identityHash": (ckpt.status.identity_hash if ckpt.status else None)
        or compute_identity_hash(ckpt.spec.identity),
        "ready": ready,
    }
    if not ready:
        why = (ckpt.status.message if ckpt.status else None) or "not taken yet"
        state = phase.value if phase else CheckpointPhase.PENDING.value
        if deleting:
            state, why = "being deleted", "new replicas start cold until a checkpoint is Ready again"
        note = f"checkpoint {ckpt.metadata.name} is {state}: {why}"
        (out.degraded if phase == CheckpointPhase.FAILED else out.waiting).append(note)
    return ckpt_obj, ckpt


async def create_checkpoint(
    ctx: Context, obj: Obj, dgd: DynamoGraphDeployment, svc_name: str, identity: CheckpointIdentity
) -> Obj:
    """The DGD's own checkpoint for `identity_hash`: controlled by the DGD and never shared with another
    DGD, so no deployment ever restores a process another one's worker started."""
    namespace = dgd.metadata.namespace or ""
    identity_hash = compute_identity_hash(identity)
    meta = Meta(obj)
    name = auto_checkpoint_name(meta.name, identity_hash, meta.uid)
    body: Obj = {
        "apiVersion": CHECKPOINT.api_version,
        "kind": CHECKPOINT.kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
                protocol.LABEL_CHECKPOINT_HASH: identity_hash,
                protocol.LABEL_GRAPH: meta.name,
            },
            "ownerReferences": [owner_reference(obj)],
        },
        "spec": {
            "identity": identity.model_dump(by_alias=True, exclude_none=True, mode="json"),
            "job": {"podTemplateSpec": checkpoint_job_template(dgd, svc_name)},
        },
    }
    try:
        created = await ctx.kube.create(CHECKPOINT, body)
        ctx.recorder.record(
            obj,
            NORMAL,
            "CheckpointCreated",
            f"created DynamoCheckpoint {name} for service {svc_name} (Auto mode)",
        )
    except Exception as e:
        if not is_already_exists(e):
            raise
        created = await ctx.kube.get(CHECKPOINT, name, namespace)
    remembered = (namespace, identity_hash, meta.uid)
    ctx.recent_checkpoints[remembered] = Meta(created).name
    return created
