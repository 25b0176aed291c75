"""The session cluster's PodSnapshot and PodSnapshotContent CRDs swapped for NVIDIA Snapshot's (what a recent
Dynamo operator or NVIDIA's snapshot operator installs), and ours put back after.

Built from upstream's facts (ai-dynamo/snapshot api/v1alpha1, controller-gen v0.19.0; notes in
/work/upstream-snapshot-api.md §2, §3 and §7.4), not from our models: a structural schema whose status
holds the conditions (and, on the content, status.source of newer versions) and nothing else, so the
apiserver prunes every other status field; no label of ours. The swap waits until the apiserver prunes
as the schema says, and the restore until it keeps our status fields again.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

from dynamo_snapshot.api import crdgen
from dynamo_snapshot.api.podsnapshot import PodSnapshot, PodSnapshotContent
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers.polling import wait_for

Obj = dict[str, Any]
POD_SNAPSHOT_CRD = "podsnapshots.nvidia.com"
CONTENT_CRD = "podsnapshotcontents.nvidia.com"
CONTROLLER_GEN = {"controller-gen.kubebuilder.io/version": "v0.19.0"}
# What NVIDIA's snapshot chart puts on its CRDs: Helm's ownership, none of ours.
OPERATOR_LABELS = {"app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/part-of": "snapshot"}
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_IMMUTABLE = [{"rule": "self == oldSelf", "message": "spec is immutable"}]


def _string(**extra: Any) -> Obj:
    return {"type": "string", **extra}


def _object(properties: Obj, required: list[str] | None = None, **extra: Any) -> Obj:
    out: Obj = {"type": "object", "properties": properties, **extra}
    if required:
        out["required"] = required
    return out


def _condition() -> Obj:
    """metav1.Condition as controller-gen writes it."""
    return _object(
        {
            "lastTransitionTime": _string(format="date-time"),
            "message": _string(maxLength=32768),
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
            "reason": _string(
                maxLength=1024, minLength=1, pattern="^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
            ),
            "status": _string(enum=["True", "False", "Unknown"]),
            "type": _string(
                maxLength=316,
                pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
            ),
        },
        ["lastTransitionTime", "message", "reason", "status", "type"],
    )


def _conditions() -> Obj:
    return {"type": "array", "items": _condition()}


def _pod_ref() -> Obj:
    return _object(
        {
            "name": _string(minLength=1),
            "uid": _string(),
            "containers": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": _string(minLength=1, maxLength=63, pattern=_DNS_LABEL),
            },
        },
        ["containers", "name"],
    )


def _checkpoint_source() -> Obj:
    """status.source of a newer content (§7.4, checkpoint_source_types.go): what the capture ran on."""
    node = _object({"name": _string(), "architecture": _string(), "kernelVersion": _string()})
    volume = _object(
        {"path": _string(), "volume": _string(), "volumeSource": {"type": "object"}},
        ["path", "volume", "volumeSource"],
    )
    hardware = _object(
        {
            "gpuCount": {"type": "integer", "minimum": 0},
            "gpus": {"type": "array", "items": _object({"uuid": _string()})},
        }
    )
    nvidia = _object(
        {
            "hardware": hardware,
            "node": node,
            "declaredVolumes": {"type": "array", "items": volume},
            "declaredVolumeCount": {"type": "integer", "minimum": 0},
        }
    )
    return _object(
        {"type": _string(enum=["Nvidia"], default="Nvidia"), "nvidia": nvidia},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "(self.type == 'Nvidia') == has(self.nvidia)",
                    "message": "source payload must match type",
                }
            ]
        },
    )


def _crd(kind: str, plural: str, short: str, scope: str, spec: Obj, status: Obj, columns: list[Obj]) -> Obj:
    root = _object(
        {
            "apiVersion": _string(),
            "kind": _string(),
            "metadata": {"type": "object"},
            "spec": {**spec, "x-kubernetes-validations": _IMMUTABLE},
            "status": status,
        },
        ["spec"],
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.nvidia.com",
            "labels": dict(OPERATOR_LABELS),
            "annotations": dict(CONTROLLER_GEN),
        },
        "spec": {
            "group": "nvidia.com",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short],
            },
            "scope": scope,
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def _ready_column() -> Obj:
    return {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"}


def upstream_podsnapshot_crd() -> Obj:
    """PodSnapshot (namespaced) as upstream's CRD: status is boundSnapshotContentName and conditions."""
    spec = _object({"source": _object({"podRef": _pod_ref()}, ["podRef"])}, ["source"])
    status = _object({"boundSnapshotContentName": _string(), "conditions": _conditions()})
    columns = [
        {"name": "Content", "type": "string", "jsonPath": ".status.boundSnapshotContentName"},
        _ready_column(),
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd("PodSnapshot", "podsnapshots", "podsnap", "Namespaced", spec, status, columns)


def upstream_content_crd() -> Obj:
    """PodSnapshotContent (cluster-scoped) as upstream's CRD: status is conditions and source, no artifact
    and no compatibility."""
    snapshot_ref = _object(
        {"namespace": _string(), "name": _string(), "uid": _string()}, ["name", "namespace"]
    )
    source = _object({"podRef": _pod_ref(), "nodeName": _string(minLength=1)}, ["nodeName", "podRef"])
    spec = _object({"snapshotRef": snapshot_ref, "source": source}, ["snapshotRef", "source"])
    status = _object({"conditions": _conditions(), "source": _checkpoint_source()})
    columns = [
        {"name": "PodSnapshot", "type": "string", "jsonPath": ".spec.snapshotRef.name"},
        {"name": "Namespace", "type": "string", "jsonPath": ".spec.snapshotRef.namespace"},
        _ready_column(),
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd(
        "PodSnapshotContent", "podsnapshotcontents", "podsnapcontent", "Cluster", spec, status, columns
    )


def _keeps_artifact(cluster: LocalCluster) -> bool:
    """Whether the apiserver keeps a content's status.artifact now: written on a probe content (no node
    label, so no agent takes it up), read back, the probe deleted."""
    name = f"schema-probe-{uuid.uuid4().hex[:8]}"
    probe = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshotContent",
        "metadata": {"name": name},
        "spec": {
            "snapshotRef": {"namespace": "default", "name": "probe"},
            "source": {"nodeName": "nowhere", "podRef": {"name": "probe", "containers": ["main"]}},
        },
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(probe))
    try:
        patch = {"status": {"artifact": {"location": "probe"}}}
        cluster.kubectl(
            "patch", CONTENT_CRD, name, "--subresource=status", "--type=merge",
            "-p", json.dumps(patch),
        )  # fmt: skip
        got = json.loads(cluster.kubectl("get", CONTENT_CRD, name, "-o", "json").stdout)
        return "artifact" in (got.get("status") or {})
    finally:
        cluster.kubectl("delete", CONTENT_CRD, name, "--ignore-not-found", "--wait=false", check=False)


def _replace(cluster: LocalCluster, *crds: Obj) -> None:
    for crd in crds:
        cluster.kubectl("replace", "-f", "-", input=json.dumps(crd))
    names = [f"crd/{crd['metadata']['name']}" for crd in crds]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)


@contextlib.contextmanager
def upstream_snapshot_crds(cluster: LocalCluster) -> Iterator[None]:
    """Inside the block the cluster's PodSnapshot and PodSnapshotContent CRDs are upstream's; ours after."""
    _replace(cluster, upstream_podsnapshot_crd(), upstream_content_crd())
    try:
        wait_for(lambda: not _keeps_artifact(cluster), within=30, what="upstream's content schema in effect")
        yield
    finally:
        _replace(cluster, crdgen.build_crd(PodSnapshot), crdgen.build_crd(PodSnapshotContent))
        wait_for(lambda: _keeps_artifact(cluster), within=30, what="our content schema in effect again")
