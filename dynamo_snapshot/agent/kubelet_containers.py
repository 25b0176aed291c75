"""A pod's main container as the kubelet runs it: found from the pod watch once it runs, and, for a
restore, attached once its placeholder says it waits in standby."""

from __future__ import annotations

import asyncio

from dynamo_snapshot.agent.authorize import Refused
from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.pod_container import RunningContainer, ended, running_container
from dynamo_snapshot.agent.pod_spec import workload_key
from dynamo_snapshot.agent.runtime.base import Workload
from dynamo_snapshot.agent.runtime.containerd import ContainerdRuntime
from dynamo_snapshot.agent.runtime.process_tree import INERT_PROGRAMS, inert_placeholder
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import PodView, still_live
from dynamo_snapshot.kube import Informer, Obj, object_key

__all__ = ["KubeletContainers"]

# How long a container without the standby variable is given to exec into an inert placeholder.
_INERT_WITHIN_S = 2.0
# How often the restore target's control dir is looked at for its standby file.
_STANDBY_POLL_S = 0.02


class KubeletContainers:
    """The kubelet's containers of this node's pods, through ``runtime``, as ``pods`` (the watch) shows
    them."""

    def __init__(self, runtime: ContainerdRuntime, pods: Informer) -> None:
        self.runtime = runtime
        self.pods = pods

    async def running(
        self, pod: Obj, within: float, spent: str | None = None, container: str | None = None
    ) -> RunningContainer:
        """The pod's main container (or ``container``) once the kubelet runs it (read from the watch
        cache); not ``spent`` (an id with or without the runtime's scheme)."""
        name = container or PodView(pod).main_name
        deadline = asyncio.get_running_loop().time() + within
        while True:
            latest = self.pods.get(object_key(pod)) or pod
            if not still_live(latest, pod):
                raise AgentError("the pod is being deleted")
            running = running_container(latest, container)
            if running is not None and (spent is None or _bare(running.container_id) != _bare(spent)):
                return running
            why = ended(latest, container)
            if why is not None and spent is None:
                raise AgentError(why)
            if asyncio.get_running_loop().time() > deadline:
                raise AgentError(f"container {name} did not start within {within:.0f}s")
            # Woken by the kubelet's next status of the pod (the watch), else in a second at the latest.
            await self.pods.next_change(object_key(pod), 1.0)

    async def attach(self, pod: Obj, within: float, container: str | None = None) -> Workload:
        """The pod's main container (or ``container``), attached once the kubelet runs it."""
        running = await self.running(pod, within, container=container)
        return await self.runtime.attach(workload_key(pod), running.container_id, image_id=running.image_id)

    async def attach_restore_target(
        self,
        pod: Obj,
        start_within: float,
        standby_within: float,
        spent: str | None = None,
        container: str | None = None,
        key: str | None = None,
    ) -> Workload:
        """The restore pod's main container (or ``container``, attached as ``key``; not the ``spent``
        one), once its placeholder says it waits in standby, or runs as an inert placeholder."""
        key = key or workload_key(pod)
        target = container or PodView(pod).main_name
        containers = self.runtime
        running = await self.running(pod, start_within, spent, target)
        workload = await containers.attach(key, running.container_id, image_id=running.image_id)
        env = containers.container_env(key)
        standby_env = any(env.get(name) == "1" for name in protocol.ENV_RESTORE_STANDBYS)
        # Without the standby variable only an inert placeholder is restored into (upstream's contract:
        # the producer runs one, e.g. `exec sleep infinity`); given a moment to exec into it.
        deadline = asyncio.get_running_loop().time() + (standby_within if standby_env else _INERT_WITHIN_S)
        while not (containers.standby(key) or inert_placeholder(containers.container_pid(key))):
            if asyncio.get_running_loop().time() > deadline:
                raise Refused(_not_in_standby(target, standby_env, standby_within))
            if ended(self.pods.get(object_key(pod)) or pod, target) is not None:
                raise AgentError(f"container {target} exited before the restore")
            # The standby file comes from the worker, not the watch: looked for often, it is cheap.
            await asyncio.sleep(_STANDBY_POLL_S)
        return workload


def _not_in_standby(target: str, standby_env: bool, standby_within: float) -> str:
    if not standby_env:
        return (
            f"container {target} is not in standby: it runs without {protocol.ENV_RESTORE_STANDBY}=1 and "
            f"not as an inert placeholder ({', '.join(sorted(INERT_PROGRAMS))} with no child), so its "
            "image's entrypoint may have cold-started the worker (the controller and the restore webhook set "
            "the variable on the restore pods they shape)"
        )
    return (
        f"container {target} is not in standby: no {protocol.FILE_RESTORE_STANDBY} or "
        f"{protocol.FILE_RESTORE_CONTEXT} in its control dir after {standby_within:.0f}s (its entrypoint "
        f"must wait for the restore when {protocol.ENV_RESTORE_STANDBY}=1: "
        "dynamo_snapshot.workload.run_standby, or Dynamo's maybe_run_restore_standby_mode; or exec an "
        "inert placeholder such as `sleep infinity`)"
    )


def _bare(container_id: str) -> str:
    """A container id without the runtime's scheme: the kubelet says ``containerd://<id>``, a restored
    workload and restored-container-ids the id alone."""
    return container_id.partition("://")[2] or container_id
