"""DynamoCheckpoint (nvidia.com/v1alpha1): one checkpoint of a warm worker, taken by a SnapshotJob into a
PodSnapshot that the checkpoint owns.

Follows Dynamo's DynamoCheckpoint (deploy/operator/api/v1alpha1) so checkpoints created by either
operator are readable by the other.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from dynamo_snapshot.api.identity import CheckpointIdentity
from dynamo_snapshot.api.kube import (
    LABEL_VALUE_MAX_LENGTH,
    Condition,
    CustomResource,
    KubeModel,
    NonNegativeInt32,
    ObjectMeta,
    PositiveInt32,
    PrinterColumn,
    ResourceInfo,
    Timestamp,
)
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION

__all__ = [
    "CHECKPOINT_JOB_SUFFIX",
    "CHECKPOINT_NAME_MAX_LENGTH",
    "CHECKPOINT_NAME_MESSAGE",
    "IDENTITY_IMMUTABLE_MESSAGE",
    "MAX_FAILED_RESTORES_LISTED",
    "CheckpointCompatibility",
    "CheckpointJobConfig",
    "CheckpointPhase",
    "DynamoCheckpoint",
    "DynamoCheckpointSpec",
    "DynamoCheckpointStatus",
    "StorageType",
]

IDENTITY_IMMUTABLE_MESSAGE = (
    "identity is immutable once set: create a new DynamoCheckpoint for a different identity"
)

# The checkpoint's SnapshotJob (and its batch Job and PodSnapshot) is named <checkpoint>-checkpoint, and
# that name becomes a label value on the pod (at most 63 characters): the checkpoint's name leaves room for
# the suffix, so two checkpoints never share a SnapshotJob name by truncation.  The checkpoint's name is
# also the value of the nvidia.com/snapshot-checkpoint-id label on every pod restored from it.
CHECKPOINT_JOB_SUFFIX = "-checkpoint"
CHECKPOINT_NAME_MAX_LENGTH = LABEL_VALUE_MAX_LENGTH - len(CHECKPOINT_JOB_SUFFIX)
CHECKPOINT_NAME_MESSAGE = (
    f"metadata.name must be at most {CHECKPOINT_NAME_MAX_LENGTH} characters: the checkpoint's SnapshotJob is "
    f"named <metadata.name>{CHECKPOINT_JOB_SUFFIX}, and that name is put on its pod as a label value "
    f"(at most {LABEL_VALUE_MAX_LENGTH} characters)"
)


class CheckpointJobConfig(KubeModel):
    """The SnapshotJob that starts the worker, waits until it is warm and checkpoints it."""

    pod_template_spec: dict[str, Any] = Field(
        description="A Kubernetes PodTemplateSpec running the worker to checkpoint; its container named "
        "main is captured."
    )
    active_deadline_seconds: PositiveInt32 = Field(
        default=3600,
        description="The SnapshotJob's activeDeadlineSeconds: how long, from its creation, the worker may "
        "take to start, warm up and be captured before the checkpoint fails.",
    )
    backoff_limit: NonNegativeInt32 = Field(
        default=3,
        description="Accepted for compatibility with Dynamo's DynamoCheckpoint and not used: the worker runs "
        "once (a SnapshotJob does not retry), and a failed checkpoint is taken again by deleting it.",
    )
    ttl_seconds_after_finished: NonNegativeInt32 = Field(
        default=300,
        description="Accepted for compatibility with Dynamo's DynamoCheckpoint and not used: the worker's "
        "pod is removed as soon as the capture ends, and the SnapshotJob and PodSnapshot live as long as "
        "the checkpoint.",
    )


class DynamoCheckpointSpec(KubeModel):
    identity: CheckpointIdentity = Field(
        description="What the checkpoint captures; decides its identity hash.",
        json_schema_extra={
            "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": IDENTITY_IMMUTABLE_MESSAGE}]
        },
    )
    job: CheckpointJobConfig


class CheckpointPhase(StrEnum):
    PENDING = "Pending"
    CREATING = "Creating"
    READY = "Ready"
    FAILED = "Failed"


class StorageType(StrEnum):
    PVC = "pvc"
    S3 = "s3"
    OCI = "oci"


class CheckpointCompatibility(KubeModel):
    """The GPU environment the checkpoint was taken on; restores go only to nodes that match it."""

    gpu_product: str | None = Field(default=None, description="nvidia.com/gpu.product of the source node.")
    cuda_driver_major: str | None = Field(default=None, description="CUDA driver major version.")
    gpu_count: NonNegativeInt32 | None = Field(default=None, description="GPUs the source worker used.")


MAX_FAILED_RESTORES_LISTED = 20


class DynamoCheckpointStatus(KubeModel):
    phase: CheckpointPhase | None = None
    identity_hash: str | None = Field(default=None, description="Hash of spec.identity.")
    location: str | None = Field(
        default=None,
        description="Where the checkpoint is stored (the PodSnapshotContent's artifact location).",
    )
    artifact_digest: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of the artifact's sealed manifest; node agents restore only that artifact.",
    )
    source_pod: str | None = Field(default=None, description="The pod the checkpoint was taken from.")
    storage_type: StorageType | None = None
    job_name: str | None = Field(default=None, description="The SnapshotJob that takes the checkpoint.")
    pod_snapshot_name: str | None = Field(
        default=None, description="The PodSnapshot the SnapshotJob made; restores read its content."
    )
    created_at: Timestamp | None = Field(default=None, description="When the checkpoint became ready.")
    message: str | None = None
    compatibility: CheckpointCompatibility | None = None
    failed_restores: list[str] | None = Field(
        default=None,
        max_length=MAX_FAILED_RESTORES_LISTED,
        description="Pods whose restore from this checkpoint failed; enough of them fail the checkpoint.",
    )
    conditions: list[Condition] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class DynamoCheckpoint(CustomResource):
    """A checkpoint of a warm worker that new replicas with the same identity restore from."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.metadata.name.size() <= {CHECKPOINT_NAME_MAX_LENGTH}",
                    "message": CHECKPOINT_NAME_MESSAGE,
                    "fieldPath": ".metadata",
                }
            ]
        }
    )

    resource: ClassVar[ResourceInfo] = ResourceInfo(
        group=API_GROUP,
        version=API_VERSION,
        kind="DynamoCheckpoint",
        plural="dynamocheckpoints",
        singular="dynamocheckpoint",
        short_names=("dckpt",),
        printer_columns=(
            PrinterColumn("Model", ".spec.identity.model", description="Model identifier"),
            PrinterColumn("Backend", ".spec.identity.backendFramework", description="Backend framework"),
            PrinterColumn("Phase", ".status.phase", description="Phase of the checkpoint"),
            PrinterColumn("Hash", ".status.identityHash", description="Identity hash"),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )

    api_version: Literal["nvidia.com/v1alpha1"] = "nvidia.com/v1alpha1"
    kind: Literal["DynamoCheckpoint"] = "DynamoCheckpoint"
    spec: DynamoCheckpointSpec
    status: DynamoCheckpointStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _name_leaves_room_for_the_job_suffix(cls, metadata: ObjectMeta) -> ObjectMeta:
        if metadata.name is not None and len(metadata.name) > CHECKPOINT_NAME_MAX_LENGTH:
            raise ValueError(CHECKPOINT_NAME_MESSAGE)
        return metadata
