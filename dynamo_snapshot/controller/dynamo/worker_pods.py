"""A service's worker pods: counted, created (by restore from a Ready checkpoint, else by cold start),
deleted on a scale-down, and replaced when lost or when their restore failed or cannot be scheduled."""

from __future__ import annotations

from datetime import UTC, datetime

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.views import CheckpointView, Meta, PodView
from dynamo_snapshot.controller.context import PODS_CREATED, Context
from dynamo_snapshot.controller.dynamo.batching import slow_start
from dynamo_snapshot.controller.dynamo.checkpoint_reconciler import agent_verdict
from dynamo_snapshot.controller.dynamo.refusals import CreateHeldBack, Refusals, refusal_text, refused
from dynamo_snapshot.controller.failover.losses import WORKER_LOST
from dynamo_snapshot.controller.failover.worker_loss import judge_loss, worker_lifetime
from dynamo_snapshot.controller.podspec import cold_start_pod, keep_off_nodes, pod_name_prefix, restore_pod
from dynamo_snapshot.kube import (
    NORMAL,
    WARNING,
    ApiError,
    Obj,
    conflict_retry,
    is_already_exists,
    is_not_found,
)
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD
from dynamo_snapshot.kube.pods import pod_active, pod_ready


def start_mode(pod: Obj) -> str:
    return PodView(pod).start_mode


def restore_failed(pod: Obj) -> bool:
    if start_mode(pod) != protocol.StartMode.RESTORE.value:
        return False
    verdict, _ = agent_verdict(pod, protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE)
    return verdict is protocol.SnapshotStatus.FAILED


def scale_down_order(pod: Obj) -> tuple[bool, str, str]:
    # Not-ready pods first (they serve nothing yet), then the newest; name breaks ties deterministically.
    meta = Meta(pod)
    return pod_ready(pod), _newest_first(meta.creation_timestamp), meta.name


def _newest_first(timestamp: str) -> str:
    # RFC 3339 timestamps sort as strings; invert the digits so newer sorts first in an ascending sort.
    return "".join(chr(ord("9") - ord(ch) + ord("0")) if ch.isdigit() else ch for ch in timestamp)


class WorkerPods:
    """Creates and deletes one DGD's service pods, remembering what the apiserver refuses in `refusals`."""

    def __init__(self, ctx: Context, refusals: Refusals) -> None:
        self.ctx = ctx
        self.refusals = refusals

    def live(self, owner: tuple[str, str]) -> list[Obj]:
        """The service's pods that count as replicas: running or starting, and not being deleted by us."""
        namespace, graph = owner[0].split("/", 1)
        return [
            p
            for p in self.ctx.pods_of(namespace, graph, owner[1])
            if pod_active(p) and not self.ctx.expectations.pending_delete(owner, Meta(p).name)
        ]

    async def create(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        svc_name: str,
        owner: tuple[str, str],
        count: int,
        ckpt: DynamoCheckpoint | None,
        avoid: list[str],
    ) -> None:
        """Create `count` worker pods, preferably off the `avoid` nodes.

        A create the apiserver refuses stops the rest (see slow_start) and is remembered as the service's
        refusal; no pod is created for the service again until its backoff has run out.
        """
        ctx = self.ctx
        if self.refusals.held_back(owner) is not None:
            return
        mode = protocol.StartMode.RESTORE if ckpt is not None else protocol.StartMode.COLD
        created: list[str] = []
        tried: list[str] = []

        async def create_one() -> None:
            pod = (
                restore_pod(obj, dgd, svc_name, ckpt)
                if ckpt is not None
                else cold_start_pod(obj, dgd, svc_name)
            )
            ctx.keep_off_bad_nodes(pod["spec"], avoid)
            tried.append(pod["metadata"]["name"])
            ctx.expectations.expect_create(owner, pod["metadata"]["name"])
            try:
                await ctx.kube.create(POD, pod)
            except Exception:
                ctx.expectations.observed(owner, pod["metadata"]["name"])
                raise
            PODS_CREATED.labels(mode.value).inc()
            created.append(pod["metadata"]["name"])

        try:
            await slow_start(create_one, count)
        except ApiError as e:
            if not refused(e):
                raise
            # The apiserver names the pod it refused; each attempt's name is random, so the message would
            # differ on every retry and never read as the same state.
            text = refusal_text(e)
            for pod_name in tried:
                text = text.replace(pod_name, f"{pod_name_prefix(owner[0].split('/', 1)[1], svc_name)}-*")
            self.refusals.refuse(
                obj, svc_name, cond.POD_CREATE_REJECTED, f"service {svc_name}: pod refused ({text})"
            )
        else:
            self.refusals.current.pop(owner, None)
        finally:
            # Every pod created replaces a pending loss first, also when a later create failed.
            ctx.failover.replaced(owner, created)
        if not created:
            return
        ctx.observe_scale_latency(owner[0], len(created))
        how = f"by restore from {ckpt.metadata.name}" if ckpt is not None else "by cold start"
        ctx.recorder.record(
            obj, NORMAL, "ScaledUp", f"service {svc_name}: created {len(created)} worker pod(s) {how}"
        )

    async def remove_lost(self, obj: Obj, owner: tuple[str, str]) -> None:
        """Stop counting workers that failed, crash-loop or sit on a dead node, and delete them (at once:
        a pod on a dead node would otherwise stay Terminating until the node comes back).

        A NotReady or unreachable node's workers are lost only once its node grace has run out, and not
        while so many nodes are down at once that the control plane is the likelier fault (failover
        paused): until then they still count, and no replacement is made."""
        ctx = self.ctx
        namespace, graph = owner[0].split("/", 1)
        now = datetime.now(UTC)
        lost = []
        grace: dict[str, datetime] = {}
        kept: dict[str, str] = {}
        for pod in ctx.pods_of(namespace, graph, owner[1]):
            view = PodView(pod)
            pname = view.meta.name
            if ctx.expectations.pending_delete(owner, pname):
                continue
            node_name = view.node_name or None
            node = ctx.nodes.get(node_name) if node_name else None
            verdict = judge_loss(pod, node, now, ctx.node_grace_ends, ctx.node_health().paused is not None)
            if verdict.grace_ends is not None and node_name:
                grace[node_name] = verdict.grace_ends
                continue
            if verdict.kept and node_name:
                kept[pname] = node_name
                continue
            cause = verdict.cause
            if cause is None:
                continue
            if ctx.failover.observe(owner, pname, cause, node_name, worker_lifetime(pod, now)):
                ctx.recorder.record(
                    obj,
                    WARNING,
                    WORKER_LOST,
                    f"service {owner[1]}: pod {pname} lost ({cause}, node {node_name or '-'}); "
                    f"{ctx.failover.replacing(owner)}",
                )
            lost.append(pod)
        paused = ctx.node_health().paused if kept else None
        for event in ctx.failover.review(owner, grace=grace, paused=paused, kept=kept):
            ctx.recorder.record(obj, *event)
        if lost:
            await self.delete(obj, owner, lost, "LostWorkerRemoved", force=True)

    async def delete(
        self, obj: Obj, owner: tuple[str, str], pods: list[Obj], reason: str, *, force: bool = False
    ) -> None:
        for pod in pods:
            meta = Meta(pod)
            self.ctx.expectations.expect_delete(owner, meta.name)
            try:
                await self.ctx.kube.delete(
                    POD,
                    meta.name,
                    meta.namespace,
                    uid=meta.uid or None,
                    grace_period_seconds=0 if force else None,
                )
            except Exception as e:
                if not is_not_found(e):
                    raise
        names = ", ".join(Meta(p).name for p in pods)
        self.ctx.recorder.record(
            obj, NORMAL, reason, f"service {owner[1]}: deleted {len(pods)} pod(s): {names}"
        )

    async def replace_failed_restore(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        owner: tuple[str, str],
        pod: Obj,
        ckpt: DynamoCheckpoint | None,
    ) -> None:
        """Swap a pod whose restore failed for a restore on another node (while the checkpoint is Ready,
        a compatible node it has not failed on exists, and the replica has attempts left), else for a
        cold start; count the failure against the checkpoint.

        Every step is idempotent (deterministic replacement name, set-like failure list), so a controller
        killed half-way finishes the swap on its next run without doubling anything.
        """
        ctx = self.ctx
        view = PodView(pod)
        pname = view.meta.name
        _, message = agent_verdict(
            pod, protocol.ANNOTATION_RESTORE_STATUS, protocol.ANNOTATION_RESTORE_MESSAGE
        )
        ckpt_name = view.restore_from or ""
        node = view.node_name
        avoided = view.meta.annotations.get(protocol.ANNOTATION_AVOID_NODES, "")
        failed_on = sorted({n for n in avoided.split(",") if n} | {node} - {""})
        compat = ckpt.status.compatibility if ckpt is not None and ckpt.status else None
        retry = None
        if (
            ckpt is not None
            and len(failed_on) < ctx.settings.restore_node_attempts
            and ctx.other_compatible_node(compat, set(failed_on))
        ):
            retry = restore_pod(obj, dgd, owner[1], ckpt, name=f"{pname}-r"[:63], replaces=pname)
            keep_off_nodes(retry["spec"], failed_on, required=True)
            retry["metadata"]["annotations"][protocol.ANNOTATION_AVOID_NODES] = ",".join(failed_on)
        if ckpt_name:
            # Before the swap deletes the pod: a controller killed in between sees the failed pod again
            # on its next run and records it then (the failure list is a set).
            await self._record_restore_failure(view.meta.namespace, ckpt_name, pname)
        await self._swap_restore(
            obj,
            dgd,
            owner,
            pod,
            "RestoreFailed",
            f"service {owner[1]}: restore of pod {pname} from {ckpt_name or '?'} on node {node or '?'} "
            f"failed ({message or 'no reason given'})",
            retry,
        )

    async def replace_unschedulable_restore(
        self, obj: Obj, dgd: DynamoGraphDeployment, owner: tuple[str, str], pod: Obj, waited: float, why: str
    ) -> None:
        """A restore pod no node can take (its compatibility or avoid-node affinity, or GPUs all taken
        where it fits) would hold a replica slot for ever: a cold start, which fits anywhere the service
        fits, replaces it. Not a restore failure: the checkpoint is not blamed."""
        await self._swap_restore(
            obj,
            dgd,
            owner,
            pod,
            "RestoreUnschedulable",
            f"service {owner[1]}: restore pod {Meta(pod).name} could not be scheduled for "
            f"{waited:.0f}s ({why or 'no reason given'})",
        )

    async def _swap_restore(
        self,
        obj: Obj,
        dgd: DynamoGraphDeployment,
        owner: tuple[str, str],
        pod: Obj,
        reason: str,
        what_happened: str,
        retry: Obj | None = None,
    ) -> None:
        """Replace restore pod `pod` by `retry` (a restore elsewhere), else by a cold start, then delete it.

        The replacement exists before the pod goes, so the replica is never missing from the count, and is
        named after the pod, so a controller killed half-way finds it (see `_create_replacement`) instead
        of creating a second one.
        """
        pname = Meta(pod).name
        replacement = retry or cold_start_pod(obj, dgd, owner[1], name=f"{pname}-cold"[:63], replaces=pname)
        self.ctx.keep_off_bad_nodes(replacement["spec"], [])
        mode = protocol.StartMode.RESTORE if retry else protocol.StartMode.COLD
        then = "retrying the restore on another node as pod" if retry else "replaced by cold-start pod"
        await self._create_replacement(owner, replacement, mode)
        await self.delete(obj, owner, [pod], "RestoreReplaced")
        self.ctx.recorder.record(
            obj, WARNING, reason, f"{what_happened}; {then} {replacement['metadata']['name']}"
        )

    async def _create_replacement(self, owner: tuple[str, str], pod: Obj, mode: protocol.StartMode) -> None:
        """Create a pod with a deterministic name; one that exists already (an earlier, interrupted
        attempt) counts as created.

        Raises CreateHeldBack when the apiserver refuses it, or an earlier refusal's backoff still runs:
        the swap it is part of stops there, so the pod it would replace stays until a replacement exists.
        """
        ctx = self.ctx
        if self.refusals.held_back(owner) is not None:
            raise CreateHeldBack
        ctx.expectations.expect_create(owner, pod["metadata"]["name"])
        try:
            await ctx.kube.create(POD, pod)
            PODS_CREATED.labels(mode.value).inc()
        except Exception as e:
            if is_already_exists(e):
                return
            ctx.expectations.observed(owner, pod["metadata"]["name"])
            obj = ctx.dgds.get(owner[0])
            if not refused(e):
                raise
            if obj is not None:
                what = f"service {owner[1]}: replacement pod {pod['metadata']['name']} refused"
                self.refusals.refuse(obj, owner[1], cond.POD_CREATE_REJECTED, f"{what} ({refusal_text(e)})")
            raise CreateHeldBack from e
        self.refusals.current.pop(owner, None)

    async def _record_restore_failure(self, namespace: str, ckpt_name: str, pod_name: str) -> None:
        kube = self.ctx.kube

        async def add() -> None:
            try:
                fresh = await kube.get(CHECKPOINT, ckpt_name, namespace)
            except Exception as e:
                if is_not_found(e):
                    return
                raise
            failures = list(CheckpointView(fresh).status.get("failedRestores") or [])
            if pod_name in failures:
                return
            failures = [*failures, pod_name][-20:]
            await kube.json_patch(
                CHECKPOINT,
                ckpt_name,
                [
                    {
                        "op": "test",
                        "path": "/metadata/resourceVersion",
                        "value": Meta(fresh).resource_version,
                    },
                    {"op": "add", "path": "/status/failedRestores", "value": failures},
                ],
                namespace,
                subresource="status",
            )

        await conflict_retry(add)
