"""A PodSnapshotContent's status.source (upstream's CheckpointSource): a status NVIDIA Snapshot's agent
writes, every field set, reads and writes back unchanged through the model and is kept whole by our CRD's
schema; one without any of those fields stays without them."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dynamo_snapshot.api.crdgen import build_crd
from dynamo_snapshot.api.podsnapshot import CheckpointSource, PodSnapshotContent
from tests.api.helpers import lost

# Every field of upstream's CheckpointSource (api/v1alpha1 of ai-dynamo/snapshot), as its agent writes it.
SOURCE: dict[str, Any] = {
    "node": {"name": "gpu-node-1", "architecture": "arm64", "kernelVersion": "6.8.0-1021-nvidia-64k"},
    "pod": {
        "image": "nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.9.0",
        "imageDigest": "sha256:" + "ab" * 32,
        "memory": "64Gi",
        "cpu": "8",
    },
    "devices": {
        "nvidia": {
            "driverVersion": "580.95.05",
            "instances": [{"productName": "NVIDIA GH200 480GB"}, {"productName": "NVIDIA GH200 480GB"}],
        }
    },
}


def _content(status: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshotContent",
        "metadata": {"name": "podsnapshotcontent-11111111-2222-3333-4444-555555555555"},
        "spec": {
            "snapshotRef": {"namespace": "inference", "name": "snap-a", "uid": "11111111"},
            "source": {
                "nodeName": "gpu-node-1",
                "podRef": {"name": "worker-0", "uid": "p1", "containers": ["main"]},
            },
        },
        "status": status,
    }


READY = {
    "type": "Ready",
    "status": "True",
    "reason": "Captured",
    "message": "Checkpoint captured and verified",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


def test_a_source_with_every_field_reads_and_writes_back_unchanged() -> None:
    manifest = _content({"conditions": [READY], "source": copy.deepcopy(SOURCE)})
    content = PodSnapshotContent.model_validate(manifest)
    assert content.to_dict() == manifest
    assert lost(manifest, content.to_dict()) == []
    assert content.status is not None
    source = content.status.source
    assert source is not None
    assert source.node is not None
    assert source.pod is not None
    assert source.devices is not None
    assert source.devices.nvidia is not None
    assert (source.node.name, source.node.architecture, source.node.kernel_version) == (
        "gpu-node-1",
        "arm64",
        "6.8.0-1021-nvidia-64k",
    )
    assert (source.pod.image_digest, source.pod.memory, source.pod.cpu) == (
        "sha256:" + "ab" * 32,
        "64Gi",
        "8",
    )
    assert source.devices.nvidia.driver_version == "580.95.05"
    assert [i.product_name for i in source.devices.nvidia.instances or []] == ["NVIDIA GH200 480GB"] * 2


@pytest.mark.parametrize(
    "status",
    [
        {"conditions": [READY]},
        {"conditions": [READY], "source": {}},
        {"source": {"node": {}, "pod": {}, "devices": {"nvidia": {"instances": [{}]}}}},
    ],
    ids=["no-source", "empty-source", "empty-parts"],
)
def test_a_source_without_its_fields_stays_without_them(status: dict[str, Any]) -> None:
    manifest = _content(copy.deepcopy(status))
    content = PodSnapshotContent.model_validate(manifest)
    assert content.to_dict() == manifest
    source = content.status.source if content.status else None
    if "source" not in status:
        assert source is None
        return
    assert source is not None
    dumped = source.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped == status["source"]  # nothing absent was written back as empty or null


def _unnamed(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """The fields of ``value`` that ``schema`` names no property for."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        return [
            found
            for key, item in value.items()
            for found in (
                _unnamed(item, properties[key], f"{path}.{key}") if key in properties else [f"{path}.{key}"]
            )
        ]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _unnamed(v, schema.get("items", {}), f"{path}[{i}]")]
    return []


def test_our_crd_names_every_field_of_upstreams_source() -> None:
    crd = build_crd(PodSnapshotContent)
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    schema = status["properties"]["source"]
    assert _unnamed(SOURCE, schema, "source") == []
    # A device vendor this schema does not name is kept, not pruned.
    assert schema["properties"]["devices"]["x-kubernetes-preserve-unknown-fields"] is True


def test_the_source_is_optional_all_the_way_down() -> None:
    assert CheckpointSource.model_validate({}).model_dump(exclude_none=True) == {}
