"""What a Ready PodSnapshotContent says the capture ran on (status.source): the agent's node, the captured
container of the source pod, the GPUs of the artifact's manifest with nvidia-smi's model of each. Values
the agent cannot read are absent, never empty or made up. Pure logic: the kube client, the pod cache and
NVML are fakes."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest

from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.gpu_assignment import gpu_models
from dynamo_snapshot.agent.snapshot_capture import (
    SnapshotCapture,
    capture_source,
    goarch,
    source_node,
)
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.podsnapshot import CheckpointSourceNode
from dynamo_snapshot.artifact import Artifact, Binding, GpuInfo, Manifest
from dynamo_snapshot.kube import EventRecorder, Informer, Kube, Obj
from tests.cuda.fakes import FakeNvml

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
U2 = "GPU-22222222-2222-2222-2222-222222222222"
IMAGE = "nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.9.0"
IMAGE_ID = "nvcr.io/nvidia/ai-dynamo/vllm-runtime@sha256:" + "ab" * 32
NODE = CheckpointSourceNode(name="gpu-node-1", architecture="amd64", kernel_version="6.8.0-60-generic")


def _pod(limits: dict[str, Any] | None = None, image_id: str | None = IMAGE_ID) -> Obj:
    main: Obj = {"name": "main", "image": IMAGE}
    if limits is not None:
        main["resources"] = {"limits": limits, "requests": {"cpu": "1"}}
    statuses = [{"name": "main", "imageID": image_id}] if image_id is not None else []
    return {
        "metadata": {"name": "worker-0", "namespace": "inference", "uid": "pod-1"},
        "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "side", "image": "busybox"}, main]},
        "status": {
            "containerStatuses": [{"name": "side", "imageID": "docker.io/busybox@sha256:00"}, *statuses]
        },
    }


def _manifest(gpus: GpuInfo | None, extra: dict[str, Any] | None = None) -> Manifest:
    return Manifest(
        identity_hash="0123456789abcdef",
        binding=Binding(
            namespace="inference",
            checkpoint_name="snap-a",
            checkpoint_uid="11111111-2222-3333-4444-555555555555",
            source_pod="worker-0",
            source_pod_uid="pod-1",
        ),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        source_node="gpu-node-1",
        gpus=gpus,
        criu_version="4.1",
        agent_version="0.1.0",
        files=[],
        features=[],
        extra=extra or {},
    )


def _gpus(driver_version: str | None = "580.159.04", uuids: Sequence[str] = (U1, U2)) -> GpuInfo:
    return GpuInfo(
        product="NVIDIA-H200",
        driver_version=driver_version,
        cuda_driver_major="580",
        count=2,
        uuids=list(uuids),
    )


# ------------------------------------------------------------------ the node


@pytest.mark.parametrize(
    ("machine", "arch"),
    [("x86_64", "amd64"), ("aarch64", "arm64"), ("arm64", "arm64"), ("ppc64le", "ppc64le"), ("i686", None)],
)
def test_the_architecture_is_spelled_as_goarch_spells_it(machine: str, arch: str | None) -> None:
    assert goarch(machine) == arch


def test_the_node_is_the_agents_with_its_architecture_and_kernel() -> None:
    node = source_node("gpu-node-1", "aarch64", "6.8.0-1021-nvidia-64k")
    assert node.to_dict() == {
        "name": "gpu-node-1",
        "architecture": "arm64",
        "kernelVersion": "6.8.0-1021-nvidia-64k",
    }
    unknown = source_node("gpu-node-1", "sparc64", "")
    assert unknown.model_dump(by_alias=True, exclude_none=True) == {"name": "gpu-node-1"}


# ------------------------------------------------------------------ the whole block


def test_every_value_the_agent_knows_is_written() -> None:
    source = capture_source(
        NODE,
        _pod({"memory": "64Gi", "cpu": "8", "nvidia.com/gpu": "2"}),
        "main",
        _manifest(_gpus()),
        ["NVIDIA H200", "NVIDIA H200"],
    )
    assert source.model_dump(mode="json", by_alias=True, exclude_none=True) == {
        "node": {"name": "gpu-node-1", "architecture": "amd64", "kernelVersion": "6.8.0-60-generic"},
        "pod": {"image": IMAGE, "imageDigest": IMAGE_ID, "memory": "64Gi", "cpu": "8"},
        "devices": {
            "nvidia": {
                "driverVersion": "580.159.04",
                "instances": [{"productName": "NVIDIA H200"}, {"productName": "NVIDIA H200"}],
            }
        },
    }


def test_what_the_agent_cannot_read_stays_absent() -> None:
    # No limits; a manifest that records the driver's major only; no GPU models from NVML.
    source = capture_source(NODE, _pod(limits=None), "main", _manifest(_gpus(driver_version=None)), None)
    dumped = source.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped["pod"] == {"image": IMAGE, "imageDigest": IMAGE_ID}
    # Not "580": a driver major is no driver version. One entry per GPU keeps the count.
    assert dumped["devices"] == {"nvidia": {"instances": [{}, {}]}}


def test_a_cpu_only_capture_has_no_devices() -> None:
    source = capture_source(NODE, _pod({"memory": "8Gi"}), "main", _manifest(None), None)
    dumped = source.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert "devices" not in dumped
    assert dumped["pod"] == {"image": IMAGE, "imageDigest": IMAGE_ID, "memory": "8Gi"}


def test_the_image_digest_falls_back_to_the_one_the_manifest_recorded() -> None:
    recorded = "sha256:" + "cd" * 32
    source = capture_source(NODE, _pod(image_id=None), "main", _manifest(None, {"image": recorded}), None)
    assert source.pod is not None
    assert (source.pod.image, source.pod.image_digest) == (IMAGE, recorded)
    bare = capture_source(NODE, _pod(image_id=None), "main", _manifest(None), None)
    assert bare.pod is not None
    assert bare.pod.image_digest is None


def test_a_container_the_pod_lacks_gives_no_pod_part() -> None:
    source = capture_source(NODE, _pod({"memory": "8Gi"}), "engine", _manifest(None), None)
    assert source.pod is None


# ------------------------------------------------------------------ nvidia-smi's GPU models


def test_gpu_models_are_nvmls_names_in_the_order_of_the_uuids() -> None:
    nvml = FakeNvml([(b"NVIDIA H200", U0, 143771, 0), ("NVIDIA H100 80GB HBM3", U1, 81559, 0)])
    assert gpu_models([U1, U0.upper()], nvml=nvml) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]


@pytest.mark.parametrize(
    ("uuids", "nvml"),
    [
        ([], FakeNvml([("NVIDIA H200", U0, 1, 0)])),
        ([U0, U2], FakeNvml([("NVIDIA H200", U0, 1, 0)])),  # one of them is no GPU of this node
        (["MIG-5f3c0e5e-0000-4000-8000-000000000001"], FakeNvml([("NVIDIA H200", U0, 1, 0)])),
        ([U0], FakeNvml([], init_error=RuntimeError("NVML Shared Library Not Found"))),
    ],
    ids=["none-asked", "unknown-uuid", "mig-slice", "no-nvml"],
)
def test_gpu_models_are_none_unless_nvml_names_every_gpu(uuids: list[str], nvml: FakeNvml) -> None:
    assert gpu_models(uuids, nvml=nvml) is None


def test_an_nvml_error_past_init_gives_no_models() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetName(self, h: int) -> Any:
            raise OSError("NVML_ERROR_GPU_IS_LOST")

    assert gpu_models([U0], nvml=Broken([("NVIDIA H200", U0, 1, 0)])) is None


# ------------------------------------------------------------------ Ready, written on the content


class _Kube:
    """The writes of the content's annotations and status, in order."""

    def __init__(self) -> None:
        self.patches: list[tuple[str | None, Obj]] = []

    async def merge_patch(
        self, kind: Any, name: str, patch: Obj, namespace: str | None = None, subresource: str | None = None
    ) -> Obj:
        self.patches.append((subresource, patch))
        return {}

    async def patch_status(self, kind: Any, name: str, status: Obj, namespace: str | None = None) -> Obj:
        return await self.merge_patch(kind, name, {"status": status}, namespace, subresource="status")


class _Pods:
    def __init__(self, *pods: Obj) -> None:
        self.pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in pods}

    def get(self, key: str) -> Obj | None:
        return self.pods.get(key)


class _Recorder:
    def record(self, obj: Any, type_: str, reason: str, message: str) -> None:
        pass


CONTENT: Obj = {
    "metadata": {"name": "podsnapshotcontent-11111111-2222-3333-4444-555555555555", "generation": 1},
    "spec": {
        "snapshotRef": {
            "namespace": "inference",
            "name": "snap-a",
            "uid": "11111111-2222-3333-4444-555555555555",
        },
        "source": {
            "nodeName": "gpu-node-1",
            "podRef": {"name": "worker-0", "uid": "pod-1", "containers": ["main"]},
        },
    },
}


def _capture(kube: _Kube, pods: _Pods) -> SnapshotCapture:
    async def never(pod: Obj) -> Any:
        raise AssertionError("no workload is started here")

    capture = SnapshotCapture(
        cast(Kube, kube),
        cast(Executor, object()),
        cast(Informer, pods),
        cast(EventRecorder, _Recorder()),
        "gpu-node-1",
        never,
        ready_timeout=1.0,
    )
    return capture


async def test_ready_writes_the_source_with_the_nodes_the_pods_and_the_gpus_values(tmp_path: Path) -> None:
    kube = _Kube()
    # The cache's copy of the pod has its container status; the one the grant read predates it.
    granted = _pod({"memory": "64Gi", "cpu": "8"}, image_id=None)
    capture = _capture(kube, _Pods(_pod({"memory": "64Gi", "cpu": "8"})))
    asked: list[list[str]] = []

    def models(uuids: Sequence[str]) -> list[str] | None:
        asked.append(list(uuids))
        return ["NVIDIA H200"] * len(uuids)

    capture.gpu_models = models
    manifest = _manifest(_gpus())
    artifact = Artifact(tmp_path, manifest)
    await capture._ready(CONTENT, artifact, manifest.binding or pytest.fail("bound"), granted)

    # The source in a write of its own before the outcome's: a CRD that refuses it costs only the note.
    (annotations_write, annotations), (source_write, source), (status_write, status) = kube.patches
    assert (annotations_write, source_write, status_write) == (None, "status", "status")
    assert set(source["status"]) == {"source"}
    assert "source" not in status["status"]
    assert set(annotations["metadata"]["annotations"]) == {
        protocol.ANNOTATION_CONTENT_ARTIFACT,
        protocol.ANNOTATION_CONTENT_COMPATIBILITY,
    }
    assert asked == [[U1, U2]]
    arch = goarch(platform.machine())
    node = {
        "name": "gpu-node-1",
        "kernelVersion": os.uname().release,
        **({"architecture": arch} if arch else {}),
    }
    assert source["status"]["source"] == {
        "node": node,
        "pod": {"image": IMAGE, "imageDigest": IMAGE_ID, "memory": "64Gi", "cpu": "8"},
        "devices": {
            "nvidia": {
                "driverVersion": "580.159.04",
                "instances": [{"productName": "NVIDIA H200"}, {"productName": "NVIDIA H200"}],
            }
        },
    }
    ready = next(c for c in status["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Captured")


async def test_ready_of_a_cpu_capture_leaves_devices_and_limits_out(tmp_path: Path) -> None:
    kube = _Kube()
    pod = _pod(limits=None)
    capture = _capture(kube, _Pods())  # the pod left the cache: the granted copy is used

    def models(uuids: Sequence[str]) -> list[str] | None:
        raise AssertionError("a capture without GPUs asks NVML nothing")

    capture.gpu_models = models
    manifest = _manifest(None)
    await capture._ready(CONTENT, Artifact(tmp_path, manifest), manifest.binding or pytest.fail("bound"), pod)
    source = kube.patches[-2][1]["status"]["source"]
    assert set(source) == {"node", "pod"}
    assert source["pod"] == {"image": IMAGE, "imageDigest": IMAGE_ID}
