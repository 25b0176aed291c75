"""The DGD's status says what is true, against the real apiserver, scheduler, controller-manager and kwok
GPU nodes: a worker the kubelet cannot start (its image cannot be pulled) makes the DGD Degraded in the
kubelet's words, and `no problem detected` comes back once it runs; new replicas of a service whose only
compatible node is NotReady inside its node grace wait for that node, neither announced as nor started
cold, and start cold (NoCompatibleNode) only once the grace is over.

kwok starts no container, so the first test writes the pod's status as a kubelet that cannot pull the
image writes it (tests/integration/test_kubelet_status.py has the real kubelet do it)."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import POD, Obj
from tests.controller.conftest import Harness, dgd_manifest, eventually
from tests.controller.test_failover import _fail_node, _heal_node, _mode

pytestmark = pytest.mark.cluster
NodeFactory = Callable[..., dict[str, Any]]


async def _condition(h: Harness, graph: str, type_: str) -> dict[str, Any]:
    for c in ((await h.dgd(graph)).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def _cold_graph(name: str, replicas: int) -> Obj:
    manifest = dgd_manifest(name, replicas=replicas)
    del manifest["spec"]["services"]["VllmWorker"]["checkpoint"]
    return manifest


def _image_pull_backoff(pod: Obj) -> Obj:
    """The pod's status as the kubelet writes it when the image cannot be pulled. The pod IP stays, as
    the sandbox keeps it (and kwok, which sets it, leaves a pod that has one alone)."""
    status: Obj = copy.deepcopy(pod["status"])
    image = pod["spec"]["containers"][0]["image"]
    status["phase"] = "Pending"
    status["conditions"] = [
        {**c, "status": "False", "reason": "ContainersNotReady"}
        if c["type"] in ("Ready", "ContainersReady")
        else c
        for c in status.get("conditions") or []
    ]
    status["containerStatuses"] = [
        {
            "name": "main",
            "image": image,
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "started": False,
            "state": {
                "waiting": {
                    "reason": "ImagePullBackOff",
                    "message": f'Back-off pulling image "{image}": ErrImagePull: {image}: not found',
                }
            },
        }
    ]
    return status


async def test_a_worker_whose_image_cannot_be_pulled_makes_the_dgd_degraded_in_the_kubelets_words(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580)
    await h.apply_dgd(_cold_graph("pull", replicas=2))

    async def running() -> list[Obj]:
        pods = await h.pods("pull")
        up = [p for p in pods if (p.get("status") or {}).get("podIP")]
        return pods if len(pods) == 2 and len(up) == 2 else []

    pods = await eventually(running, within=60)

    async def healthy() -> bool:
        degraded = await _condition(h, "pull", "Degraded")
        return (degraded.get("status"), degraded.get("message")) == ("False", "no problem detected")

    await eventually(healthy, within=30)
    stuck = pods[0]["metadata"]["name"]
    await h.kube.patch_status(POD, stuck, _image_pull_backoff(pods[0]), h.namespace)

    async def degraded() -> dict[str, Any]:
        found = await _condition(h, "pull", "Degraded")
        return found if found.get("status") == "True" else {}

    said = await eventually(degraded, within=30)
    assert said["reason"] == "ImagePullFailed"
    assert f"service VllmWorker: ImagePullFailed: pod {stuck}: its image cannot be pulled" in said["message"]
    assert 'ImagePullBackOff: Back-off pulling image "vllm-runtime:test"' in said["message"]
    dgd = await h.dgd("pull")
    assert dgd["status"]["state"] == "failed"
    progressing = await _condition(h, "pull", "Progressing")
    assert progressing["status"] == "False", "a pod that cannot start is no progress"
    # The pod stays: it is the kubelet's to retry the pull, not a lost worker.
    assert {p["metadata"]["name"] for p in await h.pods("pull")} == {p["metadata"]["name"] for p in pods}

    # The image arrives and the worker runs: nothing is wrong any more.
    await h.kube.patch_status(POD, stuck, pods[0]["status"], h.namespace)
    await eventually(healthy, within=30)


GRACE = 15.0


@pytest.mark.parametrize("harness", [{"node_loss_grace_seconds": GRACE}], indirect=True)
async def test_new_replicas_wait_for_a_compatible_node_inside_its_grace(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    h200 = gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580, pods=18)["metadata"]["name"]
    await h.apply_dgd(dgd_manifest("nc", replicas=1))

    async def checkpoint_ready() -> bool:
        items = await h.checkpoints()
        return bool(items) and all((c.get("status") or {}).get("phase") == "Ready" for c in items)

    await eventually(checkpoint_ready, within=60)
    # Room for cold starts, but not for a restore of the H200 checkpoint.
    gpu_node(product="NVIDIA-L40S", gpus=8, driver_major=580, pods=18)
    before = {p["metadata"]["name"] for p in await h.pods("nc")}

    await _fail_node(h, h200)
    failed_at = time.monotonic()
    await h.scale("nc", 2)

    async def says_it_waits() -> str:
        ready = await _condition(h, "nc", "Ready")
        message = str(ready.get("message") or "")
        return message if f"new replicas wait for node(s) {h200}" in message else ""

    message = await eventually(says_it_waits, within=10)
    assert "until their node grace ends at" in message
    while time.monotonic() - failed_at < GRACE / 2:
        assert {p["metadata"]["name"] for p in await h.pods("nc")} == before, "no replica made meanwhile"
        await asyncio.sleep(0.5)
    assert await h.events("NoCompatibleNode") == []

    # The node is back inside its grace: the new replica restores there.
    await _heal_node(h, h200)
    assert time.monotonic() - failed_at < GRACE - 2, "the test took too long to show the wait"

    async def restored() -> list[Obj]:
        new = [p for p in await h.pods("nc") if p["metadata"]["name"] not in before]
        return new if len(new) == 1 and new[0]["spec"].get("nodeName") else []

    [new] = await eventually(restored, within=30)
    assert _mode(new) == protocol.StartMode.RESTORE.value
    assert new["spec"]["nodeName"] == h200
    assert await h.events("NoCompatibleNode") == []
    assert "new replicas wait" not in str((await _condition(h, "nc", "Ready")).get("message"))

    # Down again, and this time for longer than the grace: then, and only then, new replicas start cold.
    before = {p["metadata"]["name"] for p in await h.pods("nc")}
    await _fail_node(h, h200)
    failed_at = time.monotonic()
    await h.scale("nc", 3)
    event = await h.event("NoCompatibleNode", "new replicas start cold", within=GRACE + 30)
    assert time.monotonic() - failed_at >= GRACE - 1.5
    assert "no Ready node matches checkpoint" in event["message"]

    async def cold_elsewhere() -> list[Obj]:
        pods = await h.pods("nc")
        new = [p for p in pods if p["metadata"]["name"] not in before]
        placed = all(p["spec"].get("nodeName") for p in pods)
        return new if len(pods) == 3 and new and placed else []

    for pod in await eventually(cold_elsewhere, within=45):
        assert _mode(pod) == protocol.StartMode.COLD.value
        assert pod["spec"]["nodeName"] != h200
