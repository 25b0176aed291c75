"""Failover by restore against the real apiserver, scheduler, controller-manager and kwok GPU nodes: a
deleted pod, a NotReady node and a deleted node each get their workers replaced by restore pods on
another compatible node; a node taking 20 workers down is replaced at the configured pace; a controller
restarted mid-failover converges to exactly the desired count."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import NODE, POD, Obj
from dynamo_snapshot.kube.kinds import CHECKPOINT
from dynamo_snapshot_dev.localcluster.nodes import KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE
from tests.controller.conftest import Harness, dgd_manifest, eventually

pytestmark = pytest.mark.cluster

NodeFactory = Callable[..., dict[str, Any]]


def _mode(pod: Obj) -> str:
    return str(pod["metadata"]["labels"].get(protocol.LABEL_START_MODE))


async def _restored_service(h: Harness, gpu_node: NodeFactory, replicas: int, gpus: int = 8) -> list[Obj]:
    """A DGD whose checkpoint is Ready and whose `replicas` workers run, all but the first restored."""
    for _ in range(3):
        gpu_node(product="NVIDIA-H200", gpus=gpus, driver_major=580, pods=gpus + 10)
    await h.apply_dgd(dgd_manifest("fo", replicas=1))

    async def ready() -> bool:
        items = await h.checkpoints()
        return bool(items) and all((c.get("status") or {}).get("phase") == "Ready" for c in items)

    await eventually(ready, within=60)
    await h.scale("fo", replicas)

    async def running() -> list[Obj]:
        pods = await h.pods("fo")
        placed = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
        return pods if len(pods) == replicas and len(placed) == replicas else []

    return list(await eventually(running, within=60))


async def _replaced(h: Harness, gone: set[str], replicas: int, avoid: str | None) -> list[Obj]:
    async def check() -> list[Obj]:
        pods = await h.pods("fo")
        names = {p["metadata"]["name"] for p in pods}
        if names & gone or len(pods) != replicas:
            return []
        fresh = [p for p in pods if p["metadata"]["name"] not in gone]
        if avoid and any((p.get("spec") or {}).get("nodeName") == avoid for p in fresh):
            return []
        return pods

    return list(await eventually(check, within=45, interval=0.1))


async def test_deleted_pod_is_replaced_by_restore(harness: Harness, gpu_node: NodeFactory) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 3)
    victim = next(p for p in pods if _mode(p) == protocol.StartMode.RESTORE.value)
    name = victim["metadata"]["name"]
    await h.kube.delete(POD, name, h.namespace)
    after = await _replaced(h, {name}, 3, avoid=None)
    new = [p for p in after if p["metadata"]["name"] not in {q["metadata"]["name"] for q in pods}]
    assert [_mode(p) for p in new] == [protocol.StartMode.RESTORE.value]
    await h.event("WorkerLost", name, "was deleted")


async def test_a_dead_worker_process_is_replaced_on_another_node(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 3)
    victim = next(p for p in pods if _mode(p) == protocol.StartMode.RESTORE.value)
    name, node = victim["metadata"]["name"], victim["spec"]["nodeName"]
    samples_before = _observed_to_ready_samples()
    # What the node agent writes when the worker process it restored dies (tests/agent covers that part).
    exited = protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, "main")
    await h.kube.merge_patch(
        POD, name, {"metadata": {"annotations": {exited: "worker process 4242 exited"}}}, h.namespace
    )
    after = await _replaced(h, {name}, 3, avoid=None)
    new = [p for p in after if p["metadata"]["name"] not in {q["metadata"]["name"] for q in pods}]
    assert [_mode(p) for p in new] == [protocol.StartMode.RESTORE.value]
    assert new[0]["spec"]["nodeName"] != node, "the replacement went back to the node that just lost it"
    preferred = new[0]["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["preference"]["matchExpressions"][0]["values"] == [node]
    await h.event("WorkerLost", name, "process-exited")

    async def whole_again() -> bool:
        dgd = await h.dgd("fo")
        degraded = next(c for c in dgd["status"]["conditions"] if c["type"] == "Degraded")
        return bool(degraded["status"] == "False")

    await eventually(whole_again, within=30)
    # Whole again because the replacement became Ready, not because it was dropped from tracking.
    assert _observed_to_ready_samples() == samples_before + 1


def _observed_to_ready_samples() -> float:
    # The controller runs in this process, so its metrics are in the default registry.
    return REGISTRY.get_sample_value("dynsnap_failover_observed_to_ready_seconds_count") or 0.0


async def test_losses_a_scale_down_absorbs_leave_the_service_healthy(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 4)
    # One replacement at once and then hardly any: the other losses stay unreplaced.
    failover = h.controller().ctx.failover
    failover.service_rate, failover.service_burst = 0.001, 1.0
    gone = [p["metadata"]["name"] for p in pods[:3]]
    for name in gone:
        await h.kube.delete(POD, name, h.namespace)

    async def paced() -> bool:
        dgd = await h.dgd("fo")
        degraded = next(c for c in dgd["status"]["conditions"] if c["type"] == "Degraded")
        return "2 not yet replaced" in degraded["message"]

    await eventually(paced, within=30)
    # The survivor and the one replacement are all the service needs now: nothing is owed any more.
    await h.scale("fo", 2)

    async def healthy() -> bool:
        dgd = await h.dgd("fo")
        degraded = next(c for c in dgd["status"]["conditions"] if c["type"] == "Degraded")
        svc = dgd["status"]["services"]["VllmWorker"]
        return bool(degraded["status"] == "False" and svc["readyReplicas"] == 2)

    await eventually(healthy, within=30)
    assert len(await h.pods("fo")) == 2


async def test_losses_while_a_checkpoint_ref_waits_are_replaced_paced_once_it_is_ready(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    for _ in range(3):
        gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580, pods=18)
    # An Auto-mode DGD takes the checkpoint that the checkpointRef service first restores from.
    await h.apply_dgd(dgd_manifest("seed", replicas=1))

    async def seeded() -> Obj | None:
        items = await h.checkpoints()
        return items[0] if items and (items[0].get("status") or {}).get("phase") == "Ready" else None

    seed = await eventually(seeded, within=60)
    await h.apply_dgd(dgd_manifest("fo", replicas=3, checkpoint_ref=seed["metadata"]["name"]))

    async def running() -> list[Obj]:
        pods = await h.pods("fo")
        return pods if len(pods) == 3 and all((p.get("spec") or {}).get("nodeName") for p in pods) else []

    pods = await eventually(running, within=60)
    # The service is pointed at a checkpoint that does not exist yet: it waits, its workers keep running.
    ref = {"spec": {"services": {"VllmWorker": {"checkpoint": {"checkpointRef": "later"}}}}}
    await h.dgds.merge_patch("fo", h.namespace, ref)

    async def condition(type_: str, *words: str) -> Obj | None:
        conds = ((await h.dgd("fo")).get("status") or {}).get("conditions") or []
        found = next((c for c in conds if c["type"] == type_), None)
        return found if found and all(w in found["message"] for w in words) else None

    await eventually(lambda: condition("CheckpointReady", "later", "not found"))
    # One replacement at once and then hardly any: pacing shows as replacements still owed.
    failover = h.controller().ctx.failover
    failover.service_rate, failover.service_burst = 0.001, 1.0

    # Two workers lost while the service waits: one deleted by someone else, one whose process died.
    await h.kube.delete(POD, pods[0]["metadata"]["name"], h.namespace)
    exited = protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, "main")
    died = {"metadata": {"annotations": {exited: "worker process 4242 exited"}}}
    await h.kube.merge_patch(POD, pods[1]["metadata"]["name"], died, h.namespace)
    # Remembered as owed (not dropped because the service cannot replace them yet), and reported as
    # waiting for the checkpoint rather than as a fault.
    waits = ("2 not yet replaced", "wait for the service's checkpoint")
    await eventually(lambda: condition("CheckpointReady", *waits))
    assert await condition("Degraded", "no problem detected")
    await asyncio.sleep(1.0)
    assert len(await h.pods("fo")) == 1, "a waiting service created pods"

    # The checkpoint appears (a copy of the seed's, as a user pre-warms one) and becomes Ready.
    later = {"apiVersion": seed["apiVersion"], "kind": seed["kind"], "metadata": {"name": "later"}}
    await h.kube.create(CHECKPOINT, {**later, "spec": seed["spec"]}, h.namespace)

    # The replacements go through the failover pacing: one now, the other still owed.
    async def paced() -> list[Obj]:
        pods = await h.pods("fo")
        return pods if len(pods) == 2 and await condition("Degraded", "1 not yet replaced") else []

    after = await eventually(paced, within=60)
    new = [p for p in after if p["metadata"]["name"] not in {q["metadata"]["name"] for q in pods}]
    assert [p["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] for p in new] == ["later"]
    await asyncio.sleep(1.0)
    assert len(await h.pods("fo")) == 2, "the second replacement was not paced"

    # Once the pace allows, the last one follows (the resync looks again).
    failover.services[(f"{h.namespace}/fo", "VllmWorker")].rate = 100.0

    async def whole() -> bool:
        svc = ((await h.dgd("fo")).get("status") or {}).get("services", {}).get("VllmWorker") or {}
        return svc.get("readyReplicas") == 3 and bool(await condition("Degraded", "no problem detected"))

    await eventually(whole, within=30)


async def _fail_node(h: Harness, node: str) -> None:
    """Take a kwok node away from kwok (no more heartbeats) and report it NotReady, as a dead kubelet's
    node looks once the node controller notices. A node kwok has not given its first status yet is waited
    for: that status would land after this one and undo it."""

    async def has_ready() -> bool:
        conds = ((await h.kube.get(NODE, node)).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" for c in conds)

    await eventually(has_ready, within=30)
    await h.kube.merge_patch(NODE, node, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: None}}})
    await _set_ready(h, node, "False", "KubeletStopped")


async def _heal_node(h: Harness, node: str) -> None:
    """Hand the node back to kwok (heartbeats again) and report it Ready."""
    await h.kube.merge_patch(
        NODE, node, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE}}}
    )
    await _set_ready(h, node, "True", "KubeletReady")


async def _set_ready(h: Harness, node: str, status: str, reason: str) -> None:
    # The transition time is the node grace's start, as the kubelet or node controller would set it.
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    current = await h.kube.get(NODE, node)
    conds = [
        {**c, "status": status, "reason": reason, "message": f"test: {reason}", "lastTransitionTime": now}
        if c.get("type") == "Ready"
        else c
        for c in (current.get("status") or {}).get("conditions") or []
    ]
    await h.kube.merge_patch(NODE, node, {"status": {"conditions": conds}}, subresource="status")


# The node grace is what these tests are not about: losses of a NotReady node count after a second.
SHORT_GRACE = {"node_loss_grace_seconds": 1.0}


@pytest.mark.parametrize("harness", [SHORT_GRACE], indirect=True)
@pytest.mark.parametrize("how", ["not-ready", "deleted"])
async def test_workers_of_a_lost_node_come_back_elsewhere(
    harness: Harness, gpu_node: NodeFactory, how: str
) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 4)
    restored = [p for p in pods if _mode(p) == protocol.StartMode.RESTORE.value]
    node = restored[0]["spec"]["nodeName"]
    gone = {p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == node}
    if how == "deleted":
        await h.kube.delete(NODE, node)
    else:
        await _fail_node(h, node)
    after = await _replaced(h, gone, 4, avoid=node)
    fresh = [
        p
        for p in after
        if p["metadata"]["name"] not in gone
        and p["metadata"]["name"] not in {q["metadata"]["name"] for q in pods}
    ]
    assert len(fresh) == len(gone)
    assert all(_mode(p) == protocol.StartMode.RESTORE.value for p in fresh)
    cause = "node-deleted" if how == "deleted" else "node-not-ready"
    await h.event("WorkerLost", cause)

    async def caught_up() -> bool:
        # Status reports the service whole again: every replica back and ready.
        svc = ((await h.dgd("fo")).get("status") or {}).get("services", {}).get("VllmWorker") or {}
        return svc.get("replicas") == 4 and svc.get("readyReplicas") == 4

    await eventually(caught_up, within=30)


async def test_twenty_workers_on_a_dead_node_come_back_paced(harness: Harness, gpu_node: NodeFactory) -> None:
    h = harness
    # One big node gets all 20 workers first; the others join afterwards.
    big = gpu_node(product="NVIDIA-H200", gpus=24, driver_major=580, pods=40)["metadata"]["name"]
    await h.apply_dgd(dgd_manifest("fo", replicas=1))

    async def ready() -> bool:
        items = await h.checkpoints()
        return bool(items) and all((c.get("status") or {}).get("phase") == "Ready" for c in items)

    await eventually(ready, within=60)
    await h.scale("fo", 20)

    async def all_placed() -> list[Obj]:
        pods = await h.pods("fo")
        placed = [p for p in pods if (p.get("spec") or {}).get("nodeName") == big]
        return pods if len(placed) == 20 else []

    pods = await eventually(all_placed, within=90)
    for _ in range(2):
        gpu_node(product="NVIDIA-H200", gpus=16, driver_major=580, pods=30)
    gone = {p["metadata"]["name"] for p in pods}

    seen: dict[str, float] = {}

    async def track() -> None:
        while True:
            for p in await h.pods("fo"):
                seen.setdefault(p["metadata"]["name"], time.monotonic())
            await asyncio.sleep(0.05)

    tracker = asyncio.create_task(track())
    samples_before = _observed_to_ready_samples()
    try:
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await h.kube.delete(NODE, big)
        after = await _replaced(h, gone, 20, avoid=big)
    finally:
        tracker.cancel()
    for p in after:  # the last ones may have come after the tracker's last look
        seen.setdefault(p["metadata"]["name"], time.monotonic())
    created = sorted(t - started for name, t in seen.items() if name not in gone)
    assert len(created) == 20
    # 5 per second per service (burst 5): not all at once, and all of them within a few seconds.
    assert created[-1] - created[0] >= 2.0, created
    assert sum(1 for t in created if t - created[0] < 0.5) <= 8, created

    async def all_followed_to_ready() -> float:
        # Replacements created in one batch are mostly not in the pod cache yet when their reconcile
        # looks: each must still be followed until Ready and give its sample.
        got = _observed_to_ready_samples() - samples_before
        assert got >= 20, f"{got:.0f} of 20 replacements gave an observed-to-ready sample"
        return got

    assert await eventually(all_followed_to_ready, within=30) == 20


async def test_controller_restarted_during_failover_converges_exactly(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    pods = await _restored_service(h, gpu_node, 6)
    node = next(p for p in pods if _mode(p) == protocol.StartMode.RESTORE.value)["spec"]["nodeName"]
    gone = {p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == node}
    await h.kube.delete(NODE, node)
    await asyncio.sleep(0.2)
    await h.kill_controller()
    await h.start_controller()
    await _replaced(h, gone, 6, avoid=node)
    await asyncio.sleep(3)  # anything extra would have shown by now
    assert len(await h.pods("fo")) == 6
