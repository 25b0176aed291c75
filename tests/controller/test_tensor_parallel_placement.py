"""Tensor-parallel workers (several GPUs each) on kwok nodes of 2, 4 and 8 GPUs: the checkpoint records the
GPU count of its worker, and restore pods go only to nodes with at least that many GPUs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube.kinds import CHECKPOINT, NODE

from .conftest import Harness, dgd_manifest, eventually

pytestmark = pytest.mark.cluster
PRODUCT = "NVIDIA-H100-80GB-HBM3"


async def _other_gpu_nodes_gone(h: Harness) -> bool:
    """Nodes are cluster-wide: earlier tests' GPU nodes (deleted without waiting) must not take pods."""
    nodes, _ = await h.kube.list_all(NODE, None)
    return not any((n["metadata"].get("labels") or {}).get(protocol.LABEL_GPU_PRESENT) for n in nodes)


@pytest.mark.parametrize("tp", [2, 4])
async def test_restores_of_a_tensor_parallel_worker_go_to_nodes_with_enough_gpus(
    harness: Harness, gpu_node: Callable[..., dict[str, Any]], tp: int
) -> None:
    h = harness
    await eventually(lambda: _other_gpu_nodes_gone(h), within=60)
    gpus_of = {}
    for gpus in (2, 4, 8):
        gpus_of[gpu_node(product=PRODUCT, gpus=gpus)["metadata"]["name"]] = gpus
    graph = f"tp{tp}"
    await h.apply_dgd(dgd_manifest(graph, replicas=1, gpus=tp))

    name = await eventually(lambda: h.auto_checkpoint(graph))

    async def ready() -> dict[str, Any]:
        ckpt = await h.kube.get(CHECKPOINT, name, h.namespace)
        assert (ckpt.get("status") or {}).get("phase") == "Ready", ckpt.get("status")
        return ckpt

    ckpt = await eventually(ready, within=45)
    assert ckpt["status"]["compatibility"]["gpuCount"] == tp

    # As many restores as the nodes with enough GPUs hold beside the cold worker.
    room = sum(n // tp for n in gpus_of.values())
    await h.scale(graph, room)

    async def placed() -> list[dict[str, Any]] | None:
        pods = await h.pods(graph)
        restores = [p for p in pods if p["metadata"]["labels"][protocol.LABEL_START_MODE] == "restore"]
        ok = len(pods) == room and all(p["spec"].get("nodeName") for p in pods)
        return restores if ok and restores else None

    restores = await eventually(placed, within=60)
    for pod in restores:
        assert gpus_of[pod["spec"]["nodeName"]] >= tp, pod["spec"]["nodeName"]
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        expressions = [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]
        assert {"key": protocol.LABEL_GPU_COUNT, "operator": "Gt", "values": [str(tp - 1)]} in expressions
