"""Whether a worker pod is lost, with the node grace and the pause brake applied: the one judgement the
controller's own DGD workers (dynamo.worker_pods) and the Dynamo operator's pods (dynamo.operator_failover)
share; and how long a worker lived, which tells an early death (crash-loop backoff) from a late one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import parse_rfc3339
from dynamo_snapshot.api.views import PodView
from dynamo_snapshot.controller.failover.node_state import node_healthy
from dynamo_snapshot.controller.podspec import MAIN_CONTAINER
from dynamo_snapshot.kube import Obj

CRASH_LOOP_RESTARTS = 3


@dataclass(frozen=True)
class Judgement:
    """One worker pod looked at: lost (`cause`), still counted while its NotReady node's grace runs
    (`grace_ends`), or kept on that node because failover is paused (`kept`); all empty: it counts."""

    cause: str | None = None
    grace_ends: datetime | None = None
    kept: bool = False


def worker_lifetime(pod: Obj, now: datetime) -> float | None:
    """Seconds the pod has lived, from its status.startTime (the kubelet took it on; a restore pod's
    worker runs within seconds of it), else its creationTimestamp; None when it carries neither."""
    view = PodView(pod)
    for stamp in (view.start_time, view.meta.creation_timestamp):
        try:
            return max(0.0, (now - parse_rfc3339(stamp)).total_seconds())
        except ValueError:
            continue
    return None


def crash_looping(pod: Obj) -> bool:
    for status in PodView(pod).container_statuses:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if (
            waiting.get("reason") == "CrashLoopBackOff"
            or int(status.get("restartCount") or 0) >= CRASH_LOOP_RESTARTS
        ):
            return True
    return False


def loss_cause(pod: Obj, node: Obj | None) -> str | None:
    """Why a (not deleted by us) pod no longer counts as a worker; None while it does."""
    view = PodView(pod)
    if view.meta.annotations.get(protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, MAIN_CONTAINER)):
        return "process-exited"  # reported by the node agent where no kubelet watches the worker
    if view.phase == "Failed":
        return "evicted" if view.reason in ("Evicted", "Preempting", "Terminated") else "pod-failed"
    if crash_looping(pod):
        return "crash-loop"
    if view.node_name:
        if node is None:
            return "node-deleted"
        if not node_healthy(node):
            return "node-not-ready"
    return None


def judge_loss(
    pod: Obj,
    node: Obj | None,
    now: datetime,
    grace_ends: Callable[[Obj, datetime], datetime],
    paused: bool,
) -> Judgement:
    """`loss_cause`, except that a worker on a NotReady or unreachable node is lost only once
    `grace_ends(node, now)` has passed, and not at all while failover is `paused` (so many nodes are down
    at once that the control plane is the likelier fault than the nodes)."""
    cause = loss_cause(pod, node)
    if cause == "node-not-ready" and node is not None:
        ends = grace_ends(node, now)
        if ends > now:
            return Judgement(grace_ends=ends)
        if paused:
            return Judgement(kept=True)
    return Judgement(cause=cause)
