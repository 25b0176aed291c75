"""What a pod's status says, as the controller and the autoscaler both read it."""

from __future__ import annotations

from dynamo_snapshot.controller.runtime import Obj


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
