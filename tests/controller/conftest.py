"""Fixtures for controller tests: the real controller running in-process against the real control plane,
and a test double of the node agent that only writes what the agent reports: a capture's outcome on the
PodSnapshotContent, a restore's on the pod (the real agent has its own tests)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import now_rfc3339
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.controller.manager import Controller, ControllerConfig
from dynamo_snapshot.controller.podspec import auto_checkpoint_name, gpus_of_pod
from dynamo_snapshot.kube import EVENT, NODE, POD, ApiError, Kube, Obj, is_not_found
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT

IDENTITY = {"model": "Qwen/Qwen3-0.6B", "backendFramework": "vllm", "tensorParallelSize": 1}


def dgd_manifest(
    name: str,
    replicas: int = 1,
    *,
    identity: dict[str, Any] | None = None,
    checkpoint_ref: str | None = None,
    gpus: int = 1,
) -> Obj:
    ckpt: dict[str, Any] = {"enabled": True}
    if checkpoint_ref:
        ckpt["checkpointRef"] = checkpoint_ref
    else:
        ckpt.update(mode="Auto", identity=identity or IDENTITY)
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {
            "backendFramework": "vllm",
            "services": {
                "VllmWorker": {
                    "componentType": "worker",
                    "replicas": replicas,
                    "resources": {"limits": {"gpu": str(gpus)}},
                    "extraPodSpec": {
                        "mainContainer": {
                            "image": "vllm-runtime:test",
                            "command": ["python3", "-m", "dynamo.vllm"],
                        }
                    },
                    "checkpoint": ckpt,
                }
            },
        },
    }


@dataclass
class AgentDouble:
    """Plays the node agent: captures the PodSnapshotContents of the namespace's PodSnapshots (writes their
    outcome, as the agent does on the generic layer) and reports restores of restore pods.

    `checkpoint_outcome` decides each capture: "completed" (Ready, with the artifact and the GPU
    environment of the source pod's node), "failed" (Failed, CheckpointFailed) or None (taken up,
    CaptureInProgress, and never finished: a worker that never gets ready). `restore_outcome` decides each
    restore's verdict, so tests can make restores fail.
    """

    kube: Kube
    namespace: str
    restore_outcome: Callable[[Obj], str] = lambda pod: "completed"
    checkpoint_outcome: str | None = "completed"
    handled: set[str] = field(default_factory=set)
    taken_up: set[str] = field(default_factory=set)

    async def run(self) -> None:
        while True:
            contents, _ = await self.kube.list_all(POD_SNAPSHOT_CONTENT, None)
            for content in contents:
                await self._capture(content)
            pods, _ = await self.kube.list_all(POD, self.namespace)
            for pod in pods:
                await self._handle(pod)
            await asyncio.sleep(0.2)

    async def _capture(self, content: Obj) -> None:
        meta, spec = content["metadata"], content.get("spec") or {}
        if (spec.get("snapshotRef") or {}).get("namespace") != self.namespace:
            return
        if meta["uid"] in self.handled or meta.get("deletionTimestamp"):
            return
        if cond.is_true(content, cond.READY) or cond.is_true(content, cond.FAILED):
            return  # an outcome written by the test itself
        if not await self._of_a_checkpoint(spec["snapshotRef"]["name"]):
            return  # a PodSnapshot of the generic layer's own tests: they play the agent themselves
        status: Obj
        if self.checkpoint_outcome is None:
            if meta["uid"] in self.taken_up:
                return
            self.taken_up.add(meta["uid"])
            status = {"conditions": _outcome(False, "CaptureInProgress", "capturing", failed=False)}
        elif self.checkpoint_outcome == "failed":
            self.handled.add(meta["uid"])
            status = {"conditions": _outcome(False, "CheckpointFailed", "criu dump: test failure")}
        else:
            self.handled.add(meta["uid"])
            status = {
                "conditions": _outcome(True, "Captured", "Checkpoint captured and verified"),
                "artifact": {
                    "location": f"{ARTIFACT_ROOT}/{self.namespace}/{spec['snapshotRef']['uid']}",
                    "digest": hashlib.sha256(meta["uid"].encode()).hexdigest(),
                    "sizeBytes": 4096,
                },
                "compatibility": await self._compatibility(spec["source"]),
            }
        try:
            await self.kube.patch_status(POD_SNAPSHOT_CONTENT, meta["name"], status)
        except ApiError as e:
            if not is_not_found(e):
                raise

    async def _of_a_checkpoint(self, snapshot: str) -> bool:
        """Whether the PodSnapshot is controlled by a DynamoCheckpoint (made by its SnapshotJob)."""
        found = await self._get(POD_SNAPSHOT, snapshot, self.namespace)
        refs = (found.get("metadata") or {}).get("ownerReferences") or []
        return any(r.get("controller") and r.get("kind") == CHECKPOINT.kind for r in refs)

    async def _compatibility(self, source: Obj) -> Obj:
        """What the agent reads off the GPUs of the node that ran the capture."""
        node = await self._get(NODE, source["nodeName"], None)
        labels = (node.get("metadata") or {}).get("labels") or {}
        pod = await self._get(POD, source["podRef"]["name"], self.namespace)
        return {
            "gpuProduct": labels.get(protocol.LABEL_GPU_PRODUCT),
            "cudaDriverMajor": labels.get(protocol.LABEL_CUDA_DRIVER_MAJOR),
            "gpuCount": gpus_of_pod(pod),
            "imageId": "sha256:" + "ab" * 32,
        }

    async def _get(self, kind: Any, name: str, namespace: str | None) -> Obj:
        """The object, or {} when it is gone (a test deleted it meanwhile)."""
        try:
            found: Obj = await self.kube.get(kind, name, namespace)
        except ApiError as e:
            if not is_not_found(e):
                raise
            return {}
        return found

    async def _handle(self, pod: Obj) -> None:
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        if meta["uid"] in self.handled or meta.get("deletionTimestamp"):
            return
        if pod.get("status", {}).get("phase") != "Running" or not pod["spec"].get("nodeName"):
            return
        if labels.get(protocol.LABEL_RESTORE_TARGET) != protocol.TRUE:
            return
        ann: dict[str, str] = {}
        outcome = self.restore_outcome(pod)
        ann[protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")] = outcome
        if outcome == "failed":
            ann[protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")] = (
                "checksum mismatch (test)"
            )
        self.handled.add(meta["uid"])
        try:
            await self.kube.merge_patch(POD, meta["name"], {"metadata": {"annotations": ann}}, self.namespace)
        except ApiError as e:
            if not is_not_found(e):  # the pod went away meanwhile (a failover test deleted it)
                raise


ARTIFACT_ROOT = "/var/lib/dynamo-snapshot/artifacts"


def _outcome(ready: bool, reason: str, message: str, *, failed: bool = True) -> list[Obj]:
    """A content's Ready and Failed conditions as the node agent writes them."""
    now = now_rfc3339()
    return [
        {
            "type": t,
            "status": "True" if s else "False",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now,
        }
        for t, s in ((cond.READY, ready), (cond.FAILED, not ready and failed))
    ]


@dataclass
class Harness:
    kube: Kube
    namespace: str
    agent: AgentDouble
    start_controller: Callable[[], Awaitable[None]]
    kill_controller: Callable[[], Awaitable[None]]
    controller: Callable[[], Controller]  # the one running now (a restart makes a new one)

    @property
    def dgds(self) -> DgdClient:
        """DGDs written at the version the CRD stores (v1beta1: crds/ serves it alone), read as views in
        v1alpha1's shape, as the controller reads them."""
        return DgdClient(self.kube)

    async def apply_dgd(self, manifest: Obj) -> Obj:
        return await self.dgds.create(manifest, self.namespace)

    async def scale(self, name: str, replicas: int, service: str = "VllmWorker") -> None:
        await self.dgds.set_replicas(name, self.namespace, service, replicas)

    async def pods(self, graph: str | None = None) -> list[Obj]:
        selector = (
            f"{protocol.LABEL_GRAPH}={graph}"
            if graph
            else f"{protocol.LABEL_MANAGED_BY}={protocol.MANAGED_BY_VALUE}"
        )
        items, _ = await self.kube.list_all(POD, self.namespace, label_selector=selector)
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    async def checkpoints(self) -> list[Obj]:
        items, _ = await self.kube.list_all(CHECKPOINT, self.namespace)
        return items

    async def dgd(self, name: str) -> Obj:
        return await self.dgds.get(name, self.namespace)

    async def auto_checkpoint(self, graph: str, identity: dict[str, Any] | None = None) -> str:
        """The name of the Auto-mode checkpoint DGD `graph` makes for `identity` (its own, never shared)."""
        uid = (await self.dgd(graph))["metadata"]["uid"]
        return auto_checkpoint_name(graph, compute_identity_hash(identity or IDENTITY), uid)

    async def events(self, reason: str) -> list[Obj]:
        items, _ = await self.kube.list_all(EVENT, self.namespace)
        return [e for e in items if e.get("reason") == reason]

    async def event(self, reason: str, *words: str, within: float = 15.0) -> Obj:
        """The first Event of `reason` whose message has all `words`; Events are written in the
        background, so this waits for them."""

        async def find() -> Obj | None:
            return next(
                (e for e in await self.events(reason) if all(w in (e.get("message") or "") for w in words)),
                None,
            )

        found: Obj = await eventually(find, within=within)
        return found


async def eventually(check: Callable[[], Awaitable[Any]], within: float = 30.0, interval: float = 0.2) -> Any:
    """Poll `check` until it returns a truthy value; fail with its last value or error."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await check()
            if last:
                return last
        except (AssertionError, ApiError) as e:  # not there yet (404) counts as not yet
            last = e
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {within}s; last: {last!r}")


@pytest.fixture
async def harness(
    api: client.ApiClient, namespace: str, crds: list[str], request: pytest.FixtureRequest
) -> AsyncIterator[Harness]:
    """The controller against the real control plane; indirect parametrization overrides its config."""
    kube = Kube(api, field_manager="tests")
    config = ControllerConfig(
        namespace=namespace,
        leader_elect=False,
        resync_seconds=5,
        metrics_port=0,
        drain_timeout=5,
        **getattr(request, "param", {}),
    )
    state: dict[str, Any] = {}

    async def start() -> None:
        stop = asyncio.Event()
        ctrl = build_controller(kube, config)
        state.update(stop=stop, task=asyncio.create_task(ctrl.run_until(stop)), ctrl=ctrl)

    async def kill() -> None:
        # Abrupt: the task is cancelled mid-whatever, as a crash or OOM kill would leave things.
        task = state.pop("task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    agent = AgentDouble(kube, namespace)
    agent_task = asyncio.create_task(agent.run())
    await start()
    try:
        yield Harness(kube, namespace, agent, start, kill, lambda: state["ctrl"])
    finally:
        if "stop" in state:
            state["stop"].set()
        await kill()
        # The controller's finalizers would keep the namespace Terminating once nobody removes them, and
        # the contents of its PodSnapshots are cluster-scoped: nothing else would delete them.
        for kind in (CHECKPOINT, POD_SNAPSHOT):
            for obj in (await kube.list_all(kind, namespace))[0]:
                with contextlib.suppress(ApiError):
                    await kube.merge_patch(
                        kind, obj["metadata"]["name"], {"metadata": {"finalizers": None}}, namespace
                    )
        for content in (await kube.list_all(POD_SNAPSHOT_CONTENT, None))[0]:
            if ((content.get("spec") or {}).get("snapshotRef") or {}).get("namespace") == namespace:
                with contextlib.suppress(ApiError):
                    await kube.delete(POD_SNAPSHOT_CONTENT, content["metadata"]["name"])
        agent_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await agent_task
