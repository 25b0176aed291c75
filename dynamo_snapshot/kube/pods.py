"""Worker pods as the controller and the autoscaler both read them: a graph service's pods from the pod
cache (by the graph and service labels of ``api.protocol``, as ``kinds`` names the resources), and what a
pod's status says."""

from __future__ import annotations

from datetime import UTC, datetime

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import parse_rfc3339
from dynamo_snapshot.kube.informer import Informer
from dynamo_snapshot.kube.kube import Obj


def pods_of(pods: Informer, namespace: str, graph: str, service: str | None = None) -> list[Obj]:
    """The pods of graph `graph` in `namespace` (of its service `service` only, when given), from a pod
    informer that indexes the graph label."""
    found = [p for p in pods.by_label(protocol.LABEL_GRAPH, graph) if p["metadata"]["namespace"] == namespace]
    if service is not None:
        found = [p for p in found if p["metadata"].get("labels", {}).get(protocol.LABEL_SERVICE) == service]
    return found


def pod_active(pod: Obj) -> bool:
    """Not being deleted and not finished: it holds (or will hold) a GPU."""
    return not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get("phase") not in (
        "Succeeded",
        "Failed",
    )


def pod_ready(pod: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions") or []
    )


def unschedulable(pod: Obj, now: datetime | None = None) -> tuple[float, str] | None:
    """For a pod the scheduler cannot place: for how many seconds, and the scheduler's message."""
    status = pod.get("status") or {}
    if status.get("phase") != "Pending":
        return None
    for c in status.get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            try:
                since = parse_rfc3339(c.get("lastTransitionTime") or "")
            except ValueError:
                return 0.0, str(c.get("message") or "")
            elapsed = ((now or datetime.now(UTC)) - since).total_seconds()
            return max(0.0, elapsed), str(c.get("message") or "")
    return None
