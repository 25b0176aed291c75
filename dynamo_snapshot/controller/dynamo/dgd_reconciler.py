"""DynamoGraphDeployment reconcile: for every service, make the worker pods the spec asks for exist —
restored from a Ready checkpoint where the service has checkpointing enabled and one is Ready, cold-started
otherwise — or say why the service is not run, and report it in `status` and Events. Level-triggered:
everything is derived from the caches on every run. What the apiserver refuses (admission, a quota, a
field the CRD schema cannot check) becomes a condition and an Event, retried with backoff.

The steps live beside it: which checkpoint a service uses (checkpoint_choice), its pods (worker_pods),
what is refused (refusals) and the status written (dgd_status).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointPhase, DynamoCheckpoint
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.dynamo_views import GraphDeploymentView
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment, ServiceSpec
from dynamo_snapshot.api.views import Meta
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.dynamo.checkpoint_choice import resolve_checkpoint
from dynamo_snapshot.controller.dynamo.dgd_status import (
    ServiceOutcome,
    dgd_status,
    status_throttle,
    write_status,
)
from dynamo_snapshot.controller.dynamo.pod_problems import service_problems
from dynamo_snapshot.controller.dynamo.refusals import CreateHeldBack, Refusals, refusal_text, refused
from dynamo_snapshot.controller.dynamo.worker_pods import (
    WorkerPods,
    restore_failed,
    scale_down_order,
    start_mode,
)
from dynamo_snapshot.controller.failover.losses import NO_COMPATIBLE_NODE, WAITING_FOR_NODE
from dynamo_snapshot.controller.podspec import unsupported
from dynamo_snapshot.kube import WARNING, ApiError, Obj, Result
from dynamo_snapshot.kube.dgd_versions import DgdUnreadable
from dynamo_snapshot.kube.pods import pod_active, pod_ready, unschedulable

__all__ = ["DGDReconciler"]

log = logging.getLogger(__name__)


class DGDReconciler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.refusals = Refusals(ctx.recorder)
        self.pods = WorkerPods(ctx, self.refusals)

    async def reconcile(self, key: str) -> Result | None:
        ctx = self.ctx
        obj = ctx.dgds.get(key)
        if obj is None or Meta(obj).deleting:
            self.refusals.forget(key)
            return None  # pods and Jobs carry ownerReferences: the garbage collector removes them
        namespace, name = key.split("/", 1)
        graph = GraphDeploymentView(obj)
        generation = graph.meta.generation
        status: dict[str, Any] = dict(graph.status)
        try:
            dgd = ctx.dgd_version.model(obj)
        except (ValidationError, DgdUnreadable) as e:
            why = validation_message(e) if isinstance(e, ValidationError) else str(e)
            msg = f"invalid spec, nothing changed: {why}"
            ctx.recorder.record(obj, WARNING, "InvalidSpec", msg)
            conds = cond.set_condition(
                status.get("conditions") or [], cond.DEGRADED, True, "InvalidSpec", msg, generation
            )
            await write_status(
                self.ctx,
                self.refusals,
                obj,
                {**status, "conditions": conds, "observedGeneration": generation},
            )
            return None

        outcomes: dict[str, ServiceOutcome] = {}
        requeue = False
        services = dgd.spec.services or {}
        self.refusals.retry_changed_spec(key, generation)
        for svc_name, svc in services.items():
            why_not = unsupported(svc)
            if why_not is not None:
                await self._release_service(obj, svc_name)
                outcome = self._observed(obj, svc_name, svc, status)
                outcome.not_handled = f"service {svc_name} is not run: {why_not}"
                self.refusals.announce(obj, svc_name, cond.SERVICE_NOT_HANDLED, outcome.not_handled)
                outcomes[svc_name] = outcome
                continue
            outcome, again = await self._reconcile_guarded(obj, dgd, svc_name, svc, status)
            outcomes[svc_name] = outcome
            requeue = requeue or again
        # A removed service may have pods left, or only losses remembered (all its pods were lost).
        labelled = (Meta(p).labels.get(protocol.LABEL_SERVICE) for p in ctx.pods_of(namespace, name))
        known = {svc for svc in labelled if svc} | {owner[1] for owner in ctx.failover.owners(key)}
        for stale in known - set(outcomes):
            if stale not in services:
                await self._release_service(obj, stale)

        new_status = dgd_status(status, outcomes, generation)
        paced = min((o.retry_after for o in outcomes.values() if o.retry_after), default=0.0)
        wait = status_throttle(ctx, f"{namespace}/{name}", status, new_status)
        if wait > 0:
            return Result(requeue_after=min(wait, paced) if paced else wait)
        await write_status(self.ctx, self.refusals, obj, new_status)
        if paced:
            return Result(requeue_after=paced)
        # Pod creations show up through the pod informer; a requeue covers writes that were refused.
        return Result(requeue=True) if requeue else None

    async def _reconcile_guarded(
        self, obj: Obj, dgd: DynamoGraphDeployment, svc_name: str, svc: ServiceSpec, status: dict[str, Any]
    ) -> tuple[ServiceOutcome, bool]:
        """`_reconcile_service`, with what the apiserver refuses turned into the outcome's refusal (and so
        into a condition and an Event) instead of an exception the work queue would log and retry at once.
        Transient errors (5xx, timeouts, throttling) still raise."""
        owner = (f"{obj['metadata']['namespace']}/{obj['metadata']['name']}", svc_name)
        held = self.refusals.current.get(owner)
        due = held is not None and held.retry_at <= time.monotonic()
        again = False
        if held is not None and held.whole_service and not due:
            out = self._observed(obj, svc_name, svc, status)
        else:
            try:
                out, again = await self._reconcile_service(obj, dgd, svc_name, svc, status)
                if due and self.refusals.current.get(owner) is held:
                    # Due for a retry and neither refused again nor retried (nothing needed creating):
                    # the refusal no longer stands.
                    self.refusals.current.pop(owner)
            except CreateHeldBack:
                out = self._observed(obj, svc_name, svc, status)
            except ApiError as e:
                if not refused(e):
                    raise
                message = f"service {svc_name}: the apiserver refused a request ({refusal_text(e)})"
                self.refusals.refuse(obj, svc_name, cond.REQUEST_REJECTED, message, whole_service=True)
                out = self._observed(obj, svc_name, svc, status)
        refusal = self.refusals.current.get(owner)
        if refusal is not None and not refusal.whole_service and out.replicas >= out.desired:
            # Nothing left to create (a scale-down, or pods made some other way): nothing is refused.
            self.refusals.current.pop(owner)
            refusal = None
        if refusal is not None:
            out.refusal = refusal
            left = max(refusal.retry_at - time.monotonic(), 0.05)
            out.retry_after = min(out.retry_after or left, left)
        else:
            self.refusals.settled(owner)
        return out, again

    def _observed(self, obj: Obj, svc_name: str, svc: ServiceSpec, status: dict[str, Any]) -> ServiceOutcome:
        """A service's outcome read off the caches alone, for a service not reconciled this time."""
        meta = Meta(obj)
        pods = [p for p in self.ctx.pods_of(meta.namespace, meta.name, svc_name) if pod_active(p)]
        restored = sum(1 for p in pods if start_mode(p) == protocol.StartMode.RESTORE.value)
        checkpointed = svc.checkpoint is not None and svc.checkpoint.enabled
        previous = (status.get("checkpoints") or {}).get(svc_name) if checkpointed else None
        return ServiceOutcome(
            replicas=len(pods),
            ready=sum(1 for p in pods if pod_ready(p)),
            restored=restored,
            cold=len(pods) - restored,
            desired=svc.replicas if svc.replicas is not None else 1,
            checkpoint=previous,
            checkpoint_ready=bool(previous.get("ready")) if previous else not checkpointed,
        )

    async def _reconcile_service(
        self, obj: Obj, dgd: DynamoGraphDeployment, svc_name: str, svc: ServiceSpec, status: dict[str, Any]
    ) -> tuple[ServiceOutcome, bool]:
        ctx = self.ctx
        meta = Meta(obj)
        namespace, name = meta.namespace, meta.name
        out = ServiceOutcome(desired=svc.replicas if svc.replicas is not None else 1)
        # A service without checkpointing runs cold-start pods only, scaled and replaced like any other's.
        checkpointed = svc.checkpoint is not None and svc.checkpoint.enabled
        ckpt = None
        if checkpointed:
            _, ckpt = await resolve_checkpoint(ctx, obj, dgd, svc_name, svc, out)
        ready_ckpt = ckpt if ckpt and ckpt.status and ckpt.status.phase == CheckpointPhase.READY else None
        ref_mode = svc.checkpoint is not None and checkpointed and bool(svc.checkpoint.checkpoint_ref)

        owner = (f"{namespace}/{name}", svc_name)
        again = await self._replace_stuck_restores(obj, dgd, owner, ready_ckpt, out)
        await self.pods.remove_lost(obj, owner)
        # Cache and expectations are read together, with no await in between: an informer event handled
        # during an await would otherwise move a pod out of the expectations before we count the cache.
        pods = self.pods.live(owner)
        count = len(pods) + len(ctx.expectations.pending_creates(owner, {Meta(p).name for p in pods}))
        ready_ckpt, node_wait = self._restorable(obj, owner, ready_ckpt, out, short=count < out.desired)
        # checkpointRef mode waits for its checkpoint (out.waiting says why) unless something is wrong
        # with it, in which case capacity by cold start beats none at all.
        creates = not node_wait and (ready_ckpt is not None or not ref_mode or bool(out.degraded))
        # Losses are owed only as far as the service is short: the rest (absorbed by a scale-down) would
        # keep it Degraded and hold back others' tokens for ever. A service that waits keeps its losses, so
        # that once its checkpoint is Ready their replacements are paced like any other failover.
        if node_wait:
            ctx.failover.settle(owner, out.desired - count, waiting=True, waits_for=node_wait)
        else:
            ctx.failover.settle(owner, out.desired - count, waiting=not creates)
        if count < out.desired:
            missing = out.desired - count
            if creates:
                allowed, later = ctx.failover.allowance(owner, missing, out.desired)
                if allowed:
                    await self.pods.create(
                        obj, dgd, svc_name, owner, allowed, ready_ckpt, ctx.failover.avoid_nodes(owner)
                    )
                if later:
                    out.retry_after = min(out.retry_after or later, later)
                    out.degraded.append(
                        f"service {svc_name}: {missing - allowed} replacement(s) paced by the rate limit"
                    )
        elif count > out.desired:
            extra = sorted(pods, key=scale_down_order)[: count - out.desired]
            await self.pods.delete(obj, owner, extra, "ScaledDown")
        self._count(owner, out)
        return out, again

    async def _replace_stuck_restores(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        owner: tuple[str, str],
        ready_ckpt: DynamoCheckpoint | None,
        out: ServiceOutcome,
    ) -> bool:
        """Replace the restore pods whose restore failed, or that no node took within the pending
        timeout (and look again when the next one's timeout runs out). Whether any was replaced."""
        again = False
        for pod in [p for p in self.pods.live(owner) if restore_failed(p)]:
            await self.pods.replace_failed_restore(obj, dgd, owner, pod, ready_ckpt)
            again = True
        for pod in self.pods.live(owner):
            stuck = unschedulable(pod) if start_mode(pod) == protocol.StartMode.RESTORE.value else None
            if stuck is None:
                continue
            left = self.ctx.settings.restore_pending_timeout_seconds - stuck[0]
            if left <= 0:
                await self.pods.replace_unschedulable_restore(obj, dgd, owner, pod, *stuck)
                again = True
            else:
                out.retry_after = min(out.retry_after or left, left)
        return again

    def _restorable(
        self,
        obj: Obj,
        owner: tuple[str, str],
        ready_ckpt: DynamoCheckpoint | None,
        out: ServiceOutcome,
        *,
        short: bool,
    ) -> tuple[DynamoCheckpoint | None, str]:
        """The Ready checkpoint new replicas restore from, and what they wait for instead ("" when
        nothing). While no Ready node fits the checkpoint but one that does is NotReady inside its node
        grace (or kept while failover is paused), new replicas wait for it; once none does, they start
        cold (the checkpoint None) and the service says why."""
        ctx = self.ctx
        compat = ready_ckpt.status.compatibility if ready_ckpt and ready_ckpt.status else None
        no_node, waits_for = None, ""
        if ready_ckpt is not None and ctx.compatible_nodes(compat) == 0:
            coming = ctx.compatible_nodes_in_grace(compat)
            if coming:
                waits_for = (
                    self._node_wait(owner, str(ready_ckpt.metadata.name), coming, out) if short else ""
                )
            else:
                # Level, not edge: the service stays Degraded for as long as no node can take a restore.
                no_node = (
                    f"service {owner[1]}: no Ready node matches checkpoint {ready_ckpt.metadata.name} "
                    f"(gpu.product={compat.gpu_product if compat else '?'}, "
                    f"cuda.driver.major={compat.cuda_driver_major if compat else '?'}, "
                    f"gpus>={compat.gpu_count if compat else '?'}); new replicas start cold"
                )
                out.degraded.append(no_node)
                ready_ckpt = None
        # The Event, though, is an edge: once when no node fits any more, not once per pod it makes cold.
        if event := ctx.failover.report(owner, NO_COMPATIBLE_NODE, no_node):
            ctx.recorder.record(obj, *event)
        # Noted so that a node coming back wakes the service (see Controller's node handler).
        ctx.failover.report(owner, WAITING_FOR_NODE, waits_for or None)
        return ready_ckpt, waits_for

    def _node_wait(
        self, owner: tuple[str, str], checkpoint: str, coming: dict[str, datetime], out: ServiceOutcome
    ) -> str:
        """Say that the service's new replicas wait for the `coming` nodes (-> when their grace ends), and
        look again when the first grace ends; what they wait for."""
        now = datetime.now(UTC)
        nodes = ", ".join(sorted(coming))
        ends = [when for when in coming.values() if when > now]
        until = (
            f"until their node grace ends at {max(ends).strftime('%Y-%m-%dT%H:%M:%SZ')}"
            if ends
            else "while failover is paused"
        )
        out.waiting.append(
            f"service {owner[1]}: new replicas wait for node(s) {nodes}, NotReady but fitting checkpoint "
            f"{checkpoint}, {until}; they start cold only if no node that fits is Ready by then"
        )
        if ends:
            later = (min(ends) - now).total_seconds() + 0.1
            out.retry_after = min(out.retry_after or later, later)
        return f"a node that fits checkpoint {checkpoint} ({nodes}: NotReady)"

    def _count(self, owner: tuple[str, str], out: ServiceOutcome) -> None:
        """The service's replicas as the pod cache has them now, and what failover says of them."""
        ctx = self.ctx
        namespace, graph = owner[0].split("/", 1)
        pods = [p for p in ctx.pods_of(namespace, graph, owner[1]) if pod_active(p)]
        out.replicas = len(pods)
        ready = {Meta(p).name for p in pods if pod_ready(p)}
        out.ready = len(ready)
        # A replacement just created is usually not in the pod cache yet: it still exists, and must stay
        # followed until Ready, or its observed-to-ready sample is lost.
        names = {Meta(p).name for p in pods}
        ctx.failover.track_ready(owner, ready, names | ctx.expectations.pending_creates(owner, names))
        recovering = ctx.failover.degraded(owner)
        if recovering:
            # Replacements held back by the wait for the checkpoint are waiting, not a fault of their own.
            (out.waiting if ctx.failover.held_back(owner) else out.degraded).append(recovering)
            out.degraded_reason = ctx.failover.cause(owner)
        problems, reason = service_problems(owner[1], pods)
        out.degraded += problems
        out.degraded_reason = out.degraded_reason or reason
        out.restored = sum(1 for p in pods if start_mode(p) == protocol.StartMode.RESTORE.value)
        out.cold = out.replicas - out.restored

    async def _release_service(self, obj: Obj, svc_name: str) -> None:
        """The service removed from the graph, or one the controller does not run: our pods for it go,
        nothing else does."""
        meta = Meta(obj)
        ns, name = meta.namespace, meta.name
        owner = (f"{ns}/{name}", svc_name)
        self.ctx.failover.forget_service(owner)
        self.refusals.current.pop(owner, None)
        pods = [p for p in self.ctx.pods_of(ns, name, svc_name) if not Meta(p).deleting]
        if not pods:
            return
        try:
            await self.pods.delete(obj, owner, pods, "ServiceReleased")
        except ApiError as e:
            if not refused(e):
                raise
            # Tried again on the next reconcile; a service no longer in the spec has no status to say it in.
            message = f"service {svc_name}: its pods could not be deleted ({refusal_text(e)})"
            if self.refusals.announce(obj, svc_name, cond.REQUEST_REJECTED, message):
                log.warning("the apiserver refused a delete", extra={"dgd": owner[0], "detail": message})
