"""A DGD's status: what each service's reconcile found folded into counts and conditions, and written
no more often than a reader needs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api.dynamo_views import GraphDeploymentView
from dynamo_snapshot.api.graphdeployment import DGDState
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.dynamo.refusals import Refusal, Refusals, refusal_text, refused
from dynamo_snapshot.kube import Obj, is_conflict, is_not_found

log = logging.getLogger(__name__)
STATUS_MIN_INTERVAL = 1.0  # seconds between status writes of one DGD that carry no new generation

Conditions = list[dict[str, Any]]


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


@dataclass
class _Summary:
    """The services' outcomes, gathered for the conditions."""

    waiting: list[str]
    degraded: list[str]
    refusals: list[Refusal]
    not_handled: list[str]
    # Most telling first: what the apiserver refuses, then what is not run, then the rest.
    problems: list[str]
    short: list[str]  # the services short of ready replicas: "name: ready/desired ready"
    all_ready: bool


def _summary(outcomes: dict[str, ServiceOutcome]) -> _Summary:
    refusals = [o.refusal for o in outcomes.values() if o.refusal is not None]
    not_handled = [o.not_handled for o in outcomes.values() if o.not_handled]
    degraded = [d for o in outcomes.values() for d in o.degraded]
    problems = [r.message for r in refusals] + not_handled + degraded
    short = [
        f"{s}: {o.ready}/{o.desired} ready"
        for s, o in outcomes.items()
        if o.ready < o.desired and not o.not_handled
    ]
    return _Summary(
        waiting=[w for o in outcomes.values() for w in o.waiting],
        degraded=degraded,
        refusals=refusals,
        not_handled=not_handled,
        problems=problems,
        short=short,
        all_ready=not short and not problems,
    )


def dgd_status(
    old: dict[str, Any], outcomes: dict[str, ServiceOutcome], generation: int | None
) -> dict[str, Any]:
    """The DGD's new status: `old` with the services' counts, checkpoints and conditions replaced."""
    summary = _summary(outcomes)
    conds: Conditions = list(old.get("conditions") or [])
    conds = _ready_conditions(conds, summary, outcomes, generation)
    conds = _health_conditions(conds, summary, outcomes, generation)
    if summary.all_ready:
        state = DGDState.SUCCESSFUL
    else:
        state = DGDState.FAILED if summary.problems else DGDState.PENDING
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


def _ready_conditions(
    conds: Conditions, summary: _Summary, outcomes: dict[str, ServiceOutcome], generation: int | None
) -> Conditions:
    """Ready and CheckpointReady."""
    if summary.all_ready:
        ready_reason = "AllReplicasReady"
    elif summary.not_handled:
        ready_reason = cond.SERVICE_NOT_HANDLED
    else:
        ready_reason = "ReplicasNotReady"
    not_ready = (
        summary.not_handled
        + summary.short
        + [r.message for r in summary.refusals]
        + summary.degraded
        + summary.waiting
    )
    conds = cond.set_condition(
        conds,
        cond.READY,
        summary.all_ready,
        ready_reason,
        "all services have their desired ready replicas"
        if summary.all_ready
        else "not ready: " + "; ".join(not_ready),
        generation,
    )
    ckpt_ready = all(o.checkpoint_ready for o in outcomes.values())
    return cond.set_condition(
        conds,
        cond.CHECKPOINT_READY,
        ckpt_ready,
        "CheckpointsReady" if ckpt_ready else "CheckpointNotReady",
        "every checkpointed service has a Ready checkpoint"
        if ckpt_ready
        else "; ".join(summary.waiting + summary.degraded) or "pending",
        generation,
    )


def _health_conditions(
    conds: Conditions, summary: _Summary, outcomes: dict[str, ServiceOutcome], generation: int | None
) -> Conditions:
    """Progressing and Degraded."""
    # A service that is not run holds no other back: the rest may still be scaling.
    progressing = bool(summary.short) and not summary.refusals and not summary.degraded
    conds = cond.set_condition(
        conds,
        cond.PROGRESSING,
        progressing,
        "ScalingReplicas" if progressing else "Stable",
        "; ".join(summary.short + summary.waiting) if progressing else "no change in progress",
        generation,
    )
    if summary.refusals:
        degraded_reason = summary.refusals[0].reason
    elif summary.not_handled:
        degraded_reason = cond.SERVICE_NOT_HANDLED
    else:
        causes = [o.degraded_reason for o in outcomes.values() if o.degraded_reason]
        degraded_reason = (causes[0] if causes else "Degraded") if summary.degraded else "Healthy"
    return cond.set_condition(
        conds,
        cond.DEGRADED,
        bool(summary.problems),
        degraded_reason,
        "; ".join(summary.problems) if summary.problems else "no problem detected",
        generation,
    )


def status_throttle(ctx: Context, key: str, old: dict[str, Any], new: dict[str, Any]) -> float:
    """Seconds to hold back a status write that only refreshes counts and conditions.

    A cold start of 10 pods turns Running one by one; writing status for each step costs the
    apiserver 3-5 writes per DGD for nothing a reader needs within a second. A new generation is
    always reported at once, so `observedGeneration` never lags a spec change.
    """
    if new == old or new.get("observedGeneration") != old.get("observedGeneration"):
        return 0.0
    last = ctx.status_written_at.get(key)
    if last is None:
        return 0.0
    return max(0.0, STATUS_MIN_INTERVAL - (time.monotonic() - last))


async def write_status(ctx: Context, refusals: Refusals, obj: Obj, status: dict[str, Any]) -> None:
    graph = GraphDeploymentView(obj)
    if status == graph.status:
        return
    key, rv = f"{graph.meta.namespace}/{graph.meta.name}", graph.meta.resource_version or None
    if rv is not None and ctx.status_written_over.get(key) == rv:
        # Performance (benchmarks/controller_scale.py): our previous status write has not reached the
        # cache yet, so this PUT would only earn a 409. The watch event of that write requeues this DGD
        # and the next run writes against the fresh object. (At 1,000 DGDs / 10,000 pods a cold start
        # made ~1,100 such doomed PUTs, each logged as a failed reconcile with a traceback.)
        return
    # Replace rather than merge: maps of services that disappeared must disappear from status too.
    body = {**obj, "status": status}
    try:
        await ctx.kube.replace_status(ctx.dgd_version.kind, ctx.dgd_version.stored(body))
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
            if refusals.announce(obj, "", "StatusRejected", message):
                log.warning("status write refused", extra={"key": key, "detail": message})
            return
        raise
    ctx.status_written_at[key] = time.monotonic()
    if rv is not None:
        ctx.status_written_over[key] = rv
