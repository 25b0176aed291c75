"""What the agent reads from a pod: its workload key, the containers a restore goes into, its
per-container annotations (as the controller writes and reads them), and its main container as a
workload to launch."""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.runtime.base import WorkloadSpec
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import Meta, PodView
from dynamo_snapshot.kube import Obj

__all__ = [
    "MAIN",
    "Destination",
    "annotation",
    "declares_control_dir",
    "destinations",
    "per_target",
    "pod_env",
    "restore_attempts",
    "status",
    "workload_key",
    "workload_spec",
]

MAIN = protocol.DEFAULT_TARGET_CONTAINER
Status = protocol.SnapshotStatus


def workload_key(pod: Obj) -> str:
    meta = Meta(pod)
    return f"{meta.namespace}_{meta.name}_{meta.uid[:8]}"


@dataclass(frozen=True)
class Destination:
    """One container a restore goes into: its name, the runtime's key of the worker restored there, and
    whether other containers of the pod take the same restore (the pod's nvidia.com/Restored condition
    then speaks for all of them, said once every one has ended)."""

    container: str
    key: str
    shared: bool = False

    @property
    def annotated(self) -> str | None:
        """The container whose status annotations say this restore: its own where several take it; else
        None, the pod's main container's (what the controller reads, also where the pod lacks the
        container and the restore is refused)."""
        return self.container if self.shared else None


def destinations(pod: Obj) -> tuple[Destination, ...]:
    """The containers the pod asks a restore into (restore-container-map's destinations, else its main
    container); the first keeps the pod's workload key, the others add their container's name to it."""
    targets = PodView(pod).restore_targets
    base = workload_key(pod)
    shared = len(targets) > 1
    return tuple(
        Destination(name, base if i == 0 else f"{base}_{name}", shared) for i, name in enumerate(targets)
    )


def per_target(pod: Obj, key: str, container: str | None = None) -> str:
    """The name of annotation ``key`` of ``container``, else of the pod's main container (the one
    checkpointed or restored)."""
    return protocol.per_container(key, container or PodView(pod).main_name)


def annotation(pod: Obj, key: str, container: str | None = None) -> str | None:
    """The main container's (or ``container``'s) annotation ``key``."""
    return Meta(pod).annotations.get(per_target(pod, key, container))


def restore_attempts(pod: Obj) -> int:
    """Restores into the pod started so far (by any agent process)."""
    raw = Meta(pod).annotations.get(protocol.ANNOTATION_RESTORE_ATTEMPTS)
    if raw is None:
        return 0
    try:
        return max(0, int(raw))
    except ValueError:
        # An unreadable count is taken as used up rather than as a fresh start.
        return protocol.RESTORE_ATTEMPTS_MAX


def status(pod: Obj, key: str, container: str | None = None) -> Status | None:
    """The checkpoint or restore status annotation ``key`` of the main container (or ``container``); an
    unreadable one counts as failed."""
    raw = annotation(pod, key, container)
    try:
        return Status.parse(raw) if raw else None
    except ValueError:
        return Status.FAILED


def _main_container(pod: Obj, container: str | None = None) -> Obj:
    view = PodView(pod)
    if container is None:
        main = view.main_container
    else:
        named = view.container(container)
        main = None if named is None else named.spec
    if main is None:
        raise AgentError(f"pod has no container {container or view.main_name}")
    return dict(main)


def declares_control_dir(pod: Obj) -> bool:
    """Whether the pod's main container is given the snapshot control directory (what a capture's source
    and a restore pod get; a cold start never does)."""
    try:
        main = _main_container(pod)
    except AgentError:
        return False
    return any(e.get("name") in protocol.ENV_CONTROL_DIRS for e in main.get("env") or [])


def pod_env(pod: Obj, container: str | None = None) -> dict[str, str]:
    """The main container's (or ``container``'s) environment as far as the pod spec says it (literal
    values), with the pod's identity: what a worker the agent launches gets, and a restore's env where no
    kubelet resolved one."""
    main = _main_container(pod, container)
    env = {e["name"]: str(e.get("value", "")) for e in main.get("env") or [] if "value" in e}
    meta = Meta(pod)
    env.update(POD_NAME=meta.name, POD_NAMESPACE=meta.namespace, POD_UID=meta.uid)
    return env


def workload_spec(pod: Obj, key: str, *, snapshot: bool, container: str | None = None) -> WorkloadSpec:
    """The pod's main container (or ``container``), to launch. The caller says whether it is a checkpoint
    source, the only launched worker told where its control dir is (a restore target is restored, never
    launched)."""
    main = _main_container(pod, container)
    command = [*(main.get("command") or []), *(main.get("args") or [])]
    if not command:
        raise AgentError("local mode needs the main container's command: images are not run here")
    return WorkloadSpec(
        key=key,
        command=[str(c) for c in command],
        env=pod_env(pod, container),
        workdir=main.get("workingDir"),
        snapshot=snapshot,
    )
