"""A Ready PodSnapshot as the controller and a node agent leave it: bound to a content whose status records
the artifact's digest and the GPUs it was captured on."""

from __future__ import annotations

from dynamo_snapshot.api.conditions import now_rfc3339
from dynamo_snapshot.api.podsnapshot import content_name
from dynamo_snapshot.kube import Kube, Obj
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, POD_SNAPSHOT_CONTENT

COMPAT = {"gpuProduct": "NVIDIA-H200", "cudaDriverMajor": "570", "gpuCount": 1}


async def ready_snapshot(kube: Kube, namespace: str, name: str) -> Obj:
    """A PodSnapshot bound to a content whose status the node agent would have written."""
    snap = await kube.create(
        POD_SNAPSHOT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {"name": name},
            "spec": {"source": {"podRef": {"name": "worker-0", "containers": ["main"]}}},
        },
        namespace,
    )
    uid = snap["metadata"]["uid"]
    await kube.create(
        POD_SNAPSHOT_CONTENT,
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "PodSnapshotContent",
            "metadata": {"name": content_name(uid)},
            "spec": {
                "snapshotRef": {"namespace": namespace, "name": name, "uid": uid},
                "source": {"nodeName": "gpu-a", "podRef": {"name": "worker-0", "containers": ["main"]}},
            },
        },
    )
    ready = {"type": "Ready", "status": "True", "reason": "Captured", "message": "captured",
             "lastTransitionTime": now_rfc3339()}  # fmt: skip
    await kube.patch_status(
        POD_SNAPSHOT_CONTENT,
        content_name(uid),
        {"conditions": [ready], "artifact": {"digest": "a" * 64}, "compatibility": COMPAT},
    )
    await kube.patch_status(
        POD_SNAPSHOT, name, {"boundSnapshotContentName": content_name(uid), "conditions": [ready]}, namespace
    )
    return snap
