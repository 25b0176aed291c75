"""A node's health as worker failover reads it: whether a worker can live on it, whether it has failed (for
pausing failover and keeping new pods off it), and since when it has been unhealthy (the node grace counts
from then). Read off the Node's Ready condition and its unreachable/not-ready taints."""

from __future__ import annotations

from datetime import datetime

from dynamo_snapshot.api.conditions import parse_rfc3339
from dynamo_snapshot.api.views import NodeView
from dynamo_snapshot.kube import Obj

__all__ = ["node_down", "node_healthy", "unhealthy_since"]

_UNHEALTHY_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def node_healthy(node: Obj | None) -> bool:
    """A node a worker can live on: it exists, says Ready, and is not tainted unreachable/not-ready."""
    if node is None:
        return False
    view = NodeView(node)
    return view.ready == "True" and not any(t.get("key") in _UNHEALTHY_TAINTS for t in view.taints)


def node_down(node: Obj) -> bool:
    """A node that has failed, as far as pausing failover and keeping new pods off it go: its Ready
    condition is False or Unknown, or it is tainted unreachable. A node that has not reported Ready yet
    (just registered) or still carries the not-ready taint for a moment after turning Ready is not: the
    scheduler keeps pods off a tainted node by itself, and a required NotIn would keep them off for good."""
    view = NodeView(node)
    if view.ready not in (None, "True"):
        return True
    return any(t.get("key") == "node.kubernetes.io/unreachable" for t in view.taints)


def unhealthy_since(node: Obj) -> datetime | None:
    """When the node stopped being healthy, by its own record: its Ready condition's lastTransitionTime
    while that is not True, else when the first unreachable/not-ready taint was added; None when it
    says neither (or is healthy)."""
    view = NodeView(node)
    ready = view.condition("Ready")
    stamps = [t.get("timeAdded") for t in view.taints if t.get("key") in _UNHEALTHY_TAINTS]
    if ready and view.ready != "True":
        stamps = [ready.get("lastTransitionTime")]
    times = []
    for stamp in stamps:
        try:
            times.append(parse_rfc3339(str(stamp or "")))
        except ValueError:
            continue
    return min(times, default=None)
