"""The controller against the real apiserver, scheduler, controller-manager and kwok GPU nodes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment, checkpoint_identity
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.kube.kinds import CHECKPOINT, JOB, NODE, POD_SNAPSHOT

from .conftest import ARTIFACT_ROOT, IDENTITY, Harness, dgd_manifest, eventually

pytestmark = pytest.mark.cluster
HASH = compute_identity_hash(IDENTITY)


def _mode(pod: dict[str, Any]) -> str:
    return pod["metadata"]["labels"][protocol.LABEL_START_MODE]


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


async def _ready_checkpoint(h: Harness, graph: str) -> dict[str, Any]:
    return await _ready_checkpoint_of(h, graph, None)


async def _ready_checkpoint_of(h: Harness, graph: str, identity: dict[str, Any] | None) -> dict[str, Any]:
    name = await eventually(lambda: h.auto_checkpoint(graph, identity))

    async def ready() -> dict[str, Any]:
        ckpt = await h.kube.get(CHECKPOINT, name, h.namespace)
        assert (ckpt.get("status") or {}).get("phase") == "Ready", ckpt.get("status")
        return ckpt

    return await eventually(ready, within=45)


async def _gpu_products(h: Harness) -> set[str | None]:
    """The GPU products of the cluster's nodes: nodes are cluster-wide, and earlier tests' nodes may
    still be going (deleted without waiting)."""
    nodes, _ = await h.kube.list_all(NODE, None)
    return {(n["metadata"].get("labels") or {}).get(protocol.LABEL_GPU_PRODUCT) for n in nodes}


async def test_auto_mode_cold_start_checkpoint_then_scale_by_restore(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    # The checkpoint's worker must land on an H200 (the scheduler knows nothing of GPU products).
    await eventually(lambda: _only(h, {"NVIDIA-H200", None}))
    for _ in range(3):
        gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580)
    await h.apply_dgd(dgd_manifest("llama", replicas=1))

    # One cold-start worker, and in the background the DGD's own DynamoCheckpoint with its SnapshotJob.
    pods = await eventually(lambda: h.pods("llama"))
    assert [_mode(p) for p in pods] == ["cold"]
    ckpt = await _ready_checkpoint(h, "llama")
    name = ckpt["metadata"]["name"]
    assert name.startswith(f"llama-{HASH}-")
    assert len(name) <= 52
    dgd_uid = (await h.dgd("llama"))["metadata"]["uid"]
    assert [(r["uid"], r["controller"]) for r in ckpt["metadata"]["ownerReferences"]] == [(dgd_uid, True)]
    assert ckpt["metadata"]["finalizers"] == [protocol.FINALIZER]
    assert ckpt["metadata"]["labels"][protocol.LABEL_CHECKPOINT_HASH] == HASH
    assert ckpt["status"]["identityHash"] == HASH
    assert ckpt["status"]["compatibility"] == {
        "gpuProduct": "NVIDIA-H200",
        "cudaDriverMajor": "580",
        "gpuCount": 1,
    }
    snap = await h.kube.get(POD_SNAPSHOT, ckpt["status"]["podSnapshotName"], h.namespace)
    assert [r["uid"] for r in snap["metadata"]["ownerReferences"]] == [ckpt["metadata"]["uid"]]
    assert ckpt["status"]["location"] == f"{ARTIFACT_ROOT}/{h.namespace}/{snap['metadata']['uid']}"
    assert len(ckpt["status"]["artifactDigest"]) == 64
    assert ckpt["status"]["sourcePod"].startswith(f"{name}-checkpoint-")
    # An incompatible node joins only now: earlier, the checkpoint's worker could have been scheduled onto it
    # (the scheduler knows nothing of GPU products), making its GPU the checkpoint's.
    odd = gpu_node(product="NVIDIA-A100-SXM4-80GB", gpus=8, driver_major=535)["metadata"]["name"]

    async def odd_ready() -> bool:
        conditions = ((await h.kube.get(NODE, odd)).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    await eventually(odd_ready)  # schedulable before the scale-up, or avoiding it would prove nothing

    async def job_gone() -> bool:
        jobs, _ = await h.kube.list_all(JOB, h.namespace)
        return not jobs

    await eventually(job_gone)  # the source worker is released once the checkpoint is Ready

    async def status_ready() -> dict[str, Any] | None:
        dgd = await h.dgd("llama")
        st = (dgd.get("status") or {}).get("checkpoints", {}).get("VllmWorker")
        return dgd if st and st.get("ready") else None

    dgd = await eventually(status_ready)
    assert dgd["status"]["checkpoints"]["VllmWorker"] == {
        "checkpointName": name,
        "identityHash": HASH,
        "ready": True,
    }

    await h.scale("llama", 4)

    async def four_running() -> list[dict[str, Any]] | None:
        pods = await h.pods("llama")
        running = [p for p in pods if p.get("status", {}).get("phase") == "Running"]
        return pods if len(pods) == 4 and len(running) == 4 else None

    pods = await eventually(four_running, within=45)
    restored = [p for p in pods if _mode(p) == "restore"]
    assert len(restored) == 3
    for pod in restored:
        meta = pod["metadata"]
        assert meta["annotations"][protocol.ANNOTATION_RESTORE_FROM] == name
        assert meta["labels"][protocol.LABEL_CHECKPOINT_ID] == name
        assert meta["labels"][protocol.LABEL_RESTORE_TARGET] == protocol.TRUE
        assert pod["spec"]["nodeName"] != odd, "restore scheduled onto an incompatible GPU node"
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        assert (
            env[protocol.ENV_CONTROL_DIR]
            == env[protocol.ENV_CONTROL_DIR_LEGACY]
            == protocol.CONTROL_MOUNT_PATH
        )
        assert any(v["name"] == protocol.CONTROL_VOLUME_NAME for v in pod["spec"]["volumes"])

    async def counted() -> dict[str, Any] | None:
        st = ((await h.dgd("llama")).get("status") or {}).get("services", {}).get("VllmWorker", {})
        return st if st.get("restoredReplicas") == 3 and st.get("readyReplicas") == 4 else None

    st = await eventually(counted)
    assert st["coldStartedReplicas"] == 1
    assert _condition(await h.dgd("llama"), "Ready")["status"] == "True"

    # A second DGD with the same identity never restores the first one's process: it cold-starts and
    # takes a checkpoint of its own.
    await h.apply_dgd(dgd_manifest("llama-b", replicas=2))
    pods_b = await eventually(lambda: _n(h, "llama-b", 2))
    assert {_mode(p) for p in pods_b} == {"cold"}
    ckpt_b = await _ready_checkpoint(h, "llama-b")
    assert ckpt_b["metadata"]["name"] != name
    assert {r["name"] for r in ckpt_b["metadata"]["ownerReferences"]} == {"llama-b"}
    assert sorted(c["metadata"]["name"] for c in await h.checkpoints()) == sorted(
        [name, ckpt_b["metadata"]["name"]]
    )

    # Scale down removes pods (newest first) and keeps the count exact.
    await h.scale("llama", 2)
    await eventually(lambda: _n(h, "llama", 2))
    assert len(await h.events("ScaledUp")) >= 2


async def _only(h: Harness, products: set[str | None]) -> bool:
    return await _gpu_products(h) <= products


async def _n(h: Harness, graph: str, n: int) -> list[dict[str, Any]] | None:
    pods = await h.pods(graph)
    return pods if len(pods) == n else None


async def test_missing_checkpoint_ref_waits_with_condition(harness: Harness) -> None:
    h = harness
    await h.apply_dgd(dgd_manifest("ref", replicas=2, checkpoint_ref="does-not-exist"))

    async def cond() -> dict[str, Any] | None:
        dgd = await h.dgd("ref")
        conds = (dgd.get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "CheckpointReady"), None)

    c = await eventually(cond)
    assert c["status"] == "False"
    assert "does-not-exist" in c["message"]
    assert "not found" in c["message"]
    assert await eventually(lambda: h.events("CheckpointNotFound"))
    assert await h.pods("ref") == []
    assert await h.checkpoints() == [], "checkpointRef mode must never create a checkpoint"


async def test_failed_restores_fall_back_to_cold_start_and_fail_the_checkpoint(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    gpu_node(gpus=8)
    gpu_node(gpus=8)
    await h.apply_dgd(dgd_manifest("flaky", replicas=1))
    await _ready_checkpoint(h, "flaky")
    h.agent.restore_outcome = lambda pod: "failed"
    await h.scale("flaky", 4)

    async def all_cold() -> list[dict[str, Any]] | None:
        pods = await h.pods("flaky")
        return pods if len(pods) == 4 and all(_mode(p) == "cold" for p in pods) else None

    pods = await eventually(all_cold, within=60)
    replaced = [p for p in pods if protocol.ANNOTATION_REPLACES in p["metadata"].get("annotations", {})]
    assert len(replaced) == 3
    ckpt = await eventually(lambda: _phase(h, "flaky", "Failed"), within=30)
    # Each replica may first retry on the other node (a second failure) unless the checkpoint was
    # already Failed by then: 3 to 6 failures, never fewer than the threshold.
    assert 3 <= len(ckpt["status"]["failedRestores"]) <= 6
    assert "restores from this checkpoint failed" in ckpt["status"]["message"]
    await h.event("RestoreFailed", "checksum mismatch (test)")


async def test_a_restore_failing_on_one_node_is_retried_on_another(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    for _ in range(2):
        gpu_node(gpus=8)
    await h.apply_dgd(dgd_manifest("retry", replicas=1))
    await _ready_checkpoint(h, "retry")
    bad_node: list[str] = []

    def fail_on_first_node(pod: dict[str, Any]) -> str:
        # The first restore fails wherever it lands (say, that node's storage mount is broken);
        # restores on any other node work.
        bad_node[:] = bad_node or [pod["spec"]["nodeName"]]
        return "failed" if pod["spec"]["nodeName"] == bad_node[0] else "completed"

    h.agent.restore_outcome = fail_on_first_node
    await h.scale("retry", 2)

    async def retried() -> dict[str, Any] | None:
        pods = await h.pods("retry")
        ann = [p for p in pods if protocol.ANNOTATION_AVOID_NODES in p["metadata"].get("annotations", {})]
        return ann[0] if len(pods) == 2 and ann and ann[0]["spec"].get("nodeName") else None

    pod = await eventually(retried, within=45)
    assert _mode(pod) == "restore"
    assert pod["metadata"]["annotations"][protocol.ANNOTATION_AVOID_NODES] == bad_node[0]
    assert pod["spec"]["nodeName"] != bad_node[0]
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert all(
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": bad_node} in t["matchExpressions"]
        for t in terms["nodeSelectorTerms"]
    )
    await h.event("RestoreFailed", "retrying the restore on another node")
    ckpt = await h.kube.get(CHECKPOINT, await h.auto_checkpoint("retry"), h.namespace)
    assert ckpt["status"]["phase"] == "Ready"  # one failure is below the threshold


async def _phase(h: Harness, graph: str, phase: str) -> dict[str, Any] | None:
    ckpt = await h.kube.get(CHECKPOINT, await h.auto_checkpoint(graph), h.namespace)
    return ckpt if (ckpt.get("status") or {}).get("phase") == phase else None


async def test_no_compatible_node_starts_cold_and_says_why(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness

    async def no_h200_left() -> bool:
        return "NVIDIA-H200" not in await _gpu_products(h)

    await eventually(no_h200_left)
    source = gpu_node(product="NVIDIA-H200", gpus=8)["metadata"]["name"]
    await h.apply_dgd(dgd_manifest("nocompat", replicas=1))
    await _ready_checkpoint(h, "nocompat")
    # Only now the other product: the checkpoint must have been taken on the H200 (with both nodes
    # there from the start, the scheduler could put the checkpoint job on the L40S).
    gpu_node(product="NVIDIA-L40S", gpus=8)
    await h.kube.delete(NODE, source)
    await h.scale("nocompat", 2)
    pods = await eventually(lambda: _n(h, "nocompat", 2))
    assert {_mode(p) for p in pods} == {"cold"}

    async def degraded() -> dict[str, Any] | None:
        c = _condition(await h.dgd("nocompat"), "Degraded")
        return c if c["status"] == "True" else None

    c = await eventually(degraded)
    assert "no Ready node matches checkpoint" in c["message"]
    assert "NVIDIA-H200" in c["message"]


@pytest.mark.parametrize("harness", [{"restore_pending_timeout_seconds": 3}], indirect=True)
async def test_an_unschedulable_restore_pod_is_replaced_by_a_cold_start(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    h = harness
    # The only H200 node has 2 GPUs: the first worker and the checkpoint's worker fill it.
    gpu_node(product="NVIDIA-H200", gpus=2)
    await h.apply_dgd(dgd_manifest("stuck", replicas=1))
    await _ready_checkpoint(h, "stuck")
    # Restores must go to an H200; a third replica finds none free. Capacity arrives elsewhere (an
    # L40S, where only a cold start may run).
    await h.scale("stuck", 3)
    l40s = gpu_node(product="NVIDIA-L40S", gpus=8)["metadata"]["name"]

    async def placed() -> list[dict[str, Any]] | None:
        pods = await h.pods("stuck")
        ok = len(pods) == 3 and all(p["spec"].get("nodeName") for p in pods)
        return pods if ok else None

    pods = await eventually(placed, within=60)
    replacements = [p for p in pods if protocol.ANNOTATION_REPLACES in p["metadata"].get("annotations", {})]
    assert replacements, [p["metadata"]["name"] for p in pods]
    assert all(_mode(p) == "cold" and p["metadata"]["name"].endswith("-cold") for p in replacements)
    assert any(p["spec"]["nodeName"] == l40s for p in replacements)
    await h.event("RestoreUnschedulable", "could not be scheduled")
    ckpt = await h.kube.get(CHECKPOINT, await h.auto_checkpoint("stuck"), h.namespace)
    assert not ckpt["status"].get("failedRestores"), "an unschedulable restore is not the checkpoint's fault"


async def test_enabled_alone_makes_the_dgds_own_checkpoint_of_the_worker_spec(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]]
) -> None:
    # Dynamo's newest API: no identity, no mode; the checkpoint is the DGD's, of the service as it runs.
    h = harness
    gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580)
    manifest = dgd_manifest("managed", replicas=1)
    manifest["spec"]["services"]["VllmWorker"]["checkpoint"] = {"enabled": True}
    derived = checkpoint_identity(DynamoGraphDeployment.model_validate(manifest).spec, "VllmWorker")
    identity = derived.model_dump(by_alias=True, exclude_none=True, mode="json")
    await h.apply_dgd(manifest)

    ckpt = await _ready_checkpoint_of(h, "managed", identity)
    assert ckpt["spec"]["identity"] == identity
    assert (identity["backendFramework"], identity["model"]) == ("vllm", "VllmWorker")
    assert ckpt["status"]["identityHash"] == compute_identity_hash(derived)

    await h.scale("managed", 2)

    async def one_restored() -> list[dict[str, Any]]:
        pods = await h.pods("managed")
        assert sorted(_mode(p) for p in pods) == ["cold", "restore"], [_mode(p) for p in pods]
        return pods

    await eventually(one_restored, within=45)
