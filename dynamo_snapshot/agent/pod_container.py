"""What the kubelet says about a pod's main container (``status.containerStatuses``), for the agent on a
kubelet node: which container to checkpoint or restore into, and whether it has ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamo_snapshot.api.views import PodView

Obj = dict[str, Any]


@dataclass(frozen=True)
class RunningContainer:
    container_id: str  # "containerd://<id>", as the kubelet reports it
    image_id: str | None  # the image the container runs, by digest where the runtime reports one
    restart_count: int


def main_status(pod: Obj, container: str | None = None) -> Obj | None:
    """The status of ``container``, else of the pod's main container (``PodView.main_status``)."""
    view = PodView(pod)
    return view.main_status if container is None else view.status_of(container)


def running_container(pod: Obj, container: str | None = None) -> RunningContainer | None:
    status = main_status(pod, container)
    if status is None or "running" not in (status.get("state") or {}) or not status.get("containerID"):
        return None
    return RunningContainer(
        str(status["containerID"]), status.get("imageID") or None, int(status.get("restartCount") or 0)
    )


def ended(pod: Obj, container: str | None = None) -> str | None:
    """Why the main container (or ``container``) is not running any more (None while it waits to start
    or runs)."""
    status = main_status(pod, container) or {}
    terminated = (status.get("state") or {}).get("terminated")
    if not terminated:
        return None
    return (
        f"container {status.get('name')} exited with code {terminated.get('exitCode')}"
        f" ({terminated.get('reason') or 'no reason given'})"
    )
