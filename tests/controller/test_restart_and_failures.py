"""Crash-safety and failure paths of the controller, against the real control plane."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.kube.kinds import CHECKPOINT, JOB
from tests.helpers.invariants import InvariantWatch

from .conftest import IDENTITY, Harness, dgd_manifest, eventually

pytestmark = pytest.mark.cluster
HASH = compute_identity_hash(IDENTITY)


async def _converged(h: Harness, graph: str, replicas: int) -> bool:
    # Progress only: duplicates are the InvariantWatch's to catch, the moment they exist (an assert here
    # would be retried away by `eventually`).
    return len(await h.pods(graph)) == replicas


async def _assert_final(h: Harness, graph: str, replicas: int) -> None:
    await eventually(lambda: _converged(h, graph, replicas), within=60)
    await asyncio.sleep(2)  # no late duplicates after convergence
    pods = await h.pods(graph)
    assert len(pods) == replicas
    dgd_uid = (await h.dgd(graph))["metadata"]["uid"]
    for pod in pods:
        refs = pod["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == [dgd_uid], "every worker pod is owned by its DGD (no orphans)"
    ckpts = await h.checkpoints()
    assert [c["metadata"]["name"] for c in ckpts] == [await h.auto_checkpoint(graph)]


@pytest.mark.parametrize("kill_after", [0.0, 0.05, 0.3])
async def test_killed_controller_converges_without_duplicates(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]], kill_after: float
) -> None:
    h = harness
    gpu_node(gpus=8)
    gpu_node(gpus=8)
    await h.kill_controller()
    # Watching from before the DGD exists: two checkpoints for its identity, or more worker pods than
    # replicas (plus the surge), at any moment of the run fail the test at its end.
    async with InvariantWatch(h.kube, h.namespace) as watch:
        watch.allow("crash", "VllmWorker", 1)
        await h.apply_dgd(dgd_manifest("crash", replicas=1))
        # Point 1: the controller starts, creates the checkpoint and the first worker, and dies early.
        await h.start_controller()
        await asyncio.sleep(kill_after)
        await h.kill_controller()
        await h.start_controller()
        await _assert_final(h, "crash", 1)

        async def ckpt_ready() -> bool:
            ckpt = await h.kube.get(CHECKPOINT, await h.auto_checkpoint("crash"), h.namespace)
            return (ckpt.get("status") or {}).get("phase") == "Ready"

        await eventually(ckpt_ready, within=45)
        # Point 2: killed in the middle of a scale-up by restore.
        watch.allow("crash", "VllmWorker", 5)
        await h.scale("crash", 5)
        await asyncio.sleep(kill_after)
        await h.kill_controller()
        await h.start_controller()
        await _assert_final(h, "crash", 5)
        # Point 3: killed in the middle of a scale-down.
        await h.scale("crash", 2)
        await asyncio.sleep(kill_after)
        await h.kill_controller()
        await h.start_controller()
        await _assert_final(h, "crash", 2)
        jobs, _ = await h.kube.list_all(JOB, h.namespace)
        assert jobs == [], "the checkpoint's worker (its SnapshotJob's Job) is released once it is Ready"
    watch.assert_clean()


async def test_checkpoint_job_past_deadline_fails_the_checkpoint(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    gpu_node(gpus=8)
    h.agent.checkpoint_outcome = None  # the worker never becomes ready, so nobody checkpoints it
    body = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": "slow"},
        "spec": {
            "identity": IDENTITY,
            "job": {
                "activeDeadlineSeconds": 3,
                "podTemplateSpec": {"spec": {"containers": [{"name": "main", "image": "vllm:test"}]}},
            },
        },
    }
    await h.kube.create(CHECKPOINT, body, h.namespace)

    async def failed() -> dict[str, Any] | None:
        ckpt = await h.kube.get(CHECKPOINT, "slow", h.namespace)
        return ckpt if (ckpt.get("status") or {}).get("phase") == "Failed" else None

    ckpt = await eventually(failed, within=60)
    assert ckpt["status"]["message"].startswith("SnapshotJob slow-checkpoint failed: DeadlineExceeded: ")
    assert ckpt["metadata"]["labels"][protocol.LABEL_CHECKPOINT_HASH] == HASH
    assert await eventually(lambda: h.events("CheckpointFailed"))


async def test_agent_reported_checkpoint_failure(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    gpu_node(gpus=8)
    h.agent.checkpoint_outcome = "failed"
    await h.apply_dgd(dgd_manifest("bad-dump", replicas=2))

    async def failed() -> dict[str, Any] | None:
        ckpt = await h.kube.get(CHECKPOINT, await h.auto_checkpoint("bad-dump"), h.namespace)
        return ckpt if (ckpt.get("status") or {}).get("phase") == "Failed" else None

    ckpt = await eventually(failed, within=45)
    assert "PodSnapshotFailed" in ckpt["status"]["message"]
    assert "criu dump: test failure" in ckpt["status"]["message"]
    pods = await eventually(lambda: _n(h, "bad-dump", 2))
    assert {p["metadata"]["labels"][protocol.LABEL_START_MODE] for p in pods} == {"cold"}

    async def degraded() -> bool:
        conds = (await h.dgd("bad-dump")).get("status", {}).get("conditions") or []
        return any(c["type"] == "Degraded" and c["status"] == "True" and HASH in c["message"] for c in conds)

    await eventually(degraded)


async def _n(h: Harness, graph: str, n: int) -> list[dict[str, Any]] | None:
    pods = await h.pods(graph)
    return pods if len(pods) == n else None


async def test_identity_changed_in_place_keeps_running_replicas(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    gpu_node(gpus=8)
    await h.apply_dgd(dgd_manifest("drift", replicas=2))
    await eventually(lambda: _n(h, "drift", 2))
    old_name = await h.auto_checkpoint("drift")
    await eventually(lambda: _ckpt_named_in_status(h, "drift", old_name))
    before = sorted(p["metadata"]["name"] for p in await h.pods("drift"))
    new_identity = {**IDENTITY, "model": "Qwen/Qwen3-1.7B"}
    patch = {"spec": {"services": {"VllmWorker": {"checkpoint": {"identity": new_identity}}}}}
    await h.dgds.merge_patch("drift", h.namespace, patch)
    assert await eventually(lambda: h.events("IdentityChanged"))
    new_name = await h.auto_checkpoint("drift", new_identity)
    await eventually(lambda: _ckpt_named_in_status(h, "drift", new_name))
    assert sorted(p["metadata"]["name"] for p in await h.pods("drift")) == before, (
        "running replicas were touched"
    )
    names = sorted(c["metadata"]["name"] for c in await h.checkpoints())
    assert names == sorted([old_name, new_name]), "the old checkpoint is kept, a new one is made"


async def _ckpt_named_in_status(h: Harness, graph: str, name: str) -> bool:
    st = ((await h.dgd(graph)).get("status") or {}).get("checkpoints", {}).get("VllmWorker") or {}
    return st.get("checkpointName") == name
