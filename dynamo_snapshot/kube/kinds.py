"""The API kinds the controller and the node agent read and write."""

from __future__ import annotations

from typing import Final

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.kube import CustomResource
from dynamo_snapshot.api.podsnapshot import PodSnapshot, PodSnapshotContent
from dynamo_snapshot.api.resources import CUSTOM_RESOURCES
from dynamo_snapshot.api.scalingpolicy import DynamoScalingPolicy
from dynamo_snapshot.api.snapshotjob import SnapshotJob
from dynamo_snapshot.kube import NODE, POD, ResourceKind


def kind_of(model: type[CustomResource]) -> ResourceKind:
    """Where one of this project's custom resources lives in the REST API: read off its model, the one
    place its group, version, plural and scope are spelled (and its CRD generated from)."""
    info = model.resource
    return ResourceKind(
        info.group, info.version, info.plural, info.kind, namespaced=info.scope == "Namespaced"
    )


# Every kind of api.resources, so a new custom resource is reachable by name without another list.
CUSTOM_KINDS: Final = {model.resource.kind: kind_of(model) for model in CUSTOM_RESOURCES}
# v1alpha1, the shape the controller reads DGDs in; they are read and written at the version their CRD
# stores (v1beta1 where served: dgd_versions.DgdVersion.kind).
DGD: Final = kind_of(DynamoGraphDeployment)
CHECKPOINT: Final = kind_of(DynamoCheckpoint)
SCALING_POLICY: Final = kind_of(DynamoScalingPolicy)
POD_SNAPSHOT: Final = kind_of(PodSnapshot)
POD_SNAPSHOT_CONTENT: Final = kind_of(PodSnapshotContent)
SNAPSHOT_JOB: Final = kind_of(SnapshotJob)
JOB: Final = ResourceKind("batch", "v1", "jobs", "Job")
CRD: Final = ResourceKind(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False
)

__all__ = [
    "CHECKPOINT",
    "CRD",
    "CUSTOM_KINDS",
    "DGD",
    "JOB",
    "NODE",
    "POD",
    "POD_SNAPSHOT",
    "POD_SNAPSHOT_CONTENT",
    "SCALING_POLICY",
    "SNAPSHOT_JOB",
    "kind_of",
]
