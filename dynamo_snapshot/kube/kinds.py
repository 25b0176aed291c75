"""The API kinds the controller and the node agent read and write."""

from __future__ import annotations

from typing import Final

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.scalingpolicy import DynamoScalingPolicy
from dynamo_snapshot.kube import NODE, POD, ResourceKind

_dgd = DynamoGraphDeployment.resource
_ckpt = DynamoCheckpoint.resource
DGD: Final = ResourceKind(_dgd.group, _dgd.version, _dgd.plural, _dgd.kind)
CHECKPOINT: Final = ResourceKind(_ckpt.group, _ckpt.version, _ckpt.plural, _ckpt.kind)
JOB: Final = ResourceKind("batch", "v1", "jobs", "Job")
_dsp = DynamoScalingPolicy.resource
SCALING_POLICY: Final = ResourceKind(_dsp.group, _dsp.version, _dsp.plural, _dsp.kind)

__all__ = ["CHECKPOINT", "DGD", "JOB", "NODE", "POD", "SCALING_POLICY"]
