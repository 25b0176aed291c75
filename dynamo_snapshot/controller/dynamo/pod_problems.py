"""What the kubelet says is wrong with worker pods that are not Ready: an image that cannot be pulled, a
container that cannot be made from its spec, a worker that keeps exiting or runs out of memory. A service
with such pods is Degraded, in the kubelet's own words, rather than merely short of ready replicas."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from dynamo_snapshot.api.views import Meta, PodView
from dynamo_snapshot.kube import Obj
from dynamo_snapshot.kube.pods import pod_ready

__all__ = [
    "CONFIG_ERROR",
    "CONTAINER_START_FAILED",
    "CRASH_LOOP",
    "IMAGE_PULL_FAILED",
    "OOM_KILLED",
    "PodProblem",
    "pod_problem",
    "service_problems",
]

# The Degraded condition's reasons, one per kind of problem.
IMAGE_PULL_FAILED = "ImagePullFailed"
CONFIG_ERROR = "ConfigError"
CONTAINER_START_FAILED = "ContainerStartFailed"
CRASH_LOOP = "CrashLoop"
OOM_KILLED = "OOMKilled"

_WHAT = {
    IMAGE_PULL_FAILED: "its image cannot be pulled",
    CONFIG_ERROR: "its container cannot be created from its spec",
    CONTAINER_START_FAILED: "its container cannot be started",
    CRASH_LOOP: "its container keeps exiting",
    OOM_KILLED: "its container ran out of memory",
}

# A container's waiting reason, as the kubelet (and the CRI runtime through it) writes it.
_WAITING = {
    "ErrImagePull": IMAGE_PULL_FAILED,
    "ImagePullBackOff": IMAGE_PULL_FAILED,
    "InvalidImageName": IMAGE_PULL_FAILED,
    "ErrImageNeverPull": IMAGE_PULL_FAILED,
    "RegistryUnavailable": IMAGE_PULL_FAILED,
    "SignatureValidationFailed": IMAGE_PULL_FAILED,
    "CreateContainerConfigError": CONFIG_ERROR,
    "CreateContainerError": CONTAINER_START_FAILED,
    "RunContainerError": CONTAINER_START_FAILED,
    "PreCreateHookError": CONTAINER_START_FAILED,
    "PreStartHookError": CONTAINER_START_FAILED,
    "PostStartHookError": CONTAINER_START_FAILED,
    "CrashLoopBackOff": CRASH_LOOP,
}
# A terminated container's reason, where it did not exit by itself.
_TERMINATED = {
    "OOMKilled": OOM_KILLED,
    "StartError": CONTAINER_START_FAILED,
    "ContainerCannotRun": CONTAINER_START_FAILED,
}
_DETAIL_MAX = 300  # characters of the kubelet's message, per problem


@dataclass(frozen=True)
class PodProblem:
    reason: str  # one of the reasons above
    detail: str  # the container, the kubelet's reason and its message


def pod_problem(pod: Obj) -> PodProblem | None:
    """What keeps a pod that is not Ready from running its worker, as far as the kubelet says; None when
    it says nothing wrong (starting, or not scheduled yet: the scheduler's business, not a fault)."""
    if pod_ready(pod):
        return None
    view = PodView(pod)
    containers = [*view.init_container_statuses, *view.container_statuses]
    found = [p for c in containers if (p := _container_problem(c)) is not None]
    # A container that cannot start at all says more than one that exited and runs again.
    waiting = [p for p in found if p.reason in (IMAGE_PULL_FAILED, CONFIG_ERROR, CONTAINER_START_FAILED)]
    first = waiting or found
    return first[0] if first else None


def _container_problem(c: dict[str, Any]) -> PodProblem | None:
    name = c.get("name") or "?"
    restarts = int(c.get("restartCount") or 0)
    waiting = (c.get("state") or {}).get("waiting") or {}
    last = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated") or {}
    exited = _exit(last, restarts)
    reason = _WAITING.get(str(waiting.get("reason") or ""))
    if reason is not None:
        detail = f"container {name}: {waiting['reason']}: {_short(waiting.get('message'))}"
        return PodProblem(reason, detail + (f" ({exited})" if exited else ""))
    kind = _TERMINATED.get(str(last.get("reason") or ""))
    if kind is not None:
        return PodProblem(kind, f"container {name}: {exited}")
    if restarts and last and last.get("exitCode") not in (None, 0):
        return PodProblem(CRASH_LOOP, f"container {name}: {exited}")
    return None


def _exit(terminated: dict[str, Any], restarts: int) -> str:
    if not terminated:
        return ""
    said = f"last exit: {terminated.get('reason') or 'exited'}, exit code {terminated.get('exitCode')}"
    if terminated.get("message"):
        said += f": {_short(terminated['message'])}"
    return said + (f"; restarted {restarts} time(s)" if restarts else "")


def _short(message: Any) -> str:
    text = " ".join(str(message or "no message").split())
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."


def service_problems(service: str, pods: list[Obj]) -> tuple[list[str], str | None]:
    """The Degraded lines of a service's pods, one per kind of problem and container (the first pod's
    words, the others named), and the reason of the first; ([], None) when no pod has a problem."""
    grouped: dict[tuple[str, str], list[tuple[str, PodProblem]]] = defaultdict(list)
    for pod in sorted(pods, key=lambda p: Meta(p).name):
        problem = pod_problem(pod)
        if problem is not None:
            container = problem.detail.split(":", 1)[0]
            grouped[(problem.reason, container)].append((Meta(pod).name, problem))
    lines = []
    for (reason, _), found in grouped.items():
        names = [name for name, _ in found]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        lines.append(f"service {service}: {reason}: pod {shown}: {_WHAT[reason]} ({found[0][1].detail})")
    first = next(iter(grouped), None)
    return lines, first[0] if first is not None else None
