"""Whether a worker pod is lost, with the node grace and the pause brake applied: the one judgement the
controller's own DGD workers (dynamo.worker_pods) and the Dynamo operator's pods (dynamo.operator_failover)
share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from dynamo_snapshot.controller.failover.losses import loss_cause
from dynamo_snapshot.kube import Obj


@dataclass(frozen=True)
class Judgement:
    """One worker pod looked at: lost (`cause`), still counted while its NotReady node's grace runs
    (`grace_ends`), or kept on that node because failover is paused (`kept`); all empty: it counts."""

    cause: str | None = None
    grace_ends: datetime | None = None
    kept: bool = False


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
