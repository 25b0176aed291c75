"""The node agent for real: pods on kwok nodes of the real control plane, workers launched by the agent
(host processes or runc containers), CRIU checkpoint and restore, the artifact store on disk.

A DynamoCheckpoint is taken as the controller takes it: a PodSnapshot the checkpoint controls, of the
source pod, bound to a PodSnapshotContent of the pod's node, which the node agent captures (made here as
the controller makes them; no controller runs). Once the content is Ready, the PodSnapshot and the
checkpoint are made Ready as the controller makes them, and restore pods name the checkpoint in
nvidia.com/restore-from."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.runtime import ProcessRuntime, RuncRuntime, Runtime
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.agent.snapshot_capture import CAPTURED_MESSAGE
from dynamo_snapshot.agent.watcher import NodeAgent, workload_key
from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.artifact import ArtifactCache, ArtifactStore, GpuInfo, artifact_key
from dynamo_snapshot.controller.podspec import owner_reference
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.criu.packed import is_packed_pages
from dynamo_snapshot.kube import EVENT, POD, ApiError, Kube, Obj, is_already_exists
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from tests.controller.conftest import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.criu]
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
IDENTITY = {"model": "Qwen/Qwen3-0.6B", "backendFramework": "vllm"}
HASH = compute_identity_hash(IDENTITY)
CKPT = "ckpt"
H200 = GpuInfo(
    product="NVIDIA-H200",
    driver_version="580.159.04",
    cuda_driver_major="580",
    count=1,
    uuids=["GPU-aaaaaaaa-0000-0000-0000-000000000001"],
    memory_mib=143771,
)


@dataclass
class AgentHandle:
    node: str
    agent: NodeAgent
    runtime: Runtime
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def shutdown(self, *, abrupt: bool = False) -> None:
        if abrupt:
            self.task.cancel()
        else:
            self.stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def agents(
    api: client.ApiClient, tmp_path: Path, criu_bin: Path, crds: list[str]
) -> AsyncIterator[Callable[..., Any]]:
    kube = Kube(api, field_manager="agent-test")
    store_root = tmp_path / "artifacts"  # shared, like a ReadWriteMany volume
    started: list[AgentHandle] = []
    workloads: list[tuple[Runtime, str]] = []

    async def start(
        node: str,
        runtime_kind: str = "local",
        gpus: GpuInfo | None = None,
        launch: bool = True,
        cache: bool = False,
    ) -> AgentHandle:
        criu = Criu(criu_bin)
        base = tmp_path / f"node-{node}"
        runtime: Runtime
        if runtime_kind == "runc":
            # The container sees this interpreter, its virtualenv and the repo, read-only.
            binds = ["/usr", "/etc", sys.prefix, sys.base_prefix, str(REPO)]
            runtime = RuncRuntime(base / "state", base / "control", criu_binary=criu.binary, host_binds=binds)
        else:
            runtime = ProcessRuntime(base / "control", criu)
        config = AgentConfig(
            node_name=node,
            runtime="runc" if runtime_kind == "runc" else "local",
            ready_timeout_seconds=60,
            launch_workloads=launch,
        )
        executor = Executor(
            runtime,
            ArtifactStore(store_root),
            criu,
            config,
            cuda=None,
            gpus=gpus,
            cache=ArtifactCache(base / "cache", 1 << 30) if cache else None,
        )
        agent = NodeAgent(kube, executor, runtime)
        stop = asyncio.Event()
        handle = AgentHandle(node, agent, runtime, stop, asyncio.create_task(agent.run_until(stop)))
        started.append(handle)
        original_launch, original_restore = runtime.launch, runtime.restore

        async def tracked_launch(spec: Any) -> Any:
            workloads.append((runtime, spec.key))
            return await original_launch(spec)

        async def tracked_restore(key: str, *args: Any, **kwargs: Any) -> Any:
            workloads.append((runtime, key))
            return await original_restore(key, *args, **kwargs)

        # Everything a test starts is stopped at teardown, restored trees included.
        runtime.launch = tracked_launch  # type: ignore[method-assign]
        runtime.restore = tracked_restore  # type: ignore[method-assign]
        return handle

    yield start
    for h in started:
        await h.shutdown(abrupt=True)
    for runtime, key in workloads:
        with contextlib.suppress(Exception):
            await runtime.stop(key)
    # PodSnapshotContents are cluster-scoped: they outlive the test's namespace.
    while CONTENTS:
        with contextlib.suppress(ApiError):
            await kube.delete(POD_SNAPSHOT_CONTENT, CONTENTS.pop())


def pod(name: str, node: str, labels: dict[str, str], state_mib: int = 32) -> Obj:
    annotations = (
        {protocol.ANNOTATION_RESTORE_FROM: labels[protocol.LABEL_CHECKPOINT_ID]}
        if labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE
        else {}
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE, **labels},
            "annotations": annotations,
        },
        "spec": {
            "nodeName": node,  # bound directly: this test is about the agent, not the scheduler
            "containers": [
                {
                    "name": "main",
                    "image": "worker:test",
                    "command": [sys.executable, str(WORKER)],
                    "env": [
                        {"name": "PYTHONPATH", "value": str(REPO)},
                        {"name": "WORKER_STATE_MIB", "value": str(state_mib)},
                    ],
                }
            ],
        },
    }


TARGET = {
    protocol.LABEL_RESTORE_TARGET: protocol.TRUE,
    protocol.LABEL_CHECKPOINT_HASH: HASH,
    protocol.LABEL_CHECKPOINT_ID: CKPT,
}
# The PodSnapshotContents made here, deleted when the test's agents are.
CONTENTS: list[str] = []


def snapshot_name(source: str) -> str:
    """The PodSnapshot that captures source pod ``source``."""
    return f"{source}-snapshot"


async def make_checkpoint(kube: Kube, ns: str, name: str = CKPT, **meta: Any) -> Obj:
    """The DynamoCheckpoint, made once per name (``meta`` goes into a new one's metadata)."""
    try:
        created: Obj = await kube.create(
            CHECKPOINT,
            {
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "DynamoCheckpoint",
                "metadata": {"name": name, **meta},
                "spec": {"identity": IDENTITY, "job": {"podTemplateSpec": {"spec": {"containers": []}}}},
            },
            ns,
        )
        return created
    except ApiError as e:
        if not is_already_exists(e):
            raise
        found: Obj = await kube.get(CHECKPOINT, name, ns)
        return found


async def make_snapshot(kube: Kube, ns: str, ckpt: Obj, source: Obj, node: str) -> tuple[Obj, Obj]:
    """What the controller makes to take ``ckpt`` of pod ``source``: a PodSnapshot the checkpoint controls,
    and the PodSnapshotContent bound to it, labelled with ``node`` (the agent of that node captures it)."""
    pod_ref = {"name": source["metadata"]["name"], "uid": source["metadata"]["uid"], "containers": ["main"]}
    snapshot: Obj = await kube.create(
        POD_SNAPSHOT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {
                "name": snapshot_name(source["metadata"]["name"]),
                "ownerReferences": [owner_reference(ckpt)],
            },
            "spec": {"source": {"podRef": pod_ref}},
        },
        ns,
    )
    meta = snapshot["metadata"]
    name = content_name(meta["uid"])
    CONTENTS.append(name)
    content: Obj = await kube.create(
        POD_SNAPSHOT_CONTENT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshotContent",
            "metadata": {"name": name, "labels": {protocol.LABEL_SNAPSHOT_NODE: node}},
            "spec": {
                "snapshotRef": {"namespace": ns, "name": meta["name"], "uid": meta["uid"]},
                "source": {"nodeName": node, "podRef": pod_ref},
            },
        },
    )
    return snapshot, content


def source_pod(name: str, node: str, state_mib: int = 32, **env: str) -> Obj:
    """A source pod (no labels of ours: the capture of its content launches its worker), with ``env``
    added to its worker's."""
    body = pod(name, node, {}, state_mib)
    del body["metadata"]["labels"][protocol.LABEL_MANAGED_BY]
    body["spec"]["containers"][0]["env"] += [{"name": k, "value": v} for k, v in env.items()]
    return body


async def create_source(
    kube: Kube, ns: str, name: str, node: str, state_mib: int = 32, ckpt: str = CKPT, **env: str
) -> Obj:
    """A source pod of DynamoCheckpoint ``ckpt`` (made if missing) on ``node``, its PodSnapshot and its
    content; the content."""
    checkpoint = await make_checkpoint(kube, ns, ckpt)
    source = await kube.create(POD, source_pod(name, node, state_mib, **env), ns)
    _, content = await make_snapshot(kube, ns, checkpoint, source, node)
    return content


async def snapshot_of(kube: Kube, ns: str, source: str) -> Obj:
    found: Obj = await kube.get(POD_SNAPSHOT, snapshot_name(source), ns)
    return found


async def content_of(kube: Kube, ns: str, source: str) -> Obj:
    uid = (await snapshot_of(kube, ns, source))["metadata"]["uid"]
    found: Obj = await kube.get(POD_SNAPSHOT_CONTENT, content_name(uid))
    return found


async def artifact_key_of(kube: Kube, ns: str, source: str = "source") -> str:
    return artifact_key(ns, (await snapshot_of(kube, ns, source))["metadata"]["uid"])


def conditions_of(obj: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


async def record_capture(kube: Kube, ns: str, ckpt: str, snapshot: Obj, content: Obj) -> None:
    """What the controller writes once ``content`` is Ready: the PodSnapshot Ready and bound to it, the
    DynamoCheckpoint Ready with the PodSnapshot's name and the artifact's digest and location."""
    outcome = cond.set_outcome([], True, "Captured", CAPTURED_MESSAGE, None)
    bound = {"boundSnapshotContentName": content["metadata"]["name"], "conditions": outcome}
    await kube.patch_status(POD_SNAPSHOT, snapshot["metadata"]["name"], bound, ns)
    artifact = (content.get("status") or {}).get("artifact") or {}
    status = {
        "phase": "Ready",
        "podSnapshotName": snapshot["metadata"]["name"],
        "artifactDigest": artifact.get("digest"),
        "location": artifact.get("location"),
    }
    await kube.patch_status(CHECKPOINT, ckpt, status, ns)


async def _captured(kube: Kube, ns: str, source: str) -> Obj | None:
    content = await content_of(kube, ns, source)
    conds = conditions_of(content)
    if conds.get("Failed", {}).get("status") == "True":
        raise AssertionError(content.get("status"))
    return content if conds.get("Ready", {}).get("status") == "True" else None


async def _checkpointed(kube: Kube, ns: str, source: str, ckpt: str = CKPT) -> dict[str, Any]:
    """The content's status once the agent captured ``source``; the PodSnapshot and the DynamoCheckpoint
    are then made Ready as the controller makes them."""
    content: Obj = await eventually(lambda: _captured(kube, ns, source), within=60)
    await record_capture(kube, ns, ckpt, await snapshot_of(kube, ns, source), content)
    status: dict[str, Any] = content["status"]
    return status


async def recorded_checkpoint(kube: Kube, ns: str, digest: str) -> None:
    """DynamoCheckpoint CKPT Ready with ``digest``, its PodSnapshot and content saying the same, of a source
    pod on a node no agent watches (nothing is captured): a restore from it is granted."""
    node = f"no-agent-{uuid.uuid4().hex[:6]}"
    checkpoint = await make_checkpoint(kube, ns)
    source = await kube.create(POD, source_pod("unwatched", node), ns)
    snapshot, content = await make_snapshot(kube, ns, checkpoint, source, node)
    content["status"] = {"artifact": {"location": "/nowhere", "digest": digest, "sizeBytes": 0}}
    await kube.patch_status(POD_SNAPSHOT_CONTENT, content["metadata"]["name"], content["status"])
    await record_capture(kube, ns, CKPT, snapshot, content)


async def _annotations(kube: Kube, ns: str, name: str) -> dict[str, str]:
    return dict((await kube.get(POD, name, ns))["metadata"].get("annotations") or {})


async def _status(kube: Kube, ns: str, name: str, key: str, want: str) -> dict[str, str] | None:
    ann = await _annotations(kube, ns, name)
    got = ann.get(protocol.per_container(key, "main"))
    if got == "failed" and want != "failed":
        raise AssertionError(ann)
    return ann if got == want else None


async def _verified(path: Path) -> dict[str, Any]:
    def load() -> dict[str, Any] | None:
        return json.loads(path.read_text()) if path.exists() else None

    async def read() -> dict[str, Any] | None:
        return await asyncio.to_thread(load)

    return await eventually(read, within=30)


@pytest.mark.parametrize("runtime_kind", ["local", "runc"])
async def test_checkpoint_on_one_node_restore_on_another(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    runtime_kind: str,
) -> None:
    kube = Kube(api)
    node_a, node_b = (gpu_node()["metadata"]["name"] for _ in range(2))
    a = await agents(node_a, runtime_kind)
    b = await agents(node_b, runtime_kind)
    await create_source(kube, namespace, "source", node_a)
    status = await _checkpointed(kube, namespace, "source")
    key = await artifact_key_of(kube, namespace)
    location = status["artifact"]["location"]
    assert location.endswith(key)
    artifact = ArtifactStore(Path(location).parents[1]).open(key)
    assert artifact.manifest.timings["criu_dump"] > 0
    assert artifact.manifest.digest == status["artifact"]["digest"]
    binding = artifact.manifest.binding
    assert binding is not None
    assert (binding.checkpoint_name, binding.source_pod) == (snapshot_name("source"), "source")
    # Sealed with the DynamoCheckpoint's identity: the checkpoint controls the PodSnapshot.
    assert artifact.manifest.identity_hash == HASH
    assert artifact.manifest.identity is not None
    assert artifact.manifest.identity.compute_hash() == HASH
    assert artifact.manifest.source_node == node_a
    # The worker's pages are stored as CRIU wrote them (compression is off unless turned on).
    assert not any(is_packed_pages(f.path) for f in artifact.manifest.files)

    replicas = ["restored-1", "restored-2"] if runtime_kind == "runc" else ["restored-1"]
    for name in replicas:
        await kube.create(POD, pod(name, node_b, TARGET), namespace)
    for name in replicas:
        ann = await eventually(
            lambda n=name: _status(kube, namespace, n, protocol.ANNOTATION_RESTORE_STATUS, "completed"),
            within=60,
        )
        timings = json.loads(ann[protocol.ANNOTATION_RESTORE_TIMINGS])
        assert "criu_restore" in timings
        assert "unpack_wait" not in timings  # nothing to unpack: the pages are stored as CRIU wrote them
        workload = await _workload(kube, b.runtime, namespace, name)
        assert workload is not None
        verify = await _verified(workload.control_dir / "verify.json")
        assert verify["digest_after"] == verify["digest_before"], "memory changed across checkpoint/restore"
        assert verify["restored"] is True
        assert verify["pod_name"] == name, "the worker learns its new identity after restore"
    assert a.node != b.node


async def test_second_restore_on_a_node_reads_its_cache(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    node_a, node_b = (gpu_node()["metadata"]["name"] for _ in range(2))
    await agents(node_a, "runc")
    b = await agents(node_b, "runc", cache=True)
    await create_source(kube, namespace, "source", node_a)
    await _checkpointed(kube, namespace, "source")
    messages = []
    for name in ("restored-1", "restored-2"):
        await kube.create(POD, pod(name, node_b, TARGET), namespace)
        ann = await eventually(
            lambda n=name: _status(kube, namespace, n, protocol.ANNOTATION_RESTORE_STATUS, "completed"),
            within=60,
        )
        messages.append(ann[protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")])
        workload = await _workload(kube, b.runtime, namespace, name)
        assert workload is not None
        verify = await _verified(workload.control_dir / "verify.json")
        assert verify["digest_after"] == verify["digest_before"], "memory changed across checkpoint/restore"
        await b.agent.executor.wait_cache_fills()
    assert not messages[0].endswith("(node cache)"), messages
    assert messages[1].endswith("(node cache)"), messages


async def test_flipped_byte_refuses_restore(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    b = await agents(node)
    await create_source(kube, namespace, "source", node)
    status = await _checkpointed(kube, namespace, "source")
    images = Path(status["artifact"]["location"]) / "criu"
    victim = max(images.glob("pages-*"), key=lambda p: p.stat().st_size)  # stored compressed or not
    with victim.open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    await kube.create(POD, pod("restored", node, TARGET), namespace)
    ann = await eventually(
        lambda: _status(kube, namespace, "restored", protocol.ANNOTATION_RESTORE_STATUS, "failed"), within=60
    )
    message = ann[protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")]
    assert "checksum mismatch" in message
    assert victim.name in message
    assert await _workload(kube, b.runtime, namespace, "restored") is None, "nothing may be left running"


async def test_incompatible_gpu_is_refused_naming_both(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    node_a, node_b = (gpu_node()["metadata"]["name"] for _ in range(2))
    await agents(node_a, gpus=H200)
    a100 = GpuInfo(
        product="NVIDIA-A100-SXM4-80GB",
        driver_version="535.1",
        cuda_driver_major="535",
        count=1,
        uuids=["GPU-bbbbbbbb-0000-0000-0000-000000000002"],
        memory_mib=81920,
    )
    await agents(node_b, gpus=a100)
    await create_source(kube, namespace, "source", node_a)
    await _checkpointed(kube, namespace, "source")
    await kube.create(POD, pod("restored", node_b, TARGET), namespace)
    ann = await eventually(
        lambda: _status(kube, namespace, "restored", protocol.ANNOTATION_RESTORE_STATUS, "failed"), within=60
    )
    message = ann[protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")]
    assert "NVIDIA-H200" in message
    assert "NVIDIA-A100-SXM4-80GB" in message
    # The condition follows the annotation.
    restored = await eventually(
        lambda: _restored_condition(kube, namespace, "restored", "RestoreIncompatible"), within=30
    )
    assert restored["status"] == "False"
    assert (
        "NVIDIA-A100-SXM4-80GB"
        in (await _event(kube, namespace, "RestoreIncompatible", "restored"))["message"]
    )

    # A value Go's ParseBool does not read as true leaves the refusal as it is.
    skip = protocol.ANNOTATION_SKIP_COMPAT_CHECK
    await kube.merge_patch(POD, "restored", {"metadata": {"annotations": {skip: "yes"}}}, namespace)
    await asyncio.sleep(2)
    assert await _restored_condition(kube, namespace, "restored", "RestoreIncompatible")
    # "true" reopens the refused restore in place: the same pod, restored on the A100 node anyway.
    await kube.merge_patch(POD, "restored", {"metadata": {"annotations": {skip: "true"}}}, namespace)
    await eventually(
        lambda: _status(kube, namespace, "restored", protocol.ANNOTATION_RESTORE_STATUS, "completed"),
        within=60,
    )
    restored = await eventually(
        lambda: _restored_condition(kube, namespace, "restored", "RestoreSucceeded"), within=30
    )
    assert restored["status"] == "True"
    await _event(kube, namespace, "RestoreCompatibilityCheckSkipped", "restored")


async def _restored_condition(
    kube: Kube, ns: str, name: str, reason: str | None = None
) -> dict[str, Any] | None:
    """The pod's nvidia.com/Restored condition; with ``reason``, None until it has that reason."""
    pod = await kube.get(POD, name, ns)
    found: dict[str, Any] = next(
        c for c in pod["status"].get("conditions") or [] if c["type"] == protocol.POD_CONDITION_RESTORED
    )
    return found if reason is None or found.get("reason") == reason else None


async def test_agent_killed_mid_dump_publishes_nothing_and_the_next_one_captures_again(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    first = await agents(node)
    dumps = _count_calls(first.agent.executor, "checkpoint")
    await create_source(kube, namespace, "source", node, state_mib=1024)

    async def dumping() -> bool:
        return bool(dumps)

    await eventually(dumping, within=60, interval=0.02)
    await asyncio.sleep(0.2)
    await first.shutdown(abrupt=True)  # the dump of 1 GiB is under way
    store = ArtifactStore(tmp_path / "artifacts")
    key = await artifact_key_of(kube, namespace)
    assert not store.exists(key), "a killed dump must never be published"
    ready = conditions_of(await content_of(kube, namespace, "source"))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "CaptureInProgress")

    # The next agent finds the content without an outcome and nothing published: it captures again.
    await agents(node)
    status = await _checkpointed(kube, namespace, "source")
    artifact = store.open(key)
    assert artifact.manifest.digest == status["artifact"]["digest"]
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".")] == [], "staging left behind"


async def test_pods_of_other_nodes_are_never_touched(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    mine, other = (gpu_node()["metadata"]["name"] for _ in range(2))
    agent = await agents(mine)
    foreign = f"elsewhere-{uuid.uuid4().hex[:4]}"
    await create_source(kube, namespace, foreign, other)
    # Positive control: the same kind of pod and content on the agent's own node is captured, so the
    # silence about the foreign ones below comes from the node filters, not from an agent that does nothing.
    await create_source(kube, namespace, "local", mine)
    await _checkpointed(kube, namespace, "local")
    ann = await _annotations(kube, namespace, foreign)
    assert not any(
        k.startswith("nvidia.com/snapshot-") and k != protocol.ANNOTATION_TARGET_CONTAINERS for k in ann
    )
    assert [p["metadata"]["name"] for p in agent.agent.pods.list()] == ["local"]
    assert conditions_of(await content_of(kube, namespace, foreign)) == {}, "another node's content taken up"


async def _checkpoint_then_second_node(
    kube: Kube,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    launch: bool = True,
) -> AgentHandle:
    """Two nodes with agents; a source pod checkpointed on the first. Returns the second's agent."""
    node_a, node_b = (gpu_node()["metadata"]["name"] for _ in range(2))
    await agents(node_a)
    b: AgentHandle = await agents(node_b, launch=launch)
    await create_source(kube, namespace, "source", node_a)
    await _checkpointed(kube, namespace, "source")
    return b


async def _restored(kube: Kube, namespace: str, name: str) -> None:
    await eventually(
        lambda: _status(kube, namespace, name, protocol.ANNOTATION_RESTORE_STATUS, "completed"), within=60
    )


async def test_an_unexpected_error_is_retried(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents)

    # The first restore attempt hits something the agent does not expect (say, the apiserver timing
    # out while it reads the pod): it must not be the end of that pod.
    real = b.agent.executor.restore
    calls = 0

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("transient: connection reset by peer")
        return await real(*args, **kwargs)

    b.agent.executor.restore = flaky  # type: ignore[method-assign]
    await kube.create(POD, pod("restored", b.node, TARGET), namespace)
    await _restored(kube, namespace, "restored")
    assert calls == 2


EXITED = protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, "main")


async def _workload(kube: Kube, runtime: Runtime, ns: str, name: str) -> Any:
    return await runtime.find(workload_key(await kube.get(POD, name, ns)))


async def _stopped(pid: int) -> bool:
    return not pid_running(pid)


async def test_a_killed_restored_worker_is_reported(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents)
    await kube.create(POD, pod("restored", b.node, TARGET), namespace)
    await _restored(kube, namespace, "restored")
    workload = await _workload(kube, b.runtime, namespace, "restored")
    assert workload is not None
    await asyncio.sleep(0.5)
    assert EXITED not in await _annotations(kube, namespace, "restored"), "reported while still alive"

    os.kill(workload.pid, signal.SIGKILL)
    ann = await eventually(
        lambda: _annotations_with(kube, namespace, "restored", EXITED), within=15, interval=0.05
    )
    assert str(workload.pid) in ann[EXITED]


async def test_a_launched_worker_that_dies_is_reported_not_restarted(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    await kube.create(POD, _plain_pod("cold", node), namespace)
    first = await eventually(lambda: _workload(kube, a.runtime, namespace, "cold"), within=30)
    os.kill(first.pid, signal.SIGKILL)
    await eventually(lambda: _annotations_with(kube, namespace, "cold", EXITED), within=15, interval=0.05)
    # One agent process never dispatches a pod twice (its task lasts as long as the pod), so only a new
    # process, which reads the exit from the pod, shows that a dead worker is left to the controller.
    await a.shutdown()
    await kube.create(POD, _plain_pod("late", node), namespace)
    again = await agents(node)
    # Positive control: the new agent launches the pod created while none ran.
    await eventually(lambda: _workload(kube, again.runtime, namespace, "late"), within=30)
    await asyncio.sleep(1.0)
    assert await _workload(kube, again.runtime, namespace, "cold") is None, (
        "the agent relaunched a dead worker"
    )


@pytest.mark.parametrize("killed", ["after_the_restart", "while_the_agent_is_down"])
async def test_a_restored_worker_is_watched_across_an_agent_restart(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    killed: str,
) -> None:
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents)
    await kube.create(POD, pod("restored", b.node, TARGET), namespace)
    await _restored(kube, namespace, "restored")
    worker = await _workload(kube, b.runtime, namespace, "restored")
    assert worker is not None
    await b.shutdown()  # the restored worker outlives its agent
    if killed == "while_the_agent_is_down":
        os.kill(worker.pid, signal.SIGKILL)
        # Dead, if not yet reaped by init (its parent since CRIU detached): the runtime must not find a
        # zombie, or the new agent would report the exit as seen.
        await eventually(lambda: _stopped(worker.pid), within=15)
    again = await agents(b.node)
    if killed == "after_the_restart":
        await eventually(lambda: _listed(again, "restored"), within=15)
        await asyncio.sleep(0.5)  # time to find the worker again
        assert EXITED not in await _annotations(kube, namespace, "restored"), "reported while still alive"
        os.kill(worker.pid, signal.SIGKILL)
    ann = await eventually(
        lambda: _annotations_with(kube, namespace, "restored", EXITED), within=15, interval=0.05
    )
    if killed == "after_the_restart":
        assert str(worker.pid) in ann[EXITED], "the new agent watched the worker it found"
    else:
        assert "gone while the node agent was down" in ann[EXITED]


async def _listed(handle: AgentHandle, name: str) -> bool:
    return name in [p["metadata"]["name"] for p in handle.agent.pods.list()]


async def test_a_failed_exit_report_is_retried_without_relaunching_the_worker(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    real_patch, real_launch = a.agent.kube.merge_patch, a.runtime.launch
    refused: list[str] = []
    launched: list[str] = []

    async def flaky_patch(kind: Any, name: str, patch: Obj, *args: Any, **kwargs: Any) -> Any:
        # The apiserver turns down the first report of the exit (not a 404: the pod is still there).
        if EXITED in (patch["metadata"].get("annotations") or {}) and not refused:
            refused.append(name)
            raise ApiError(503, "ServiceUnavailable", "transient: etcd leader changed")
        return await real_patch(kind, name, patch, *args, **kwargs)

    async def counted_launch(spec: Any) -> Any:
        launched.append(spec.key)
        return await real_launch(spec)

    a.agent.kube.merge_patch = flaky_patch  # type: ignore[method-assign]
    a.runtime.launch = counted_launch  # type: ignore[method-assign]
    await kube.create(POD, _plain_pod("cold", node), namespace)
    first = await eventually(lambda: _workload(kube, a.runtime, namespace, "cold"), within=30)
    os.kill(first.pid, signal.SIGKILL)
    ann = await eventually(
        lambda: _annotations_with(kube, namespace, "cold", EXITED), within=15, interval=0.05
    )
    assert refused == ["cold"]
    assert str(first.pid) in ann[EXITED]
    assert len(launched) == 1, "the agent relaunched a dead worker"
    assert await _workload(kube, a.runtime, namespace, "cold") is None


async def _exit_report_refused(
    kube: Kube,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    errors: list[Exception],
) -> tuple[list[str], int]:
    """A launched worker killed while the apiserver answers the report of its exit with `errors`, one
    per attempt, then takes it. Returns the pods whose report was refused, and the worker's pid."""
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    real_patch = a.agent.kube.merge_patch
    refused: list[str] = []

    async def refusing_patch(kind: Any, name: str, patch: Obj, *args: Any, **kwargs: Any) -> Any:
        if EXITED in (patch["metadata"].get("annotations") or {}) and len(refused) < len(errors):
            refused.append(name)
            raise errors[len(refused) - 1]
        return await real_patch(kind, name, patch, *args, **kwargs)

    a.agent.kube.merge_patch = refusing_patch  # type: ignore[method-assign]
    await kube.create(POD, _plain_pod("cold", node), namespace)
    worker = await eventually(lambda: _workload(kube, a.runtime, namespace, "cold"), within=30)
    os.kill(worker.pid, signal.SIGKILL)
    return refused, worker.pid


@pytest.mark.parametrize(
    "error",
    [
        ApiError(403, "Forbidden", 'pods "cold" is forbidden: User "agent" cannot patch resource "pods"'),
        ApiError(404, "NotFound", 'pods "cold" not found'),
        ApiError(422, "Invalid", 'Pod "cold" is invalid: metadata.annotations: Too long'),
    ],
    ids=lambda e: str(e.status),
)
async def test_an_exit_report_refused_for_good_is_given_up(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    error: ApiError,
) -> None:
    kube = Kube(api)
    # Refused however often it is tried: only the first attempt may be made.
    refused, _ = await _exit_report_refused(kube, namespace, gpu_node, agents, [error] * 10)

    async def given_up() -> list[Any]:
        return [r for r in caplog.records if r.getMessage().startswith("giving up on the pod's annotations")]

    [record] = await eventually(given_up, within=15, interval=0.05)
    assert (record.pod, record.http_status, record.reason) == (  # type: ignore[attr-defined]
        workload_key(await kube.get(POD, "cold", namespace)),
        error.status,
        error.reason,
    )
    await asyncio.sleep(1.5)  # past the first retry's backoff (1 s)
    assert refused == ["cold"], "a permanent error was retried"
    assert EXITED not in await _annotations(kube, namespace, "cold")


@pytest.mark.parametrize(
    "error",
    [
        ApiError(429, "TooManyRequests", "the server has received too many requests"),
        ApiError(500, "InternalError", "etcdserver: request timed out"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
    ids=["429", "500", "connection-reset"],
)
async def test_an_exit_report_is_retried_through_transient_errors(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    error: Exception,
) -> None:
    kube = Kube(api)
    refused, pid = await _exit_report_refused(kube, namespace, gpu_node, agents, [error, error])
    ann = await eventually(
        lambda: _annotations_with(kube, namespace, "cold", EXITED), within=15, interval=0.05
    )
    assert refused == ["cold", "cold"]
    assert str(pid) in ann[EXITED]


RESTORE_STATUS = protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")


async def test_a_failed_restore_report_is_retried_leaving_the_restored_worker_running(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents)
    refused = _refuse_first_completed(b, RESTORE_STATUS)  # the finished restore's report
    restores = _count_calls(b.agent.executor, "restore")
    await kube.create(POD, pod("restored", b.node, TARGET), namespace)
    await _restored(kube, namespace, "restored")
    assert refused == ["restored"]
    assert len(restores) == 1, "the healthy restored worker was torn down and restored anew"
    worker = await _workload(kube, b.runtime, namespace, "restored")
    assert worker is not None
    await asyncio.sleep(0.5)
    assert EXITED not in await _annotations(kube, namespace, "restored"), "the restored worker is gone"


def _reports_completed(patch: Obj, key: str) -> bool:
    return (patch["metadata"].get("annotations") or {}).get(key) == "completed"


def _refuse_first_completed(handle: AgentHandle, key: str) -> list[str]:
    """The apiserver turns down, once, the agent's patch that sets `key` to completed; the names of the
    pods it was refused for."""
    real_patch = handle.agent.kube.merge_patch
    refused: list[str] = []

    async def flaky_patch(kind: Any, name: str, patch: Obj, *args: Any, **kwargs: Any) -> Any:
        if _reports_completed(patch, key) and not refused:
            refused.append(name)
            raise ApiError(503, "ServiceUnavailable", "transient: etcd leader changed")
        return await real_patch(kind, name, patch, *args, **kwargs)

    handle.agent.kube.merge_patch = flaky_patch  # type: ignore[method-assign]
    return refused


def _count_calls(obj: Any, method: str) -> list[tuple[Any, ...]]:
    """Every call of obj.method from now on, by its positional arguments."""
    real = getattr(obj, method)
    calls: list[tuple[Any, ...]] = []

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return await real(*args, **kwargs)

    setattr(obj, method, counted)
    return calls


def _reports_captured(status: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])


async def test_a_failed_capture_report_is_retried_not_reported_as_a_failure(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    real_patch = a.agent.kube.patch_status
    refused: list[str] = []

    async def flaky_patch(kind: Any, name: str, status: Obj, *args: Any, **kwargs: Any) -> Any:
        # The apiserver turns down, once, the content's Ready outcome.
        if kind is POD_SNAPSHOT_CONTENT and _reports_captured(status) and not refused:
            refused.append(name)
            raise ApiError(503, "ServiceUnavailable", "transient: etcd leader changed")
        return await real_patch(kind, name, status, *args, **kwargs)

    a.agent.kube.patch_status = flaky_patch  # type: ignore[method-assign]
    checkpoints = _count_calls(a.agent.executor, "checkpoint")
    content = await create_source(kube, namespace, "source", node)
    status = await _checkpointed(kube, namespace, "source")
    assert refused == [content["metadata"]["name"]]
    assert [identity_hash for _, identity_hash, *_ in checkpoints] == [HASH]
    key = await artifact_key_of(kube, namespace)
    assert status["artifact"]["location"].endswith(key)
    assert ArtifactStore(tmp_path / "artifacts").exists(key)
    await asyncio.sleep(1.5)  # past the retry's backoff (1 s): the outcome must stay Ready
    conds = conditions_of(await content_of(kube, namespace, "source"))
    assert (conds["Ready"]["status"], conds["Failed"]["status"]) == ("True", "False")


async def test_a_capture_published_by_an_agent_killed_before_its_report_is_reported_ready(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    first = await agents(node)
    real_patch = first.agent.kube.patch_status
    held: list[str] = []

    async def hanging_patch(kind: Any, name: str, status: Obj, *args: Any, **kwargs: Any) -> Any:
        # The first report of the published capture never reaches the apiserver: the agent dies while
        # it is on its way.
        if kind is POD_SNAPSHOT_CONTENT and _reports_captured(status) and not held:
            held.append(name)
            await asyncio.Event().wait()
        return await real_patch(kind, name, status, *args, **kwargs)

    first.agent.kube.patch_status = hanging_patch  # type: ignore[method-assign]
    await create_source(kube, namespace, "source", node)

    async def report_held() -> bool:
        return bool(held)

    await eventually(report_held, within=60)
    await first.shutdown(abrupt=True)
    store = ArtifactStore(tmp_path / "artifacts")
    key = await artifact_key_of(kube, namespace)
    published = store.open(key).manifest.digest
    ready = conditions_of(await content_of(kube, namespace, "source"))["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "CaptureInProgress")

    await agents(node)
    status = await _checkpointed(kube, namespace, "source")
    # The artifact found published is reported, not taken anew (the dump ended the local worker).
    assert status["artifact"] == {
        "location": str(store.path_for(key)),
        "digest": published,
        "sizeBytes": sum(f.size for f in store.open(key).manifest.files),
    }


async def test_a_deleted_pods_worker_is_stopped_without_a_failure_report(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    held = _plain_pod("leaving", node)
    held["metadata"]["finalizers"] = ["tests.dynamo-snapshot.dev/hold"]  # keep it readable after delete
    await kube.create(POD, held, namespace)
    worker = await eventually(lambda: _workload(kube, a.runtime, namespace, "leaving"), within=30)
    await kube.delete(POD, "leaving", namespace)
    await eventually(lambda: _stopped(worker.pid), within=15)
    await asyncio.sleep(0.5)
    try:
        assert EXITED not in await _annotations(kube, namespace, "leaving"), "a scale-down reported as a loss"
    finally:
        await kube.merge_patch(POD, "leaving", {"metadata": {"finalizers": None}}, namespace)


def _plain_pod(name: str, node: str) -> Obj:
    """A cold-start worker (no snapshot labels): it gets no control dir, and just serves."""
    plain = pod(name, node, {})
    plain["spec"]["containers"][0]["command"] = [
        sys.executable,
        "-c",
        "import os, time; assert not os.environ.get('SNAPSHOT_CONTROL_DIR'); time.sleep(300)",
    ]
    return plain


async def _annotations_with(kube: Kube, ns: str, name: str, key: str) -> dict[str, str] | None:
    ann = await _annotations(kube, ns, name)
    return ann if key in ann else None


async def test_a_restored_worker_goes_with_its_pod_on_a_kubelet_node(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    # Where a kubelet runs the pods (no --launch-workloads) it stops only what it started: the worker
    # the agent restored is the agent's to stop when the pod goes (a scale-down must free the GPU).
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents, launch=False)
    await kube.create(POD, pod("restored", b.node, TARGET), namespace)
    await _restored(kube, namespace, "restored")
    worker = await _workload(kube, b.runtime, namespace, "restored")
    assert worker is not None
    await kube.delete(POD, "restored", namespace)
    await eventually(lambda: _stopped(worker.pid), within=15)


# ---------------------------------------------------------------------------------------- tenancy
def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.fixture
def other_namespace(cluster: Any) -> Iterator[str]:
    name = f"tenant-b-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


async def test_two_tenants_with_one_identity_never_share_a_process(
    api: client.ApiClient,
    namespace: str,
    other_namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    # Same checkpoint name, same identity (so the same identity hash) in two namespaces.
    await create_source(kube, namespace, "source", node, TENANT_SECRET="a-secret")
    status_a = await _checkpointed(kube, namespace, "source")
    await create_source(kube, other_namespace, "source", node, TENANT_SECRET="b-secret")
    status_b = await _checkpointed(kube, other_namespace, "source")
    store = ArtifactStore(tmp_path / "artifacts")
    keys = [await artifact_key_of(kube, namespace), await artifact_key_of(kube, other_namespace)]
    assert set(store.list()) == set(keys)
    assert status_a["artifact"]["digest"] != status_b["artifact"]["digest"], (
        "tenant B was handed A's artifact"
    )
    assert [store.open(key).manifest.identity_hash for key in keys] == [HASH, HASH]
    await kube.create(POD, pod("restored", node, TARGET), other_namespace)
    await _restored(kube, other_namespace, "restored")
    worker = await _workload(kube, a.runtime, other_namespace, "restored")
    env = _environ(worker.pid)
    assert env["TENANT_SECRET"] == "b-secret"
    assert env["POD_NAMESPACE"] == other_namespace


async def test_a_pod_of_another_namespace_is_not_restored(
    api: client.ApiClient,
    namespace: str,
    other_namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    await create_source(kube, namespace, "source", node)
    await _checkpointed(kube, namespace, "source")
    # The victim's labels and checkpoint name, copied onto a pod in the attacker's namespace.
    await kube.create(POD, pod("forged", node, TARGET), other_namespace)
    ann = await eventually(
        lambda: _status(kube, other_namespace, "forged", protocol.ANNOTATION_RESTORE_STATUS, "failed"),
        within=30,
    )
    message = ann[protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")]
    assert message == (
        f"refused: neither a DynamoCheckpoint nor a PodSnapshot named {CKPT!r} exists in namespace "
        f"{other_namespace}: a pod is restored only from one of its own namespace"
    )
    assert await _workload(kube, a.runtime, other_namespace, "forged") is None
    event = await _event(kube, other_namespace, "RestoreRefused", "forged")
    assert event["message"] == message


LEGACY_SOURCE = {
    protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
    protocol.LABEL_CHECKPOINT_SOURCE: protocol.TRUE,
    protocol.LABEL_CHECKPOINT_HASH: HASH,
    protocol.LABEL_CHECKPOINT_ID: CKPT,
}


async def test_a_pod_labelled_as_a_checkpoint_source_is_never_captured(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """Only a content the PodSnapshot grants is captured: labels, a checkpoint's name among them, grant
    nothing. The planted pod is a cold start to the agent (launched without a control directory)."""
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    await make_checkpoint(kube, namespace)
    planted = _plain_pod("planted", node)
    planted["metadata"]["labels"].update(LEGACY_SOURCE)
    await kube.create(POD, planted, namespace)
    await eventually(lambda: _workload(kube, a.runtime, namespace, "planted"), within=30)
    # Positive control: the real source is captured meanwhile.
    await create_source(kube, namespace, "source", node)
    await _checkpointed(kube, namespace, "source")
    assert ArtifactStore(tmp_path / "artifacts").list() == [await artifact_key_of(kube, namespace)]
    ann = await _annotations(kube, namespace, "planted")
    assert not any(k.startswith("nvidia.com/snapshot-") for k in ann), ann


async def test_a_podsnapshot_of_a_checkpoint_being_deleted_is_not_captured(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """The identity a capture is sealed with is that of the DynamoCheckpoint controlling the PodSnapshot
    (read by the agent): one being deleted fails the content with the reason, storing nothing. (Each
    refusal of the grant: test_authorize.)"""
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    await agents(node)
    ckpt = await make_checkpoint(kube, namespace, finalizers=["tests.dynamo-snapshot.dev/hold"])
    # Background deletion: the finalizer keeps the checkpoint, so the collector keeps its PodSnapshot.
    await kube.delete(CHECKPOINT, CKPT, namespace)
    source = await kube.create(POD, source_pod("source", node), namespace)
    _, content = await make_snapshot(kube, namespace, ckpt, source, node)
    try:

        async def failed() -> Obj | None:
            conds = conditions_of(await kube.get(POD_SNAPSHOT_CONTENT, content["metadata"]["name"]))
            return conds["Failed"] if conds.get("Failed", {}).get("status") == "True" else None

        condition = await eventually(failed, within=60)
        assert (condition["reason"], condition["message"]) == (
            "CheckpointDeleted",
            f"DynamoCheckpoint {namespace}/{CKPT} is being deleted",
        )
        assert ArtifactStore(tmp_path / "artifacts").list() == []
    finally:
        await kube.merge_patch(CHECKPOINT, CKPT, {"metadata": {"finalizers": None}}, namespace)


async def test_a_restore_needs_the_artifact_the_checkpoint_recorded(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    b = await _checkpoint_then_second_node(kube, namespace, gpu_node, agents)
    other = "0" * 64
    message = protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")

    async def refused(name: str) -> str:
        await kube.create(POD, pod(name, b.node, TARGET), namespace)
        ann = await eventually(
            lambda: _status(kube, namespace, name, protocol.ANNOTATION_RESTORE_STATUS, "failed"), within=60
        )
        assert await _workload(kube, b.runtime, namespace, name) is None
        return ann[message]

    # The checkpoint records another digest than its PodSnapshot's content.
    recorded = (await kube.get(CHECKPOINT, CKPT, namespace))["status"]["artifactDigest"]
    await kube.patch_status(CHECKPOINT, CKPT, {"artifactDigest": other}, namespace)
    assert "artifact digest mismatch" in await refused("mismatch")
    # Both record it: the artifact published is not the one recorded, and the restore refuses it.
    content = await content_of(kube, namespace, "source")
    await kube.patch_status(
        POD_SNAPSHOT_CONTENT, content["metadata"]["name"], {"artifact": {"digest": other}}
    )
    assert "manifest digest" in await refused("restored")
    await kube.patch_status(CHECKPOINT, CKPT, {"artifactDigest": recorded, "phase": "Creating"}, namespace)
    assert "is not Ready" in await refused("early")


async def test_the_artifact_goes_with_its_checkpoint(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    store = ArtifactStore(tmp_path / "artifacts")
    await create_source(kube, namespace, "source", node)
    await _checkpointed(kube, namespace, "source")
    key = await artifact_key_of(kube, namespace)
    assert store.exists(key)
    await kube.delete(CHECKPOINT, CKPT, namespace)

    async def removed() -> bool:
        return not store.exists(key)

    await eventually(removed, within=30)  # the collector deleted its PodSnapshot, which owned it
    # Deleted while no agent ran: the next agent's sweep removes it.
    await create_source(kube, namespace, "source-2", node)
    await _checkpointed(kube, namespace, "source-2")
    key = await artifact_key_of(kube, namespace, "source-2")
    await a.shutdown()
    await kube.delete(CHECKPOINT, CKPT, namespace)

    async def snapshot_gone() -> bool:
        snapshots, _ = await kube.list_all(POD_SNAPSHOT, namespace)
        return not snapshots

    await eventually(snapshot_gone, within=30)
    assert store.exists(key)
    await agents(node)
    await eventually(removed, within=30)


async def test_an_agent_restart_mid_restore_restores_again(
    api: client.ApiClient, namespace: str, gpu_node: Callable[..., Obj], agents: Callable[..., Any]
) -> None:
    kube = Kube(api)
    node_a, node_b = (gpu_node()["metadata"]["name"] for _ in range(2))
    await agents(node_a)
    b = await agents(node_b)
    await create_source(kube, namespace, "source", node_a, state_mib=512)
    await _checkpointed(kube, namespace, "source")
    await kube.create(POD, pod("restored", node_b, TARGET), namespace)
    await eventually(
        lambda: _status(kube, namespace, "restored", protocol.ANNOTATION_RESTORE_STATUS, "running"),
        within=60,
        interval=0.02,
    )
    await b.shutdown(abrupt=True)
    await agents(node_b)
    ann = await eventually(
        lambda: _status(kube, namespace, "restored", protocol.ANNOTATION_RESTORE_STATUS, "completed"),
        within=60,
    )
    assert ann[protocol.ANNOTATION_RESTORE_ATTEMPTS] == "2"


async def _event(kube: Kube, ns: str, reason: str, pod_name: str) -> Obj:
    async def find() -> Obj | None:
        items, _ = await kube.list_all(EVENT, ns)
        return next(
            (e for e in items if e.get("reason") == reason and e["involvedObject"]["name"] == pod_name),
            None,
        )

    found: Obj = await eventually(find, within=15)
    return found
