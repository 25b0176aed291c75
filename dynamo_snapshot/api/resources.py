"""The custom resources this project defines, in the order their CRDs are generated.

A new kind gets its own module with a ``CustomResource`` subclass, and is listed here; ``crdgen`` then
emits and checks its CRD like the others.
"""

from __future__ import annotations

from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.kube import CustomResource
from dynamo_snapshot.api.podsnapshot import PodSnapshot, PodSnapshotContent
from dynamo_snapshot.api.scalingpolicy import DynamoScalingPolicy
from dynamo_snapshot.api.snapshotjob import SnapshotJob

__all__ = ["CUSTOM_RESOURCES"]

CUSTOM_RESOURCES: tuple[type[CustomResource], ...] = (
    DynamoGraphDeployment,
    DynamoCheckpoint,
    DynamoScalingPolicy,
    PodSnapshot,
    PodSnapshotContent,
    SnapshotJob,
)
