"""The API kinds the controller and the node agent read and write."""

from __future__ import annotations

from typing import Final

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.podsnapshot import PodSnapshot, PodSnapshotContent
from dynamo_snapshot.api.scalingpolicy import DynamoScalingPolicy
from dynamo_snapshot.api.snapshotjob import SnapshotJob
from dynamo_snapshot.kube import NODE, POD, ResourceKind

_dgd = DynamoGraphDeployment.resource
_ckpt = DynamoCheckpoint.resource
# v1alpha1, the shape the controller reads DGDs in; they are read and written at the version their CRD
# stores (v1beta1 where served: dgd_versions.DgdVersion.kind).
DGD: Final = ResourceKind(_dgd.group, _dgd.version, _dgd.plural, _dgd.kind)
CHECKPOINT: Final = ResourceKind(_ckpt.group, _ckpt.version, _ckpt.plural, _ckpt.kind)
JOB: Final = ResourceKind("batch", "v1", "jobs", "Job")
_dsp = DynamoScalingPolicy.resource
SCALING_POLICY: Final = ResourceKind(_dsp.group, _dsp.version, _dsp.plural, _dsp.kind)
_ps, _psc, _sj = PodSnapshot.resource, PodSnapshotContent.resource, SnapshotJob.resource
POD_SNAPSHOT: Final = ResourceKind(_ps.group, _ps.version, _ps.plural, _ps.kind)
POD_SNAPSHOT_CONTENT: Final = ResourceKind(_psc.group, _psc.version, _psc.plural, _psc.kind, namespaced=False)
SNAPSHOT_JOB: Final = ResourceKind(_sj.group, _sj.version, _sj.plural, _sj.kind)
CRD: Final = ResourceKind(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", namespaced=False
)

__all__ = [
    "CHECKPOINT",
    "CRD",
    "DGD",
    "JOB",
    "NODE",
    "POD",
    "POD_SNAPSHOT",
    "POD_SNAPSHOT_CONTENT",
    "SCALING_POLICY",
    "SNAPSHOT_JOB",
]
