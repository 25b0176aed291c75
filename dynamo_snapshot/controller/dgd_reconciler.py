"""DynamoGraphDeployment reconcile: for every service, make the worker pods the spec asks for exist —
restored from a Ready checkpoint where the service has checkpointing enabled and one is Ready, cold-started
otherwise — or say why the service is not run, and report it in `status` and Events. Level-triggered:
everything is derived from the caches on every run. What the apiserver refuses (admission, a quota, a
field the CRD schema cannot check) becomes a condition and an Event, retried with backoff.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeGuard

from pydantic import ValidationError

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointPhase, DynamoCheckpoint
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.graphdeployment import DGDState, DynamoGraphDeployment, ServiceSpec
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.controller.batching import slow_start
from dynamo_snapshot.controller.checkpoint_reconciler import agent_verdict
from dynamo_snapshot.controller.context import PODS_CREATED, Context
from dynamo_snapshot.controller.failover import NO_COMPATIBLE_NODE, loss_cause, worker_lifetime
from dynamo_snapshot.controller.podspec import (
    auto_checkpoint_name,
    checkpoint_job_template,
    cold_start_pod,
    keep_off_nodes,
    owner_reference,
    pod_name_prefix,
    restore_pod,
    unsupported,
)
from dynamo_snapshot.kube import (
    NORMAL,
    WARNING,
    ApiError,
    Obj,
    Result,
    conflict_retry,
    is_already_exists,
    is_conflict,
    is_not_found,
)
from dynamo_snapshot.kube.kinds import CHECKPOINT, DGD, POD
from dynamo_snapshot.kube.pods import pod_active, pod_ready, unschedulable

log = logging.getLogger(__name__)
STATUS_MIN_INTERVAL = 1.0  # seconds between status writes of one DGD that carry no new generation
# A service whose writes the apiserver refuses is tried again after this long, doubling per refusal up to
# the cap (or at once when the DGD's spec changes): a quota lifted or a webhook fixed is noticed within a
# minute, and a refusal costs one request per retry, not one per informer event.
REFUSAL_BACKOFF_BASE = 1.0
REFUSAL_BACKOFF_CAP = 60.0
# 4xx answers a retry can change with nobody fixing anything: credentials since refreshed (401), a timeout
# (408), a conflict (409), throttling (429).
_TRANSIENT_4XX = frozenset({401, 408, 409, 429})


def refused(err: BaseException) -> TypeGuard[ApiError]:
    """Whether the apiserver refused a request for what it asked (admission, quota, validation, RBAC):
    sent again unchanged, it gets the same answer."""
    return isinstance(err, ApiError) and 400 <= err.status < 500 and err.status not in _TRANSIENT_4XX


def refusal_text(err: ApiError) -> str:
    return f"{err.status} {err.reason or 'refused'}: {err.message or 'no message'}"


@dataclass
class Refusal:
    """The apiserver's last refusal of a write for one service, and when to try again."""

    reason: str  # cond.POD_CREATE_REJECTED or cond.REQUEST_REJECTED
    message: str
    generation: int | None  # the DGD generation it was refused at: a new spec is tried at once
    attempts: int
    retry_at: float  # time.monotonic()
    # A refusal outside pod creation holds back the service's whole reconcile until retry_at; a refused
    # pod holds back only pod creation, so scale-down and failover bookkeeping go on.
    whole_service: bool = False


class _CreateHeldBack(Exception):
    """A replacement pod not created: the apiserver refused it, or an earlier refusal's backoff runs."""


@dataclass
class ServiceOutcome:
    """What one service's reconcile found, folded into the DGD's status and conditions."""

    replicas: int = 0
    ready: int = 0
    restored: int = 0
    cold: int = 0
    desired: int = 0
    checkpoint: dict[str, Any] | None = None
    waiting: list[str] = field(default_factory=list)  # why the service cannot make progress yet
    degraded: list[str] = field(default_factory=list)  # what is wrong right now
    checkpoint_ready: bool = True
    retry_after: float = 0.0  # look again after this long: paced replacements, a pending restore's timeout
    refusal: Refusal | None = None  # the apiserver refuses what the service needs written
    not_handled: str = ""  # why the controller does not run this service at all
    degraded_reason: str | None = None  # the Degraded condition's reason for what failover reports


def _mode(pod: Obj) -> str:
    return str(
        (pod["metadata"].get("labels") or {}).get(protocol.LABEL_START_MODE, protocol.StartMode.COLD.value)
    )


def _scale_down_order(pod: Obj) -> tuple[bool, str, str]:
    # Not-ready pods first (they serve nothing yet), then the newest; name breaks ties deterministically.
    return (pod_ready(pod), _neg(pod["metadata"].get("creationTimestamp") or ""), pod["metadata"]["name"])


def _neg(timestamp: str) -> str:
    # RFC 3339 timestamps sort as strings; invert the digits so newer sorts first in an ascending sort.
    return "".join(chr(ord("9") - ord(ch) + ord("0")) if ch.isdigit() else ch for ch in timestamp)


class DGDReconciler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        # In memory only: after a restart a refused write is tried again at once, and the DGD's conditions
        # keep its Warning Event from being repeated (see _announce).
        self.refusals: dict[tuple[str, str], Refusal] = {}
        self._announced: dict[tuple[str, str], tuple[str, str]] = {}

    async def reconcile(self, key: str) -> Result | None:
        ctx = self.ctx
        obj = ctx.dgds.get(key)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            self._forget(key)
            return None  # pods and Jobs carry ownerReferences: the garbage collector removes them
        namespace, name = key.split("/", 1)
        generation = obj["metadata"].get("generation")
        status: dict[str, Any] = dict(obj.get("status") or {})
        try:
            dgd = DynamoGraphDeployment.model_validate(obj)
        except ValidationError as e:
            msg = f"invalid spec, nothing changed: {validation_message(e)}"
            ctx.recorder.record(obj, WARNING, "InvalidSpec", msg)
            conds = cond.set_condition(
                status.get("conditions") or [], cond.DEGRADED, True, "InvalidSpec", msg, generation
            )
            await self._write_status(obj, {**status, "conditions": conds, "observedGeneration": generation})
            return None

        outcomes: dict[str, ServiceOutcome] = {}
        requeue = False
        services = dgd.spec.services or {}
        self._retry_changed_spec(key, generation)
        for svc_name, svc in services.items():
            why_not = unsupported(svc)
            if why_not is not None:
                await self._release_service(obj, svc_name)
                outcome = self._observed(obj, svc_name, svc, status)
                outcome.not_handled = f"service {svc_name} is not run: {why_not}"
                self._announce(obj, svc_name, cond.SERVICE_NOT_HANDLED, outcome.not_handled)
                outcomes[svc_name] = outcome
                continue
            outcome, again = await self._reconcile_guarded(obj, dgd, svc_name, svc, status)
            outcomes[svc_name] = outcome
            requeue = requeue or again
        # A removed service may have pods left, or only losses remembered (all its pods were lost).
        known = {p["metadata"]["labels"][protocol.LABEL_SERVICE] for p in ctx.pods_of(namespace, name)} | {
            owner[1] for owner in ctx.failover.owners(key)
        }
        for stale in known - set(outcomes):
            if stale not in services:
                await self._release_service(obj, stale)

        new_status = self._status(status, outcomes, generation)
        paced = min((o.retry_after for o in outcomes.values() if o.retry_after), default=0.0)
        wait = self._status_throttle(f"{namespace}/{name}", status, new_status)
        if wait > 0:
            return Result(requeue_after=min(wait, paced) if paced else wait)
        await self._write_status(obj, new_status)
        if paced:
            return Result(requeue_after=paced)
        # Pod creations show up through the pod informer; a requeue covers writes that were refused.
        return Result(requeue=True) if requeue else None

    def _status_throttle(self, key: str, old: dict[str, Any], new: dict[str, Any]) -> float:
        """Seconds to hold back a status write that only refreshes counts and conditions.

        A cold start of 10 pods turns Running one by one; writing status for each step costs the
        apiserver 3-5 writes per DGD for nothing a reader needs within a second. A new generation is
        always reported at once, so `observedGeneration` never lags a spec change.
        """
        if new == old or new.get("observedGeneration") != old.get("observedGeneration"):
            return 0.0
        last = self.ctx.status_written_at.get(key)
        if last is None:
            return 0.0
        return max(0.0, STATUS_MIN_INTERVAL - (time.monotonic() - last))

    # ------------------------------------------------------------------ refusals
    async def _reconcile_guarded(
        self, obj: Obj, dgd: DynamoGraphDeployment, svc_name: str, svc: ServiceSpec, status: dict[str, Any]
    ) -> tuple[ServiceOutcome, bool]:
        """`_reconcile_service`, with what the apiserver refuses turned into the outcome's refusal (and so
        into a condition and an Event) instead of an exception the work queue would log and retry at once.
        Transient errors (5xx, timeouts, throttling) still raise."""
        owner = (f"{obj['metadata']['namespace']}/{obj['metadata']['name']}", svc_name)
        held = self.refusals.get(owner)
        due = held is not None and held.retry_at <= time.monotonic()
        again = False
        if held is not None and held.whole_service and not due:
            out = self._observed(obj, svc_name, svc, status)
        else:
            try:
                out, again = await self._reconcile_service(obj, dgd, svc_name, svc, status)
                if due and self.refusals.get(owner) is held:
                    # Due for a retry and neither refused again nor retried (nothing needed creating):
                    # the refusal no longer stands.
                    self.refusals.pop(owner)
            except _CreateHeldBack:
                out = self._observed(obj, svc_name, svc, status)
            except ApiError as e:
                if not refused(e):
                    raise
                message = f"service {svc_name}: the apiserver refused a request ({refusal_text(e)})"
                self._refuse(obj, svc_name, cond.REQUEST_REJECTED, message, whole_service=True)
                out = self._observed(obj, svc_name, svc, status)
        refusal = self.refusals.get(owner)
        if refusal is not None and not refusal.whole_service and out.replicas >= out.desired:
            # Nothing left to create (a scale-down, or pods made some other way): nothing is refused.
            self.refusals.pop(owner)
            refusal = None
        if refusal is not None:
            out.refusal = refusal
            left = max(refusal.retry_at - time.monotonic(), 0.05)
            out.retry_after = min(out.retry_after or left, left)
        else:
            self._announced.pop(owner, None)
        return out, again

    def _observed(self, obj: Obj, svc_name: str, svc: ServiceSpec, status: dict[str, Any]) -> ServiceOutcome:
        """A service's outcome read off the caches alone, for a service not reconciled this time."""
        namespace, graph = obj["metadata"]["namespace"], obj["metadata"]["name"]
        pods = [p for p in self.ctx.pods_of(namespace, graph, svc_name) if pod_active(p)]
        restored = sum(1 for p in pods if _mode(p) == protocol.StartMode.RESTORE.value)
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

    def _held_back(self, owner: tuple[str, str]) -> Refusal | None:
        """The refusal whose backoff still holds back creating pods for the service, if any."""
        refusal = self.refusals.get(owner)
        return refusal if refusal is not None and refusal.retry_at > time.monotonic() else None

    def _refuse(
        self, obj: Obj, svc_name: str, reason: str, message: str, *, whole_service: bool = False
    ) -> Refusal:
        """Remember a refusal and when to try again; say it once (Event, log line without a traceback)."""
        owner = (f"{obj['metadata']['namespace']}/{obj['metadata']['name']}", svc_name)
        previous = self.refusals.get(owner)
        attempts = previous.attempts + 1 if previous is not None else 1
        delay = min(REFUSAL_BACKOFF_CAP, REFUSAL_BACKOFF_BASE * 2.0 ** min(attempts - 1, 32))
        message = f"{message}; retried with backoff"
        refusal = Refusal(
            reason,
            message,
            obj["metadata"].get("generation"),
            attempts,
            time.monotonic() + delay,
            whole_service,
        )
        self.refusals[owner] = refusal
        if self._announce(obj, svc_name, reason, message):
            log.warning(
                "the apiserver refused a write; retrying with backoff",
                extra={"dgd": owner[0], "service": svc_name, "reason": reason, "detail": message},
            )
        return refusal

    def _announce(self, obj: Obj, svc_name: str, reason: str, message: str) -> bool:
        """One Warning Event per state of a service: none while it stays in the state this one says, nor
        after a controller restart when the DGD's conditions say it already. Whether it was recorded."""
        owner = (f"{obj['metadata']['namespace']}/{obj['metadata']['name']}", svc_name)
        if self._announced.get(owner) == (reason, message):
            return False
        self._announced[owner] = (reason, message)
        conditions = (obj.get("status") or {}).get("conditions") or []
        if any(message in (c.get("message") or "") for c in conditions):
            return False
        self.ctx.recorder.record(obj, WARNING, reason, message)
        return True

    def _retry_changed_spec(self, key: str, generation: int | None) -> None:
        """A DGD whose spec changed since a refusal is tried again at once: the change may be the fix."""
        for owner in [o for o, r in self.refusals.items() if o[0] == key and r.generation != generation]:
            del self.refusals[owner]

    def _forget(self, key: str) -> None:
        """Drop what is remembered about DGD `key`, which is gone."""
        for owner in [o for o in self.refusals if o[0] == key]:
            del self.refusals[owner]
        for owner in [o for o in self._announced if o[0] == key]:
            del self._announced[owner]

    # ------------------------------------------------------------------ one service
    async def _reconcile_service(
        self, obj: Obj, dgd: DynamoGraphDeployment, svc_name: str, svc: ServiceSpec, status: dict[str, Any]
    ) -> tuple[ServiceOutcome, bool]:
        ctx = self.ctx
        namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        out = ServiceOutcome(desired=svc.replicas if svc.replicas is not None else 1)
        # A service without checkpointing runs cold-start pods only, scaled and replaced like any other's.
        checkpointed = svc.checkpoint is not None and svc.checkpoint.enabled
        ckpt = None
        if checkpointed:
            _, ckpt = await self._resolve_checkpoint(obj, dgd, svc_name, svc, status, out)
        ready_ckpt = ckpt if ckpt and ckpt.status and ckpt.status.phase == CheckpointPhase.READY else None
        ref_mode = svc.checkpoint is not None and checkpointed and bool(svc.checkpoint.checkpoint_ref)

        owner = (f"{namespace}/{name}", svc_name)
        again = False
        for pod in [p for p in self._live_pods(owner) if self._restore_failed(p)]:
            await self._replace_failed_restore(obj, dgd, owner, pod, ready_ckpt)
            again = True
        for pod in self._live_pods(owner):
            stuck = unschedulable(pod) if _mode(pod) == protocol.StartMode.RESTORE.value else None
            if stuck is None:
                continue
            left = ctx.settings.restore_pending_timeout_seconds - stuck[0]
            if left <= 0:
                await self._replace_unschedulable_restore(obj, dgd, owner, pod, *stuck)
                again = True
            else:
                out.retry_after = min(out.retry_after or left, left)
        await self._remove_lost(obj, owner)
        # Cache and expectations are read together, with no await in between: an informer event handled
        # during an await would otherwise move a pod out of the expectations before we count the cache.
        pods = self._live_pods(owner)
        count = len(pods) + len(
            ctx.expectations.pending_creates(owner, {p["metadata"]["name"] for p in pods})
        )

        compat = ready_ckpt.status.compatibility if ready_ckpt and ready_ckpt.status else None
        no_node = None
        if ready_ckpt is not None and ctx.compatible_nodes(compat) == 0:
            # Level, not edge: the service stays Degraded for as long as no node can take a restore.
            no_node = (
                f"service {svc_name}: no Ready node matches checkpoint {ready_ckpt.metadata.name} "
                f"(gpu.product={compat.gpu_product if compat else '?'}, "
                f"cuda.driver.major={compat.cuda_driver_major if compat else '?'}, "
                f"gpus>={compat.gpu_count if compat else '?'}); new replicas start cold"
            )
            out.degraded.append(no_node)
            ready_ckpt = None
        # The Event, though, is an edge: once when no node fits any more, not once per pod it makes cold.
        if event := ctx.failover.report(owner, NO_COMPATIBLE_NODE, no_node):
            ctx.recorder.record(obj, *event)
        # checkpointRef mode waits for its checkpoint (out.waiting says why) unless something is wrong
        # with it, in which case capacity by cold start beats none at all.
        creates = ready_ckpt is not None or not ref_mode or bool(out.degraded)
        # Losses are owed only as far as the service is short: the rest (absorbed by a scale-down) would
        # keep it Degraded and hold back others' tokens for ever. A service that waits keeps its losses, so
        # that once its checkpoint is Ready their replacements are paced like any other failover.
        ctx.failover.settle(owner, out.desired - count, waiting=not creates)
        if count < out.desired:
            missing = out.desired - count
            if creates:
                allowed, later = ctx.failover.allowance(owner, missing, out.desired)
                if allowed:
                    await self._create_pods(
                        obj, dgd, svc_name, owner, allowed, ready_ckpt, ctx.failover.avoid_nodes(owner)
                    )
                if later:
                    out.retry_after = min(out.retry_after or later, later)
                    out.degraded.append(
                        f"service {svc_name}: {missing - allowed} replacement(s) paced by the rate limit"
                    )
        elif count > out.desired:
            extra = sorted(pods, key=_scale_down_order)[: count - out.desired]
            await self._delete_pods(obj, owner, extra, "ScaledDown")

        pods = [p for p in ctx.pods_of(namespace, name, svc_name) if pod_active(p)]
        out.replicas = len(pods)
        ready = {p["metadata"]["name"] for p in pods if pod_ready(p)}
        out.ready = len(ready)
        # A replacement just created is usually not in the pod cache yet: it still exists, and must stay
        # followed until Ready, or its observed-to-ready sample is lost.
        names = {p["metadata"]["name"] for p in pods}
        ctx.failover.track_ready(owner, ready, names | ctx.expectations.pending_creates(owner, names))
        recovering = ctx.failover.degraded(owner)
        if recovering:
            # Replacements held back by the wait for the checkpoint are waiting, not a fault of their own.
            (out.waiting if ctx.failover.held_back(owner) else out.degraded).append(recovering)
            out.degraded_reason = ctx.failover.cause(owner)
        out.restored = sum(1 for p in pods if _mode(p) == protocol.StartMode.RESTORE.value)
        out.cold = out.replicas - out.restored
        return out, again

    async def _resolve_checkpoint(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        svc_name: str,
        svc: ServiceSpec,
        status: dict[str, Any],
        out: ServiceOutcome,
    ) -> tuple[Obj | None, DynamoCheckpoint | None]:
        """Find (checkpointRef) or find-or-create (Auto) the service's DynamoCheckpoint."""
        ctx = self.ctx
        namespace = dgd.metadata.namespace or ""
        cfg = svc.checkpoint
        assert cfg is not None
        previous = (status.get("checkpoints") or {}).get(svc_name) or {}
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
            identity = cfg.auto_identity
            if identity is None:
                out.checkpoint_ready = False
                return None, None
            identity_hash = compute_identity_hash(identity)
            if previous.get("identityHash") and previous["identityHash"] != identity_hash:
                ctx.recorder.record(
                    obj,
                    WARNING,
                    "IdentityChanged",
                    f"service {svc_name}: checkpoint identity changed from {previous['identityHash']} to "
                    f"{identity_hash}; running replicas are kept, "
                    "new replicas use the new checkpoint once Ready",
                )
            ckpt_obj = ctx.checkpoint_by_hash(namespace, identity_hash, obj["metadata"]["uid"])
            if ckpt_obj is None:
                ckpt_obj = await self._create_checkpoint(obj, dgd, svc_name, identity_hash)
        try:
            ckpt = DynamoCheckpoint.model_validate(ckpt_obj)
        except ValidationError as e:
            out.degraded.append(
                f"DynamoCheckpoint {ckpt_obj['metadata']['name']} is invalid: {validation_message(e)}"
            )
            out.checkpoint_ready = False
            return None, None
        phase = ckpt.status.phase if ckpt.status else None
        deleting = bool(ckpt_obj["metadata"].get("deletionTimestamp"))
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

    async def _create_checkpoint(
        self, obj: Obj, dgd: DynamoGraphDeployment, svc_name: str, identity_hash: str
    ) -> Obj:
        """The DGD's own checkpoint for `identity_hash`: controlled by the DGD and never shared with another
        DGD, so no deployment ever restores a process another one's worker started."""
        ctx = self.ctx
        namespace = dgd.metadata.namespace or ""
        svc = (dgd.spec.services or {})[svc_name]
        assert svc.checkpoint is not None
        assert svc.checkpoint.identity is not None
        name = auto_checkpoint_name(obj["metadata"]["name"], identity_hash, obj["metadata"]["uid"])
        body: Obj = {
            "apiVersion": CHECKPOINT.api_version,
            "kind": CHECKPOINT.kind,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {
                    protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
                    protocol.LABEL_CHECKPOINT_HASH: identity_hash,
                    protocol.LABEL_GRAPH: obj["metadata"]["name"],
                },
                "ownerReferences": [owner_reference(obj)],
            },
            "spec": {
                "identity": svc.checkpoint.identity.model_dump(by_alias=True, exclude_none=True, mode="json"),
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
        remembered = (namespace, identity_hash, obj["metadata"]["uid"])
        ctx.recent_checkpoints[remembered] = created["metadata"]["name"]
        return created

    # ------------------------------------------------------------------ pods
    def _live_pods(self, owner: tuple[str, str]) -> list[Obj]:
        """The service's pods that count as replicas: running or starting, and not being deleted by us."""
        namespace, graph = owner[0].split("/", 1)
        return [
            p
            for p in self.ctx.pods_of(namespace, graph, owner[1])
            if pod_active(p) and not self.ctx.expectations.pending_delete(owner, p["metadata"]["name"])
        ]

    def _restore_failed(self, pod: Obj) -> bool:
        if _mode(pod) != protocol.StartMode.RESTORE.value:
            return False
        verdict, _ = agent_verdict(
            pod, protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE
        )
        return verdict is protocol.SnapshotStatus.FAILED

    async def _create_pods(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        svc_name: str,
        owner: tuple[str, str],
        count: int,
        ckpt: DynamoCheckpoint | None,
        avoid: list[str],
    ) -> None:
        """Create `count` worker pods, preferably off the `avoid` nodes.

        A create the apiserver refuses stops the rest (see slow_start) and is remembered as the service's
        refusal; no pod is created for the service again until its backoff has run out.
        """
        ctx = self.ctx
        if self._held_back(owner) is not None:
            return
        mode = protocol.StartMode.RESTORE if ckpt is not None else protocol.StartMode.COLD
        created: list[str] = []
        tried: list[str] = []

        async def create_one() -> None:
            pod = (
                restore_pod(obj, dgd, svc_name, ckpt)
                if ckpt is not None
                else cold_start_pod(obj, dgd, svc_name)
            )
            ctx.keep_off_bad_nodes(pod["spec"], avoid)
            tried.append(pod["metadata"]["name"])
            ctx.expectations.expect_create(owner, pod["metadata"]["name"])
            try:
                await ctx.kube.create(POD, pod)
            except Exception:
                ctx.expectations.observed(owner, pod["metadata"]["name"])
                raise
            PODS_CREATED.labels(mode.value).inc()
            created.append(pod["metadata"]["name"])

        try:
            await slow_start(create_one, count)
        except ApiError as e:
            if not refused(e):
                raise
            # The apiserver names the pod it refused; each attempt's name is random, so the message would
            # differ on every retry and never read as the same state.
            text = refusal_text(e)
            for pod_name in tried:
                text = text.replace(pod_name, f"{pod_name_prefix(owner[0].split('/', 1)[1], svc_name)}-*")
            self._refuse(obj, svc_name, cond.POD_CREATE_REJECTED, f"service {svc_name}: pod refused ({text})")
        else:
            self.refusals.pop(owner, None)
        finally:
            # Every pod created replaces a pending loss first, also when a later create failed.
            ctx.failover.replaced(owner, created)
        if not created:
            return
        ctx.observe_scale_latency(owner[0], len(created))
        how = f"by restore from {ckpt.metadata.name}" if ckpt is not None else "by cold start"
        ctx.recorder.record(
            obj, NORMAL, "ScaledUp", f"service {svc_name}: created {len(created)} worker pod(s) {how}"
        )

    async def _remove_lost(self, obj: Obj, owner: tuple[str, str]) -> None:
        """Stop counting workers that failed, crash-loop or sit on a dead node, and delete them (at once:
        a pod on a dead node would otherwise stay Terminating until the node comes back).

        A NotReady or unreachable node's workers are lost only once its node grace has run out, and not
        while so many nodes are down at once that the control plane is the likelier fault (failover
        paused): until then they still count, and no replacement is made."""
        ctx = self.ctx
        namespace, graph = owner[0].split("/", 1)
        now = datetime.now(UTC)
        lost = []
        grace: dict[str, datetime] = {}
        kept: dict[str, str] = {}
        for pod in ctx.pods_of(namespace, graph, owner[1]):
            pname = pod["metadata"]["name"]
            if ctx.expectations.pending_delete(owner, pname):
                continue
            node_name = (pod.get("spec") or {}).get("nodeName")
            node = ctx.nodes.get(node_name) if node_name else None
            cause = loss_cause(pod, node)
            if cause is None:
                continue
            if cause == "node-not-ready" and node is not None and node_name:
                ends = ctx.node_grace_ends(node, now)
                if ends > now:
                    grace[node_name] = ends
                    continue
                if ctx.node_health().paused:
                    kept[pname] = node_name
                    continue
            if ctx.failover.observe(owner, pname, cause, node_name, worker_lifetime(pod, now)):
                ctx.recorder.record(
                    obj,
                    WARNING,
                    "WorkerLost",
                    f"service {owner[1]}: pod {pname} lost ({cause}, node {node_name or '-'}); "
                    f"{ctx.failover.replacing(owner)}",
                )
            lost.append(pod)
        paused = ctx.node_health().paused if kept else None
        for event in ctx.failover.review(owner, grace=grace, paused=paused, kept=kept):
            ctx.recorder.record(obj, *event)
        if lost:
            await self._delete_pods(obj, owner, lost, "LostWorkerRemoved", force=True)

    async def _delete_pods(
        self, obj: Obj, owner: tuple[str, str], pods: list[Obj], reason: str, *, force: bool = False
    ) -> None:
        for pod in pods:
            pname = pod["metadata"]["name"]
            self.ctx.expectations.expect_delete(owner, pname)
            try:
                await self.ctx.kube.delete(
                    POD,
                    pname,
                    pod["metadata"]["namespace"],
                    uid=pod["metadata"].get("uid"),
                    grace_period_seconds=0 if force else None,
                )
            except Exception as e:
                if not is_not_found(e):
                    raise
        names = ", ".join(p["metadata"]["name"] for p in pods)
        self.ctx.recorder.record(
            obj, NORMAL, reason, f"service {owner[1]}: deleted {len(pods)} pod(s): {names}"
        )

    async def _replace_failed_restore(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        owner: tuple[str, str],
        pod: Obj,
        ckpt: DynamoCheckpoint | None,
    ) -> None:
        """Swap a pod whose restore failed for a restore on another node (while the checkpoint is Ready,
        a compatible node it has not failed on exists, and the replica has attempts left), else for a
        cold start; count the failure against the checkpoint.

        Every step is idempotent (deterministic replacement name, set-like failure list), so a controller
        killed half-way finishes the swap on its next run without doubling anything.
        """
        ctx = self.ctx
        pname = pod["metadata"]["name"]
        annotations = pod["metadata"].get("annotations") or {}
        _, message = agent_verdict(
            pod, protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE
        )
        ckpt_name = annotations.get(protocol.ANNOTATION_RESTORE_FROM, "")
        node = (pod.get("spec") or {}).get("nodeName") or ""
        failed_on = sorted(
            {n for n in annotations.get(protocol.ANNOTATION_AVOID_NODES, "").split(",") if n} | {node} - {""}
        )
        compat = ckpt.status.compatibility if ckpt is not None and ckpt.status else None
        retry = None
        if (
            ckpt is not None
            and len(failed_on) < ctx.settings.restore_node_attempts
            and ctx.other_compatible_node(compat, set(failed_on))
        ):
            retry = restore_pod(obj, dgd, owner[1], ckpt, name=f"{pname}-r"[:63], replaces=pname)
            keep_off_nodes(retry["spec"], failed_on, required=True)
            retry["metadata"]["annotations"][protocol.ANNOTATION_AVOID_NODES] = ",".join(failed_on)
        if ckpt_name:
            # Before the swap deletes the pod: a controller killed in between sees the failed pod again
            # on its next run and records it then (the failure list is a set).
            await self._record_restore_failure(pod["metadata"]["namespace"], ckpt_name, pname)
        await self._swap_restore(
            obj,
            dgd,
            owner,
            pod,
            "RestoreFailed",
            f"service {owner[1]}: restore of pod {pname} from {ckpt_name or '?'} on node {node or '?'} "
            f"failed ({message or 'no reason given'})",
            retry,
        )

    async def _replace_unschedulable_restore(
        self, obj: Obj, dgd: DynamoGraphDeployment, owner: tuple[str, str], pod: Obj, waited: float, why: str
    ) -> None:
        """A restore pod no node can take (its compatibility or avoid-node affinity, or GPUs all taken
        where it fits) would hold a replica slot for ever: a cold start, which fits anywhere the service
        fits, replaces it. Not a restore failure: the checkpoint is not blamed."""
        await self._swap_restore(
            obj,
            dgd,
            owner,
            pod,
            "RestoreUnschedulable",
            f"service {owner[1]}: restore pod {pod['metadata']['name']} could not be scheduled for "
            f"{waited:.0f}s ({why or 'no reason given'})",
        )

    async def _swap_restore(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        owner: tuple[str, str],
        pod: Obj,
        reason: str,
        what_happened: str,
        retry: Obj | None = None,
    ) -> None:
        """Replace restore pod `pod` by `retry` (a restore elsewhere), else by a cold start, then delete it.

        The replacement exists before the pod goes, so the replica is never missing from the count, and is
        named after the pod, so a controller killed half-way finds it (see `_create_replacement`) instead
        of creating a second one.
        """
        pname = pod["metadata"]["name"]
        replacement = retry or cold_start_pod(obj, dgd, owner[1], name=f"{pname}-cold"[:63], replaces=pname)
        self.ctx.keep_off_bad_nodes(replacement["spec"], [])
        mode = protocol.StartMode.RESTORE if retry else protocol.StartMode.COLD
        then = "retrying the restore on another node as pod" if retry else "replaced by cold-start pod"
        await self._create_replacement(owner, replacement, mode)
        await self._delete_pods(obj, owner, [pod], "RestoreReplaced")
        self.ctx.recorder.record(
            obj, WARNING, reason, f"{what_happened}; {then} {replacement['metadata']['name']}"
        )

    async def _create_replacement(self, owner: tuple[str, str], pod: Obj, mode: protocol.StartMode) -> None:
        """Create a pod with a deterministic name; one that exists already (an earlier, interrupted
        attempt) counts as created.

        Raises _CreateHeldBack when the apiserver refuses it, or an earlier refusal's backoff still runs:
        the swap it is part of stops there, so the pod it would replace stays until a replacement exists.
        """
        ctx = self.ctx
        if self._held_back(owner) is not None:
            raise _CreateHeldBack
        ctx.expectations.expect_create(owner, pod["metadata"]["name"])
        try:
            await ctx.kube.create(POD, pod)
            PODS_CREATED.labels(mode.value).inc()
        except Exception as e:
            if is_already_exists(e):
                return
            ctx.expectations.observed(owner, pod["metadata"]["name"])
            obj = ctx.dgds.get(owner[0])
            if not refused(e):
                raise
            if obj is not None:
                what = f"service {owner[1]}: replacement pod {pod['metadata']['name']} refused"
                self._refuse(obj, owner[1], cond.POD_CREATE_REJECTED, f"{what} ({refusal_text(e)})")
            raise _CreateHeldBack from e
        self.refusals.pop(owner, None)

    async def _record_restore_failure(self, namespace: str, ckpt_name: str, pod_name: str) -> None:
        kube = self.ctx.kube

        async def add() -> None:
            try:
                fresh = await kube.get(CHECKPOINT, ckpt_name, namespace)
            except Exception as e:
                if is_not_found(e):
                    return
                raise
            failures = list((fresh.get("status") or {}).get("failedRestores") or [])
            if pod_name in failures:
                return
            failures = [*failures, pod_name][-20:]
            await kube.json_patch(
                CHECKPOINT,
                ckpt_name,
                [
                    {
                        "op": "test",
                        "path": "/metadata/resourceVersion",
                        "value": fresh["metadata"]["resourceVersion"],
                    },
                    {"op": "add", "path": "/status/failedRestores", "value": failures},
                ],
                namespace,
                subresource="status",
            )

        await conflict_retry(add)

    async def _release_service(self, obj: Obj, svc_name: str) -> None:
        """The service removed from the graph, or one the controller does not run: our pods for it go,
        nothing else does."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        owner = (f"{ns}/{name}", svc_name)
        self.ctx.failover.forget_service(owner)
        self.refusals.pop(owner, None)
        pods = [p for p in self.ctx.pods_of(ns, name, svc_name) if not p["metadata"].get("deletionTimestamp")]
        if not pods:
            return
        try:
            await self._delete_pods(obj, owner, pods, "ServiceReleased")
        except ApiError as e:
            if not refused(e):
                raise
            # Tried again on the next reconcile; a service no longer in the spec has no status to say it in.
            message = f"service {svc_name}: its pods could not be deleted ({refusal_text(e)})"
            if self._announce(obj, svc_name, cond.REQUEST_REJECTED, message):
                log.warning("the apiserver refused a delete", extra={"dgd": owner[0], "detail": message})

    # ------------------------------------------------------------------ status
    def _status(
        self, old: dict[str, Any], outcomes: dict[str, ServiceOutcome], generation: int | None
    ) -> dict[str, Any]:
        waiting = [w for o in outcomes.values() for w in o.waiting]
        degraded = [d for o in outcomes.values() for d in o.degraded]
        refusals = [o.refusal for o in outcomes.values() if o.refusal is not None]
        not_handled = [o.not_handled for o in outcomes.values() if o.not_handled]
        # Most telling first: what the apiserver refuses, then what is not run, then the rest.
        problems = [r.message for r in refusals] + not_handled + degraded
        short = [
            f"{s}: {o.ready}/{o.desired} ready"
            for s, o in outcomes.items()
            if o.ready < o.desired and not o.not_handled
        ]
        all_ready = not short and not problems
        ckpt_ready = all(o.checkpoint_ready for o in outcomes.values())
        conds: list[dict[str, Any]] = list(old.get("conditions") or [])
        if all_ready:
            ready_reason = "AllReplicasReady"
        elif not_handled:
            ready_reason = cond.SERVICE_NOT_HANDLED
        else:
            ready_reason = "ReplicasNotReady"
        conds = cond.set_condition(
            conds,
            cond.READY,
            all_ready,
            ready_reason,
            "all services have their desired ready replicas"
            if all_ready
            else "not ready: " + "; ".join(not_handled + short + [r.message for r in refusals] + degraded),
            generation,
        )
        conds = cond.set_condition(
            conds,
            cond.CHECKPOINT_READY,
            ckpt_ready,
            "CheckpointsReady" if ckpt_ready else "CheckpointNotReady",
            "every checkpointed service has a Ready checkpoint"
            if ckpt_ready
            else "; ".join(waiting + degraded) or "pending",
            generation,
        )
        # A service that is not run holds no other back: the rest may still be scaling.
        progressing = bool(short) and not refusals and not degraded
        conds = cond.set_condition(
            conds,
            cond.PROGRESSING,
            progressing,
            "ScalingReplicas" if progressing else "Stable",
            "; ".join(short + waiting) if progressing else "no change in progress",
            generation,
        )
        if refusals:
            degraded_reason = refusals[0].reason
        elif not_handled:
            degraded_reason = cond.SERVICE_NOT_HANDLED
        else:
            causes = [o.degraded_reason for o in outcomes.values() if o.degraded_reason]
            degraded_reason = (causes[0] if causes else "Degraded") if degraded else "Healthy"
        conds = cond.set_condition(
            conds,
            cond.DEGRADED,
            bool(problems),
            degraded_reason,
            "; ".join(problems) if problems else "no problem detected",
            generation,
        )
        state = DGDState.SUCCESSFUL if all_ready else DGDState.FAILED if problems else DGDState.PENDING
        return {
            **old,
            "observedGeneration": generation,
            "state": state.value,
            "conditions": conds,
            "services": {
                s: {
                    "replicas": o.replicas,
                    "readyReplicas": o.ready,
                    "restoredReplicas": o.restored,
                    "coldStartedReplicas": o.cold,
                }
                for s, o in outcomes.items()
            },
            "checkpoints": {s: o.checkpoint for s, o in outcomes.items() if o.checkpoint is not None},
        }

    async def _write_status(self, obj: Obj, status: dict[str, Any]) -> None:
        if status == (obj.get("status") or {}):
            return
        meta = obj["metadata"]
        key, rv = f"{meta['namespace']}/{meta['name']}", meta.get("resourceVersion")
        if rv is not None and self.ctx.status_written_over.get(key) == rv:
            # Performance (benchmarks/controller_scale.py): our previous status write has not reached the
            # cache yet, so this PUT would only earn a 409. The watch event of that write requeues this DGD
            # and the next run writes against the fresh object. (At 1,000 DGDs / 10,000 pods a cold start
            # made ~1,100 such doomed PUTs, each logged as a failed reconcile with a traceback.)
            return
        # Replace rather than merge: maps of services that disappeared must disappear from status too.
        body = {**obj, "status": status}
        try:
            await self.ctx.kube.replace_status(DGD, body)
        except Exception as e:
            if is_conflict(e):
                # Someone else changed the DGD since our cache saw it: the informer delivers that version,
                # which requeues this DGD, so a conflict here is routine, not a failed reconcile.
                log.debug("status write conflicted; the newer version requeues it", extra={"key": key})
                return
            if is_not_found(e):
                return
            if refused(e):
                # A status this controller wrote that the CRD refuses is a bug of ours, not the user's: say
                # it once per message, without a traceback per retry.
                message = f"the apiserver refused the DGD's status ({refusal_text(e)})"
                if self._announce(obj, "", "StatusRejected", message):
                    log.warning("status write refused", extra={"key": key, "detail": message})
                return
            raise
        self.ctx.status_written_at[key] = time.monotonic()
        if rv is not None:
            self.ctx.status_written_over[key] = rv
