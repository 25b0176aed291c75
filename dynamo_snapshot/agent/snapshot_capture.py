"""PodSnapshotContents of this node: capture the pod each one names, once, and write the outcome on it.

The controller binds a PodSnapshot to a content labelled with the source pod's node; the agent of that node
watches its own contents only. A content is captured when the PodSnapshot and the pod of its namespace grant
it (``authorize.content_grant``): the artifact is stored under ``<namespace>/<PodSnapshot uid>``, bound to
the PodSnapshot and the pod, and sealed with the identity of the DynamoCheckpoint that controls the
PodSnapshot (how a DynamoCheckpoint is taken), else with a hash of the PodSnapshot's UID. The content says
at once that the agent took it up (Ready False, reason CaptureInProgress), then Ready (reason Captured, the
artifact's location, digest and size, what a restore needs) or Failed with the reason; the controller
(or NVIDIA's snapshot operator, where the CRDs are its own) mirrors it onto the PodSnapshot. The artifact
and compatibility facts go in the content's annotations too, before Ready: an upstream CRD's schema prunes
those status fields, and the annotations of a cluster-scoped object are out of any tenant's reach. Ready
also says what the capture ran on (``status.source``: the node, the container, the GPUs), for people. A
source pod deleted before the capture ends is not snapshotted: what the capture published is removed
(reason SourcePodGone). After an agent restart, a content without an outcome is looked at again: an
artifact already published for it (the earlier process died before writing the outcome) is reported
Ready; otherwise the capture runs again, and fails with the reason if the worker no
longer waits for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import platform
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dynamo_snapshot.agent.authorize import (
    CaptureGrant,
    ContentRefused,
    capture_checkpoint_name,
    content_grant,
)
from dynamo_snapshot.agent.errors import AgentError, backoff
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.gpu_assignment import gpu_models
from dynamo_snapshot.agent.runtime.base import Workload, WorkloadRuntimeError
from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.podsnapshot import (
    CheckpointSource,
    CheckpointSourceDevices,
    CheckpointSourceNode,
    CheckpointSourcePod,
    NvidiaCheckpointSource,
    NvidiaCheckpointSourceInstance,
    PodSnapshotArtifact,
    PodSnapshotCompatibility,
    PodSnapshotReason,
)
from dynamo_snapshot.api.views import (
    ContainerView,
    Meta,
    ObjectView,
    PodSnapshotContentView,
    PodView,
    still_live,
)
from dynamo_snapshot.artifact import Artifact, Binding, GpuInfo, Manifest
from dynamo_snapshot.kube import (
    DELETED,
    NORMAL,
    WARNING,
    EventRecorder,
    Informer,
    Kube,
    Obj,
)
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from dynamo_snapshot.kube.until_written import get_or_none, write_until_done

__all__ = [
    "CAPTURED_MESSAGE",
    "SnapshotCapture",
    "capture_source",
    "goarch",
    "snapshot_identity_hash",
    "source_node",
]

log = logging.getLogger(__name__)
CAPTURED_MESSAGE = "Checkpoint captured and verified"
# The pod a content names may reach this node's pod cache a moment after the content: wait that long.
POD_CACHE_WAIT_S = 10.0


def snapshot_identity_hash(snapshot_uid: str) -> str:
    """The identity hash a PodSnapshot's artifact is sealed with. A PodSnapshot captures a pod, not a Dynamo
    identity: the hash names the PodSnapshot (the first 16 hex digits of its UID's SHA-256)."""
    return hashlib.sha256(snapshot_uid.encode()).hexdigest()[:16]


# platform.machine() (the kernel's name for the CPU) -> GOARCH, the spelling status.source uses.
_GOARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}


def goarch(machine: str) -> str | None:
    """GOARCH's name for ``platform.machine()``; None for a machine it is not known to name."""
    return _GOARCH.get(machine.lower())


def source_node(node_name: str, machine: str, release: str) -> CheckpointSourceNode:
    """The node part of ``status.source``: the agent's node, its CPU architecture and kernel release (a
    container shares the node's kernel, so the agent's own uname is the node's)."""
    return CheckpointSourceNode(
        name=node_name or None, architecture=goarch(machine), kernel_version=release or None
    )


def capture_source(
    node: CheckpointSourceNode,
    pod: Obj,
    container: str,
    manifest: Manifest,
    models: Sequence[str] | None,
) -> CheckpointSource:
    """``status.source`` of a capture of ``container`` of ``pod``: what ran it, as far as it is known.
    ``models``: nvidia-smi's model of each of the manifest's GPUs; None where unknown."""
    return CheckpointSource(
        node=node,
        pod=_source_pod(pod, container, manifest),
        devices=_source_devices(manifest.gpus, models),
    )


def _source_pod(pod: Obj, container: str, manifest: Manifest) -> CheckpointSourcePod | None:
    found = PodView(pod).container(container) or ContainerView(None, None)
    recorded = manifest.extra.get("image")
    # The kubelet's imageID of the container; the manifest holds the same value as the capture read it,
    # for a status that no longer reports it.
    digest = found.image_id or (recorded if isinstance(recorded, str) else "")
    values = (found.image, digest, found.limit("memory"), found.limit("cpu"))
    if not any(values):
        return None
    image, image_digest, memory, cpu = (value or None for value in values)
    return CheckpointSourcePod(image=image, image_digest=image_digest, memory=memory, cpu=cpu)


def _source_devices(gpus: GpuInfo | None, models: Sequence[str] | None) -> CheckpointSourceDevices | None:
    if gpus is None:
        return None
    # One entry per GPU even where its model is unknown: the list's length is the count.
    names: Sequence[str | None] = (
        models if models is not None and len(models) == gpus.count else [None] * gpus.count
    )
    return CheckpointSourceDevices(
        nvidia=NvidiaCheckpointSource(
            # The full version only: the manifest's driver major is no version to report.
            driver_version=gpus.driver_version or None,
            instances=[NvidiaCheckpointSourceInstance(product_name=name) for name in names],
        )
    )


def _identity_hash(grant: CaptureGrant) -> str:
    if grant.identity is not None:
        return grant.identity.compute_hash()
    return snapshot_identity_hash(grant.binding.checkpoint_uid)


class SnapshotCapture:
    def __init__(
        self,
        kube: Kube,
        executor: Executor,
        pods: Informer,
        recorder: EventRecorder,
        node_name: str,
        ensure_running: Callable[[Obj, str], Awaitable[Workload]],
        ready_timeout: float,
    ) -> None:
        self.kube = kube
        self.executor = executor
        self.pods = pods
        self.recorder = recorder
        self.node_name = node_name
        self.ensure_running = ensure_running
        self.ready_timeout = ready_timeout
        self.this_node = source_node(node_name, platform.machine(), os.uname().release)
        # nvidia-smi's model of each GPU UUID; replaced in tests.
        self.gpu_models: Callable[[Sequence[str]], list[str] | None] = gpu_models
        self.contents = Informer(
            kube, POD_SNAPSHOT_CONTENT, label_selector=f"{protocol.LABEL_SNAPSHOT_NODE}={node_name}"
        )
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.contents.add_handler(self.on_content)

    async def on_content(self, etype: str, content: Obj, old: Obj | None) -> None:
        meta = Meta(content)
        uid = meta.uid
        if etype == DELETED or meta.deleting:
            task = self.tasks.pop(uid, None)
            if task is not None:
                task.cancel()
            return
        if cond.is_true(content, cond.READY) or cond.is_true(content, cond.FAILED) or uid in self.tasks:
            return
        task = asyncio.create_task(self._capture(content), name=f"capture-{content['metadata']['name']}")
        self.tasks[uid] = task
        task.add_done_callback(lambda _: self.tasks.pop(uid, None))

    async def _capture(self, content: Obj) -> None:
        try:
            grant, pod = await self._grant(content)
        except ContentRefused as e:
            await self._fail(content, e.reason, str(e))
            return
        binding = grant.binding
        published = await asyncio.to_thread(self.executor.published, binding.key)
        if published is not None:
            # An earlier agent process published it and died before saying so (or before writing it to
            # the object store).
            try:
                await self.executor.share(binding.key)
            except AgentError as e:
                await self._fail(content, PodSnapshotReason.CHECKPOINT_FAILED, str(e))
                return
            await self._ready(content, published, binding, pod)
            return
        await self._taken_up(content, binding)
        try:
            # The container the PodSnapshot names (content_grant checked the pod has it).
            workload = await self.ensure_running(pod, PodSnapshotContentView(content).source.containers[0])
            await self.executor.wait_ready(workload, within=self.ready_timeout)
            outcome = await self.executor.checkpoint(
                workload, _identity_hash(grant), grant.identity, binding=binding
            )
        except (AgentError, WorkloadRuntimeError, ValueError) as e:
            if not await self._source_gone(content, pod, binding):
                await self._fail(content, PodSnapshotReason.CHECKPOINT_FAILED, str(e))
            return
        if await self._source_gone(content, pod, binding):
            return
        artifact = await asyncio.to_thread(self.executor.published, outcome.key)
        if artifact is None:
            await self._fail(
                content, PodSnapshotReason.CHECKPOINT_FAILED, "the published artifact is unreadable"
            )
            return
        await self._ready(content, artifact, binding, pod)

    async def _grant(self, content: Obj) -> tuple[CaptureGrant, Obj]:
        view = PodSnapshotContentView(content)
        ref = view.snapshot_ref
        namespace = str(ref.get("namespace") or "")
        snapshot = await get_or_none(self.kube, POD_SNAPSHOT, str(ref.get("name") or ""), namespace)
        ckpt_name = capture_checkpoint_name(snapshot)
        ckpt = await get_or_none(self.kube, CHECKPOINT, ckpt_name, namespace) if ckpt_name else None
        pod = await self._pod(f"{namespace}/{view.source.name}")
        grant = content_grant(content, snapshot, pod, self.node_name, ckpt)
        assert pod is not None  # content_grant refuses a missing pod
        return grant, pod

    async def _pod(self, key: str) -> Obj | None:
        await self.pods.wait_synced()
        # The cache has no per-key signal, and a content is looked at once: poll it for a moment.
        for _ in range(int(POD_CACHE_WAIT_S / 0.2)):
            pod = self.pods.get(key)
            if pod is not None:
                return pod
            await asyncio.sleep(0.2)
        return self.pods.get(key)

    async def _source_gone(self, content: Obj, pod: Obj, binding: Binding) -> bool:
        """Whether the source pod was deleted while it was being captured. A pod deleted mid-capture is not
        snapshotted: whatever the capture published is removed, and the content fails with the reason."""
        latest = self.pods.get(f"{binding.namespace}/{binding.source_pod}")
        if still_live(latest, pod):
            return False
        await self.executor.delete_artifact(binding.key)
        await self._fail(
            content,
            PodSnapshotReason.SOURCE_POD_GONE,
            f"source pod {binding.namespace}/{binding.source_pod} was deleted during the capture; "
            "nothing was published",
        )
        return True

    # ------------------------------------------------------------------ the outcome, on the content
    async def _taken_up(self, content: Obj, binding: Binding) -> None:
        """Say on the content that this agent captures it (the controller fails one no agent takes up)."""
        view = PodSnapshotContentView(content)
        container = ",".join(view.source.containers)
        conditions = cond.set_condition(
            view.conditions,
            cond.READY,
            False,
            PodSnapshotReason.CAPTURE_IN_PROGRESS,
            f"the node agent of {self.node_name} captures container {container} of pod {binding.source_pod}",
            view.meta.generation,
        )
        await self._write(content, {"conditions": conditions})

    async def _ready(self, content: Obj, artifact: Artifact, binding: Binding, pod: Obj) -> None:
        manifest = artifact.manifest
        gpus = manifest.gpus
        facts = PodSnapshotArtifact(
            location=str(artifact.path),
            digest=manifest.digest or None,
            size_bytes=sum(f.size for f in manifest.files),
        )
        compatibility = PodSnapshotCompatibility(
            gpu_product=gpus.product if gpus else None,
            cuda_driver_major=gpus.cuda_driver_major if gpus else None,
            gpu_count=gpus.count if gpus else 0,
            image_id=manifest.extra.get("image") or None,
        )
        name = Meta(content).name
        annotations = {
            protocol.ANNOTATION_CONTENT_ARTIFACT: facts.model_dump_json(by_alias=True, exclude_none=True),
            protocol.ANNOTATION_CONTENT_COMPATIBILITY: compatibility.model_dump_json(
                by_alias=True, exclude_none=True
            ),
        }
        # Before Ready: whoever mirrors Ready onto the PodSnapshot lets restores start, which read these.
        await self._until_written(
            name,
            "annotations",
            lambda: self.kube.merge_patch(
                POD_SNAPSHOT_CONTENT, name, {"metadata": {"annotations": annotations}}
            ),
        )
        # A write of its own, not in the annotations: nothing reads it back (restores check the manifest,
        # which holds these facts), so a CRD that prunes it loses a note for people, and one that refuses
        # it (an older NVIDIA schema, another shape of status.source) must not cost the outcome.
        source = (await self._source(content, pod, manifest)).model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
        await write_until_done(
            lambda: self.kube.patch_status(POD_SNAPSHOT_CONTENT, name, {"source": source}),
            what="the content's status.source (an installed CRD may refuse it)",
            extra={"content": name},
            backoff=backoff,
        )
        status: dict[str, Any] = {
            "conditions": _conditions(content, True, PodSnapshotReason.CAPTURED, CAPTURED_MESSAGE),
            "artifact": facts.model_dump(mode="json", by_alias=True),
            "compatibility": compatibility.model_dump(mode="json", by_alias=True),
        }
        await self._write(content, status)
        log.info("pod snapshot captured", extra={"content": name, "key": binding.key})

    async def _source(self, content: Obj, pod: Obj, manifest: Manifest) -> CheckpointSource:
        latest = self.pods.get(f"{Meta(pod).namespace}/{Meta(pod).name}")
        # The cache's copy where it is still that pod: the one from the grant may predate the container.
        current = latest if latest is not None and still_live(latest, pod) else pod
        containers = PodSnapshotContentView(content).source.containers
        uuids = manifest.gpus.uuids if manifest.gpus else []
        models = await asyncio.to_thread(self.gpu_models, uuids) if uuids else None
        container = containers[0] if containers else ""
        return capture_source(self.this_node, current, container, manifest, models)

    async def _fail(self, content: Obj, reason: str, message: str) -> None:
        await self._write(content, {"conditions": _conditions(content, False, reason, message)})
        log.warning("pod snapshot not captured", extra={"content": Meta(content).name, "why": message})

    async def _write(self, content: Obj, status: dict[str, Any]) -> None:
        ready = next(c for c in status["conditions"] if c["type"] == cond.READY)
        ref = PodSnapshotContentView(content).snapshot_ref
        event_on = {
            "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
            "kind": "PodSnapshot",
            "metadata": {"name": ref.get("name"), "namespace": ref.get("namespace"), "uid": ref.get("uid")},
        }
        if ready["status"] == "True":
            self.recorder.record(event_on, NORMAL, ready["reason"], f"captured on node {self.node_name}")
        elif ready["reason"] == PodSnapshotReason.CAPTURE_IN_PROGRESS:
            self.recorder.record(event_on, NORMAL, ready["reason"], ready["message"])
        else:
            self.recorder.record(event_on, WARNING, ready["reason"], ready["message"])
        name = Meta(content).name
        await self._until_written(
            name, "status", lambda: self.kube.patch_status(POD_SNAPSHOT_CONTENT, name, status)
        )

    async def _until_written(self, name: str, what: str, write: Callable[[], Awaitable[Obj]]) -> None:
        """Write the content's status or annotations until taken: a capture's outcome is in hand once,
        and a content is looked at again only by a new agent process."""
        await write_until_done(write, what=f"the content's {what}", extra={"content": name}, backoff=backoff)


def _conditions(content: Obj, ready: bool, reason: str, message: str) -> list[dict[str, Any]]:
    view = ObjectView(content)
    return cond.set_outcome(view.conditions, ready, reason, message, view.meta.generation)
