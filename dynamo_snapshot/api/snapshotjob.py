"""SnapshotJob (nvidia.com/v1alpha1): run a pod until it is ready, capture it, and leave a PodSnapshot.

Field for field as ai-dynamo/snapshot's api/v1alpha1/snapshotjob_types.go, so SnapshotJobs written for
NVIDIA's operator apply here unchanged.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, JsonValue, field_validator, model_validator

from dynamo_snapshot.api.kube import (
    LABEL_VALUE_MAX_LENGTH,
    Condition,
    CustomResource,
    KubeModel,
    ObjectMeta,
    PrinterColumn,
    ResourceInfo,
    Timestamp,
)
from dynamo_snapshot.api.podsnapshot import SPEC_IMMUTABLE_MESSAGE, ContainerName
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION, DEFAULT_TARGET_CONTAINER

__all__ = [
    "DEFAULT_ACTIVE_DEADLINE_SECONDS",
    "SNAPSHOT_JOB_NAME_MESSAGE",
    "TARGET_CONTAINERS_MESSAGE",
    "PodSnapshotTemplate",
    "SnapshotJob",
    "SnapshotJobCondition",
    "SnapshotJobContainer",
    "SnapshotJobPodSpec",
    "SnapshotJobPodTemplate",
    "SnapshotJobReason",
    "SnapshotJobSpec",
    "SnapshotJobStatus",
]

DEFAULT_ACTIVE_DEADLINE_SECONDS = 3600
TARGET_CONTAINERS_MESSAGE = "targetContainers must name containers present in podTemplate"
SNAPSHOT_JOB_NAME_MESSAGE = (
    f"metadata.name must be no more than {LABEL_VALUE_MAX_LENGTH} characters because SnapshotJob uses it "
    "as a label value"
)


class SnapshotJobCondition(StrEnum):
    """Condition types of a SnapshotJob's status, beside Failed (api.conditions.FAILED)."""

    RUNNING = "Running"  # the source pod is ready
    CAPTURED = "Captured"  # its PodSnapshot is Ready
    COMPLETED = "Completed"  # captured and the source pod removed: terminal


class SnapshotJobReason(StrEnum):
    """Reasons of a SnapshotJob's conditions (and of the Events that go with them), spelled as upstream."""

    POD_PENDING = "PodPending"  # Running False: the source pod is not ready (yet)
    POD_READY = "PodReady"  # Running True
    CAPTURE_IN_PROGRESS = "CaptureInProgress"  # Captured False: the PodSnapshot is not Ready yet
    CAPTURE_COMPLETED = "CaptureCompleted"  # Captured True
    WAITING_FOR_POD_COMPLETION = "WaitingForPodCompletion"
    JOB_COMPLETED = "JobCompleted"  # Completed True
    CAPTURE_FAILED = "CaptureFailed"
    POD_SNAPSHOT_FAILED = "PodSnapshotFailed"  # the PodSnapshot it made says Failed
    POD_SNAPSHOT_DELETED = "PodSnapshotDeleted"  # the PodSnapshot it made was deleted before its outcome
    JOB_FAILED = "JobFailed"  # the source pod failed, or went away, before the capture
    DEADLINE_EXCEEDED = "DeadlineExceeded"  # activeDeadlineSeconds passed before the capture completed
    SOURCE_COMPLETED_WITHOUT_CAPTURE = "SourceCompletedWithoutCapture"  # the pod exited 0 uncaptured
    POD_SNAPSHOT_NAME_CONFLICT = "PodSnapshotNameConflict"  # a PodSnapshot of its name is not its own
    JOB_NAME_CONFLICT = "JobNameConflict"  # a Job of its name is not its own
    JOB_DELETED = "JobDeleted"  # someone deleted its Job before the end
    INVALID_SPEC = "InvalidSpec"


_SPEC_RULES: dict[str, JsonValue] = {
    "x-kubernetes-validations": [
        {"rule": "self == oldSelf", "message": SPEC_IMMUTABLE_MESSAGE},
        {
            "rule": "self.podSnapshotTemplate.targetContainers.all(c, "
            "c in self.podTemplate.spec.containers.map(x, x.name))",
            "message": TARGET_CONTAINERS_MESSAGE,
        },
    ]
}


class SnapshotJobContainer(KubeModel):
    """A Kubernetes Container; its name is what targetContainers refers to, the rest is kept as given."""

    name: str = Field(description="Name of the container.")


class SnapshotJobPodSpec(KubeModel):
    """A Kubernetes PodSpec; only its containers are read here, the rest is kept as given."""

    containers: list[SnapshotJobContainer] = Field(min_length=1)


class SnapshotJobPodTemplate(KubeModel):
    """A Kubernetes PodTemplateSpec: the pod to run until ready and capture."""

    metadata: dict[str, Any] | None = None
    spec: SnapshotJobPodSpec


class PodSnapshotTemplate(KubeModel):
    """What the PodSnapshot the job produces captures."""

    target_containers: list[ContainerName] = Field(
        default_factory=lambda: [DEFAULT_TARGET_CONTAINER],
        min_length=1,
        max_length=1,
        description="The container to capture (exactly one).",
        json_schema_extra={"default": [DEFAULT_TARGET_CONTAINER]},
    )


class SnapshotJobSpec(KubeModel):
    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)

    pod_template: SnapshotJobPodTemplate
    active_deadline_seconds: int = Field(
        default=DEFAULT_ACTIVE_DEADLINE_SECONDS,
        ge=1,
        description="Seconds the pod may take, from its start to the end of the capture, before the job "
        "fails (scheduling, warm-up, quiesce and dump).",
        json_schema_extra={"format": "int64"},
    )
    pod_snapshot_template: PodSnapshotTemplate

    @model_validator(mode="after")
    def _targets_are_in_the_template(self) -> SnapshotJobSpec:
        names = {c.name for c in self.pod_template.spec.containers}
        missing = [c for c in self.pod_snapshot_template.target_containers if c not in names]
        if missing:
            raise ValueError(
                f"{TARGET_CONTAINERS_MESSAGE}: {', '.join(missing)} is not among {sorted(names)}"
            )
        return self


class SnapshotJobStatus(KubeModel):
    pod_snapshot_name: str | None = Field(default=None, description="The PodSnapshot this job produced.")
    pod_snapshot_uid: str | None = Field(default=None, description="Its UID.")
    source_job_uid: str | None = Field(default=None, description="The batch Job running the pod.")
    started_at: Timestamp | None = Field(default=None, description="When the pod was first ready.")
    completed_at: Timestamp | None = Field(default=None, description="When the job completed or failed.")
    conditions: list[Condition] | None = Field(
        default=None,
        description="Running, Captured, Completed and Failed; Completed or Failed True is terminal.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class SnapshotJob(CustomResource):
    """Run a pod to readiness, capture it into a PodSnapshot, then remove the pod."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"size(self.metadata.name) <= {LABEL_VALUE_MAX_LENGTH}",
                    "message": SNAPSHOT_JOB_NAME_MESSAGE,
                }
            ]
        }
    )

    resource: ClassVar[ResourceInfo] = ResourceInfo(
        group=API_GROUP,
        version=API_VERSION,
        kind="SnapshotJob",
        plural="snapshotjobs",
        singular="snapshotjob",
        short_names=("snapjob",),
        printer_columns=(
            PrinterColumn("Running", ".status.conditions[?(@.type=='Running')].status"),
            PrinterColumn("Captured", ".status.conditions[?(@.type=='Captured')].status"),
            PrinterColumn("Completed", ".status.conditions[?(@.type=='Completed')].status"),
            PrinterColumn("PodSnapshot", ".status.podSnapshotName"),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )

    api_version: Literal["nvidia.com/v1alpha1"] = "nvidia.com/v1alpha1"
    kind: Literal["SnapshotJob"] = "SnapshotJob"
    spec: SnapshotJobSpec
    status: SnapshotJobStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _name_fits_a_label(cls, metadata: ObjectMeta) -> ObjectMeta:
        if metadata.name is not None and len(metadata.name) > LABEL_VALUE_MAX_LENGTH:
            raise ValueError(SNAPSHOT_JOB_NAME_MESSAGE)
        return metadata
