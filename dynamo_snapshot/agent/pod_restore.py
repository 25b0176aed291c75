"""A restore into one pod, from its status on: into each container the pod names as a destination
(``pod_spec.destinations``: restore-container-map's, else the main container), each on its own, with its
own status annotations and its own worker; where several take it, the pod's nvidia.com/Restored condition
is said once over all of them (RestoreSucceeded, RestorePartiallySucceeded, RestoreFailed).

A finished restore is watched again, a failed one left alone, one cut short cleared and started again
(unless that keeps happening). The grant is read once for the pod and holds for every destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dynamo_snapshot.agent.authorize import (
    Refused,
    RestoreGrant,
    capture_checkpoint_name,
    name_to_restore,
    restore_grant,
    snapshot_to_restore,
)
from dynamo_snapshot.agent.config import TimeoutSettings
from dynamo_snapshot.agent.errors import AgentError, Incompatible
from dynamo_snapshot.agent.executor import Executor, RestoreOutcome
from dynamo_snapshot.agent.kubelet_containers import KubeletContainers
from dynamo_snapshot.agent.metrics import PHASE_SECONDS
from dynamo_snapshot.agent.pod_container import running_container
from dynamo_snapshot.agent.pod_reports import PodReporter, restored_container_ids
from dynamo_snapshot.agent.pod_spec import (
    Destination,
    annotation,
    destinations,
    pod_env,
    restore_attempts,
    status,
)
from dynamo_snapshot.agent.runtime.base import Runtime, Workload, WorkloadRuntimeError
from dynamo_snapshot.agent.sentinels import write_sentinel
from dynamo_snapshot.agent.timings import AWAIT_CONTAINER_PHASE
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.restore_outcome import REOPENED_MESSAGE, skip_compat_check
from dynamo_snapshot.api.views import Meta, PodSnapshotView, PodView, still_live
from dynamo_snapshot.kube import Informer, Kube, Obj, object_key
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from dynamo_snapshot.kube.until_written import get_or_none

__all__ = ["PodRestore", "reopens_refused_restore"]

log = logging.getLogger(__name__)

# What the restore's Event adds about where the artifact was read (RestoreOutcome.source).
_SOURCE_NOTE = {"cache": " (node cache)", "object-store": " (fetched from the object store)"}
Status = protocol.SnapshotStatus
Supervise = Callable[[Obj, Workload, Destination], Awaitable[None]]


@dataclass(frozen=True)
class _RestoreTarget:
    """What the restore container tells the restore: its image, its GPUs, its environment."""

    image_id: str | None
    visible_gpus: tuple[str, ...] | None
    env: dict[str, str]


def reopens_refused_restore(pod: Obj, container: str | None = None) -> bool:
    """A restore (into ``container``, else the main container) refused as incompatible whose pod has
    since asked to skip the compatibility checks: it is attempted again in place (the refusal came
    before anything was read or started). Any other failed restore needs a new pod."""
    view = PodView(pod)
    refused = view.condition(protocol.POD_CONDITION_RESTORED).get("reason")
    return (
        status(pod, protocol.ANNOTATION_RESTORE_STATUS, container) is Status.FAILED
        and refused == protocol.RestoredReason.INCOMPATIBLE
        and skip_compat_check(view.meta.annotations)
    )


class PodRestore:
    """The restores into this node's pods."""

    def __init__(
        self,
        kube: Kube,
        executor: Executor,
        runtime: Runtime,
        kubelet: KubeletContainers | None,
        pods: Informer,
        reports: PodReporter,
        supervise: Supervise,
    ) -> None:
        self.kube = kube
        self.executor = executor
        self.runtime = runtime
        self.kubelet = kubelet
        self.pods = pods
        self.reports = reports
        self.supervise = supervise
        self.timeouts: TimeoutSettings = executor.config.timeouts
        # Pods whose restore this process marked running: a retry after an unexpected error resumes
        # them, where a "running" left by an earlier agent process means that process died mid-restore.
        self._restoring: set[str] = set()
        # Pod UID -> the runtime keys of the workloads restored into it (its destinations'), to stop with
        # the pod whatever its annotations say by then.
        self._keys: dict[str, set[str]] = {}
        # Pod UID -> container -> the id a replenishment restored into ("" where it failed; None while
        # it runs): the last of the pod's replenishments in flight concludes its condition.
        self._renewing: dict[str, dict[str, str | None]] = {}

    def forget(self, uid: str) -> None:
        self._restoring.discard(uid)
        self._keys.pop(uid, None)
        self._renewing.pop(uid, None)

    def keys(self, pod: Obj) -> list[str]:
        """The runtime keys of what was, or may have been, restored into the pod."""
        known = self._keys.get(Meta(pod).uid, set())
        return sorted(known | {dest.key for dest in destinations(pod)})

    async def restore(self, pod: Obj) -> None:
        """Restore into each of the pod's destinations that needs it, say the pod's condition over all
        of them where several take it, then watch every worker restored there."""
        dests = destinations(pod)
        self._keys.setdefault(Meta(pod).uid, set()).update(dest.key for dest in dests)
        workloads: dict[Destination, Workload | None] = {}
        pending: list[tuple[Destination, str | None]] = []
        gone: list[Destination] = []
        for dest in dests:
            state = status(pod, protocol.ANNOTATION_RESTORE_STATUS, dest.annotated)
            spent = await self._retake_container(pod, state, dest)
            if state is Status.COMPLETED:
                found = await self._find_restored(pod, dest)
                if found is not None:
                    workloads[dest] = found
                else:
                    gone.append(dest)
            elif state is Status.FAILED and not reopens_refused_restore(pod, dest.annotated):
                continue  # a failed restore was cleaned up when it failed
            elif state is not Status.RUNNING or await self._clear_cut_short(pod, dest):
                if state is Status.FAILED:
                    self.reports.event(pod, "RestoreCompatibilityCheckSkipped", REOPENED_MESSAGE)
                pending.append((dest, spent))
        if pending:
            # One cut short while it replenished (an agent restart) goes on as such.
            was = PodView(pod).condition(protocol.POD_CONDITION_RESTORED).get("reason")
            restored = await self._restore_pending(
                pod, pending, replenishing=was == protocol.RestoredReason.REPLENISHING
            )
            workloads.update(restored)
            if dests[0].shared:
                ids = {
                    dest.container: workload.container_id
                    for dest, workload in restored.items()
                    if workload is not None and workload.container_id
                }
                await self.reports.conclude(pod, dests, ids)
        kept = [self._keep(pod, dest, w) for dest, w in workloads.items() if w is not None]
        kept += [self._keep(pod, dest, None) for dest in gone if dest.shared]
        await asyncio.gather(*kept)

    async def _keep(self, pod: Obj, dest: Destination, workload: Workload | None) -> None:
        """Watch the worker restored into ``dest`` (None: already gone). Where other containers of the
        pod took the same restore (Dynamo's engines), one whose worker died is restored again into the
        container the kubelet starts in its place, as long as the pod was restored whole."""
        while True:
            if workload is not None:
                await self.supervise(pod, workload, dest)
                if not dest.shared:
                    return
                spent: str | None = workload.container_id
            else:
                spent = self.reports.restored_id(pod, dest)
            if spent is None or self.kubelet is None:
                return
            workload = await self._replenish(pod, dest, spent)
            if workload is None:
                return

    async def _replenish(self, pod: Obj, dest: Destination, spent: str) -> Workload | None:
        """Restore again into ``dest``'s replacement container (not ``spent``), its siblings left as
        they run, the pod's condition RestoreReplenishing meanwhile and said over all of them after; the
        worker restored there, None where the pod is not restored whole, no replacement comes, or the
        restore failed (said)."""
        assert self.kubelet is not None
        latest = self.pods.get(object_key(pod))
        if latest is None or not still_live(latest, pod):
            return None
        reason = PodView(latest).condition(protocol.POD_CONDITION_RESTORED).get("reason")
        if reason not in (protocol.RestoredReason.SUCCEEDED, protocol.RestoredReason.REPLENISHING):
            return None  # a partial or failed restore is final: the pod is made anew
        try:
            await self.kubelet.running(
                latest, self.timeouts.container_start_timeout_seconds, spent, dest.container
            )
        except AgentError as e:
            log.info("no replacement to restore into", extra={"pod": dest.key, "detail": str(e)})
            return None
        latest = self.pods.get(object_key(pod)) or latest
        await self.reports.clear_exit(latest, dest)
        uid = Meta(pod).uid
        renewing = self._renewing.setdefault(uid, {})
        renewing[dest.container] = None
        workload: Workload | None = None
        try:
            workload = (await self._restore_pending(latest, [(dest, spent)], replenishing=True)).get(dest)
        finally:
            renewing[dest.container] = (workload.container_id or "") if workload is not None else ""
        # The last of the pod's replenishments in flight says the condition over all of them.
        if all(renewed is not None for renewed in renewing.values()):
            ids = {name: renewed for name, renewed in renewing.items() if renewed}
            self._renewing.pop(uid, None)
            await self.reports.conclude(self.pods.get(object_key(pod)) or latest, destinations(latest), ids)
        return workload

    async def _restore_pending(
        self, pod: Obj, pending: list[tuple[Destination, str | None]], *, replenishing: bool = False
    ) -> dict[Destination, Workload | None]:
        """The restores into ``pending`` destinations (with the container a cut-short restore left in
        each, or the one a replaced container ran), side by side under one grant; the worker each
        restore left (None where it failed, said)."""
        try:
            grant = await self._restore_grant(pod)
            missing = [dest.container for dest, _ in pending if dest.container not in grant.destinations]
            if missing:
                raise Refused(f"container {missing[0]} is not a destination of this restore")
        except Refused as e:
            for dest, _ in pending:
                await self.reports.refuse(pod, str(e), dest)
            return {}
        attempts = restore_attempts(pod)
        # Written before the running status: where it raises, the pod is dispatched anew without one, and
        # no restore is taken for cut short.
        if replenishing:
            names = ", ".join(dest.container for dest, _ in pending)
            await self.reports.set_restored(
                pod,
                protocol.RestoredReason.REPLENISHING,
                f"restoring {names} again from {grant.checkpoint_name}: the kubelet replaced the container",
            )
        else:
            await self.reports.set_restored(
                pod, protocol.RestoredReason.IN_PROGRESS, f"restoring from {grant.checkpoint_name}"
            )
        for dest, _ in pending:
            await self.reports.report(
                pod,
                protocol.ANNOTATION_RESTORE_STATUS,
                protocol.ANNOTATION_RESTORE_MESSAGE,
                Status.RUNNING,
                "restoring",
                extra={protocol.ANNOTATION_RESTORE_ATTEMPTS: str(attempts + 1)},
                dest=dest,
            )
        self._restoring.add(Meta(pod).uid)
        if self.kubelet is not None:
            # The artifact is read and hashed while the kubelet starts the pod's containers.
            self.executor.check_ahead(grant.artifact_key, grant.manifest_digest)
        done = await asyncio.gather(*(self._restore_into(pod, grant, dest, spent) for dest, spent in pending))
        return {dest: workload for (dest, _), workload in zip(pending, done, strict=True)}

    async def _restore_into(
        self, pod: Obj, grant: RestoreGrant, dest: Destination, spent: str | None
    ) -> Workload | None:
        """One destination's restore, reported on the pod; its worker, None where it failed."""
        # The time until the kubelet runs the restore pod's container in standby: a restore in a pod pays
        # it and a restore as a process does not, so it is reported beside the executor's phases.
        waiting = time.monotonic()
        target = await self._restore_target(pod, spent, dest)
        if target is None:
            return None
        awaited = time.monotonic() - waiting
        PHASE_SECONDS.labels("restore", AWAIT_CONTAINER_PHASE).observe(awaited)
        outcome = await self._run_restore(pod, grant, target, dest)
        if outcome is None:
            return None
        timings = json.dumps({AWAIT_CONTAINER_PHASE: round(awaited, 4), **outcome.timings.phases})
        container_id = outcome.workload.container_id or str(outcome.workload.pid)
        if dest.shared:
            # Each destination's own; the pod's restored-container-ids is said over all of them.
            extra = {
                protocol.per_container(protocol.ANNOTATION_RESTORE_TIMINGS, dest.container): timings,
                protocol.per_container(
                    protocol.ANNOTATION_RESTORE_CONTAINER_ID, dest.container
                ): container_id,
            }
        else:
            extra = {
                protocol.ANNOTATION_RESTORE_TIMINGS: timings,
                protocol.ANNOTATION_RESTORE_CONTAINER_ID: container_id,
                **restored_container_ids(pod, outcome.workload),
            }
        await self.reports.report_restored(
            pod,
            f"restored from {grant.checkpoint_name} in {outcome.timings.total():.2f}s"
            + _SOURCE_NOTE.get(outcome.source, ""),
            extra,
            dest,
        )
        # The work done beside the phases (not in the annotation, whose values sum to the restore).
        log.info(
            "restored",
            extra={
                "pod": dest.key,
                "container": dest.container,
                "phases": outcome.timings.phases,
                "overlapped": outcome.timings.overlapped,
            },
        )
        return outcome.workload

    async def _restore_grant(self, pod: Obj) -> RestoreGrant:
        """The grant of what ``restore-from`` names in the pod's namespace: a DynamoCheckpoint (the Dynamo
        layer), read with the PodSnapshot it records, else a PodSnapshot (NVIDIA Snapshot's generic API);
        either way with the content that PodSnapshot is bound to."""
        namespace = Meta(pod).namespace
        name = name_to_restore(pod)
        ckpt = await get_or_none(self.kube, CHECKPOINT, name, namespace) if name else None
        snapshot_name = snapshot_to_restore(name, ckpt)
        snapshot = (
            await get_or_none(self.kube, POD_SNAPSHOT, snapshot_name, namespace) if snapshot_name else None
        )
        bound = PodSnapshotView(snapshot).bound_content if snapshot is not None else ""
        content = await get_or_none(self.kube, POD_SNAPSHOT_CONTENT, bound, "") if bound else None
        owner_name = capture_checkpoint_name(snapshot) if ckpt is None else None
        owner = await get_or_none(self.kube, CHECKPOINT, owner_name, namespace) if owner_name else None
        return restore_grant(pod, ckpt, snapshot, content, owner)

    async def _retake_container(self, pod: Obj, state: Status | None, dest: Destination) -> str | None:
        """After an agent restart, on a kubelet node: take the destination's container again, to watch
        or clear it. The id of a container a restore cut short left processes in: it ends once they are
        cleared, and the next restore goes into the container the kubelet starts in its place."""
        containers = self.kubelet.runtime if self.kubelet is not None else None
        if containers is None or state not in (Status.COMPLETED, Status.RUNNING):
            return None
        running = running_container(self.pods.get(object_key(pod)) or pod, dest.container)
        if running is None:
            return None
        with contextlib.suppress(WorkloadRuntimeError):
            await containers.attach(dest.key, running.container_id, image_id=running.image_id)
            if containers.holds_restored(dest.key):
                return running.container_id
        return None

    async def _find_restored(self, pod: Obj, dest: Destination) -> Workload | None:
        """A restored workload outlives an agent restart: found again to be watched, or reported gone."""
        if annotation(pod, protocol.ANNOTATION_WORKLOAD_EXITED, dest.annotated) is not None:
            return None
        found = await self.runtime.find(dest.key)
        if found is None:
            await self.reports.report_exit(pod, "restored worker gone while the node agent was down", dest)
        return found

    async def _clear_cut_short(self, pod: Obj, dest: Destination) -> bool:
        """A restore was cut short: clear what it left; True to start it again. One of an earlier agent
        process (which died mid-restore) is no fault of the checkpoint's, so it is not reported as a
        failure unless it keeps happening."""
        await self.runtime.stop(dest.key)
        attempts = restore_attempts(pod)
        if Meta(pod).uid not in self._restoring and attempts >= protocol.RESTORE_ATTEMPTS_MAX:
            await self.reports.report_restore_failed(
                pod,
                f"the restore was cut short {attempts} times (node agent restarts); "
                "the partial restore was removed",
                dest,
            )
            return False
        return True

    async def _restore_target(self, pod: Obj, spent: str | None, dest: Destination) -> _RestoreTarget | None:
        """What the restore goes into: on a kubelet node the destination's container in standby (None,
        reported, where it is refused or fails), else the pod spec's environment."""
        if self.kubelet is None:
            return _RestoreTarget(None, None, pod_env(pod, dest.container))
        try:
            target = await self.kubelet.attach_restore_target(
                pod,
                self.timeouts.container_start_timeout_seconds,
                self.timeouts.standby_timeout_seconds,
                spent,
                dest.container,
                dest.key,
            )
        except Refused as e:
            await self.reports.refuse(pod, str(e), dest)
            return None
        except (AgentError, WorkloadRuntimeError) as e:
            await self.reports.fail(pod, str(e), dest=dest)
            return None
        env = self.kubelet.runtime.container_env(dest.key)
        return _RestoreTarget(target.image_id, target.visible_gpus, env)

    async def _say_restore_failed(self, key: str, message: str) -> None:
        """restore-failed in the container's control dir: a later container of the pod learns from it that
        the pod's restore was used (the pod's failed status says the same to the controller)."""
        try:
            ctl = self.runtime.control_dir(key)
            await asyncio.to_thread(write_sentinel, ctl / protocol.FILE_RESTORE_FAILED, {"message": message})
        except (OSError, WorkloadRuntimeError) as e:
            log.warning("restore-failed not written", extra={"key": key, "error": str(e)})

    async def _run_restore(
        self, pod: Obj, grant: RestoreGrant, target: _RestoreTarget, dest: Destination
    ) -> RestoreOutcome | None:
        """The executor's restore; None where it failed (what it left stopped, the failure reported, a
        refused artifact among them)."""
        view = PodView(pod)
        try:
            return await self.executor.restore(
                dest.key,
                grant.artifact_key,
                manifest_digest=grant.manifest_digest,
                identity_info={
                    "podName": view.meta.name,
                    "namespace": view.meta.namespace,
                    "podIP": view.pod_ip or None,
                    "hostname": view.meta.name[:63],
                    "env": {
                        "POD_NAME": view.meta.name,
                        "POD_NAMESPACE": view.meta.namespace,
                    },
                },
                image_id=target.image_id,
                visible_gpus=target.visible_gpus,
                restore_env=target.env,
                skip_compat=skip_compat_check(view.meta.annotations),
            )
        except Incompatible as e:
            # Refused before anything started: the container stays as it was, to be reopened in place.
            await self.reports.incompatible(pod, str(e), dest)
            return None
        except (AgentError, WorkloadRuntimeError, ValueError) as e:
            await self._say_restore_failed(dest.key, str(e))
            with contextlib.suppress(Exception):
                await self.runtime.stop(dest.key)
            await self.reports.fail(pod, str(e), dest=dest)
            return None
