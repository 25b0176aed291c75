"""Fake GPU nodes for kwok, labelled the way NVIDIA GPU feature discovery labels real ones."""

from __future__ import annotations

from typing import Any

from dynamo_snapshot.api import protocol

# kwok manages only nodes carrying this annotation, so real nodes (there are none here) are never touched.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_VALUE = "fake"


def gpu_node_manifest(
    name: str,
    *,
    product: str = "NVIDIA-H200",
    gpus: int = 8,
    driver_major: int = 580,
    cpu: str = "64",
    memory: str = "1Ti",
    pods: int = 110,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A v1 Node that kwok keeps Ready, with `nvidia.com/gpu` capacity and GFD labels."""
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        protocol.LABEL_GPU_PRESENT: "true",
        protocol.LABEL_GPU_PRODUCT: product,
        protocol.LABEL_GPU_COUNT: str(gpus),
        protocol.LABEL_CUDA_DRIVER_MAJOR: str(driver_major),
    }
    node_labels.update(labels or {})
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), protocol.RESOURCE_GPU: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": node_labels,
            "annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": resources},
    }
