"""DynamoGraphDeployment (nvidia.com/v1alpha1), following NVIDIA Dynamo's own schema.

Only what this project reads or validates is declared (after Dynamo's
deploy/operator/api/v1alpha1: dynamographdeployment_types.go, dynamocomponentdeployment_types.go,
common.go).  Everything else in a Dynamo manifest -- PodSpec fields in extraPodSpec, probes, ingress,
multinode, fields newer Dynamo releases add -- is kept, by the models and by the CRD, so real Dynamo
manifests apply unchanged and survive a read-modify-write.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, JsonValue, model_validator

from dynamo_snapshot.api.identity import BackendFramework, CheckpointIdentity
from dynamo_snapshot.api.kube import (
    DNS1123_SUBDOMAIN_MAX_LENGTH,
    DNS1123_SUBDOMAIN_PATTERN,
    Condition,
    CustomResource,
    KubeModel,
    NonNegativeInt32,
    PrinterColumn,
    ResourceInfo,
)
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION

__all__ = [
    "CHECKPOINT_NEEDS_SOURCE_MESSAGE",
    "MANUAL_NEEDS_REF_MESSAGE",
    "CheckpointMode",
    "DGDState",
    "DynamoGraphDeployment",
    "DynamoGraphDeploymentSpec",
    "DynamoGraphDeploymentStatus",
    "ExtraPodSpec",
    "ResourceItem",
    "Resources",
    "ServiceCheckpointConfig",
    "ServiceCheckpointStatus",
    "ServiceReplicaStatus",
    "ServiceSpec",
]

MANUAL_NEEDS_REF_MESSAGE = "checkpoint.mode Manual requires checkpoint.checkpointRef"
CHECKPOINT_NEEDS_SOURCE_MESSAGE = (
    "checkpoint.enabled is true but neither checkpoint.checkpointRef nor checkpoint.identity is set: "
    "set checkpointRef, or set identity with mode Auto"
)

_HAS_REF = "(has(self.checkpointRef) && size(self.checkpointRef) > 0)"
_ENABLED = "(has(self.enabled) && self.enabled)"
_CHECKPOINT_RULES: list[JsonValue] = [
    {
        "rule": f"!{_ENABLED} || !has(self.mode) || self.mode != 'Manual' || {_HAS_REF}",
        "message": MANUAL_NEEDS_REF_MESSAGE,
    },
    {
        "rule": f"!{_ENABLED} || {_HAS_REF} || has(self.identity)",
        "message": CHECKPOINT_NEEDS_SOURCE_MESSAGE,
    },
]


class CheckpointMode(StrEnum):
    AUTO = "Auto"
    MANUAL = "Manual"


class ServiceCheckpointConfig(KubeModel):
    """Checkpoint/restore for one service: restore new replicas from a checkpoint of a warm worker."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _CHECKPOINT_RULES})

    enabled: bool = Field(default=False, strict=True, description="Whether checkpointing is enabled.")
    mode: CheckpointMode = Field(
        default=CheckpointMode.AUTO,
        description="Auto: the controller creates the DynamoCheckpoint for the identity when none exists. "
        "Manual: restore only from the DynamoCheckpoint named by checkpointRef.",
    )
    checkpoint_ref: str | None = Field(
        default=None,
        min_length=1,
        max_length=DNS1123_SUBDOMAIN_MAX_LENGTH,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="Name of a DynamoCheckpoint in the same namespace to restore from; "
        "when set, identity is not used to find one.",
    )
    identity: CheckpointIdentity | None = Field(
        default=None, description="What the checkpoint must capture; required unless checkpointRef is set."
    )

    @model_validator(mode="after")
    def _has_a_checkpoint_source(self) -> ServiceCheckpointConfig:
        if not self.enabled or self.checkpoint_ref:
            return self
        if self.mode is CheckpointMode.MANUAL:
            raise ValueError(MANUAL_NEEDS_REF_MESSAGE)
        if self.identity is None:
            raise ValueError(CHECKPOINT_NEEDS_SOURCE_MESSAGE)
        return self

    @property
    def auto_identity(self) -> CheckpointIdentity | None:
        """The identity the controller finds or creates a DynamoCheckpoint for (Auto mode), else None.

        None when checkpointing is off, when checkpointRef is set (the named checkpoint is used and the
        identity is ignored), or in Manual mode.
        """
        if not self.enabled or self.checkpoint_ref or self.mode is not CheckpointMode.AUTO:
            return None
        return self.identity


class ResourceItem(KubeModel):
    """Quantities as strings, as Dynamo declares them (e.g. gpu: "1")."""

    cpu: str | None = None
    memory: str | None = None
    gpu: str | None = Field(default=None, description="Number of GPUs, on each node for multinode services.")
    gpu_type: str | None = Field(default=None, description='GPU resource name; default "nvidia.com/gpu".')
    custom: dict[str, str] | None = None


class Resources(KubeModel):
    requests: ResourceItem | None = None
    limits: ResourceItem | None = None
    claims: list[dict[str, Any]] | None = None


class ExtraPodSpec(KubeModel):
    """A Kubernetes PodSpec (any of its fields) plus mainContainer, overrides for the main container."""

    main_container: dict[str, Any] | None = Field(
        default=None, description="A Kubernetes Container merged into the service's main container."
    )


class ServiceSpec(KubeModel):
    """One service (component) of the graph."""

    annotations: dict[str, str] | None = None
    labels: dict[str, str] | None = None
    service_name: str | None = None
    component_type: str | None = Field(
        default=None, description="Role of the service, e.g. frontend, worker, planner."
    )
    sub_component_type: str | None = Field(default=None, description="Sub-role, e.g. prefill or decode.")
    dynamo_namespace: str | None = Field(default=None, description="Deprecated by Dynamo; kept as given.")
    global_dynamo_namespace: bool | None = None
    replicas: NonNegativeInt32 | None = None
    resources: Resources | None = None
    envs: list[dict[str, Any]] | None = Field(default=None, description="Kubernetes EnvVars.")
    env_from_secret: str | None = Field(
        default=None, description="Secret whose keys become environment variables."
    )
    extra_pod_spec: ExtraPodSpec | None = None
    liveness_probe: dict[str, Any] | None = Field(default=None, description="A Kubernetes Probe.")
    readiness_probe: dict[str, Any] | None = Field(default=None, description="A Kubernetes Probe.")
    checkpoint: ServiceCheckpointConfig | None = None


class DynamoGraphDeploymentSpec(KubeModel):
    services: dict[str, ServiceSpec] | None = Field(
        default=None, max_length=25, description="The services of the graph, by name."
    )
    envs: list[dict[str, Any]] | None = Field(
        default=None, description="Kubernetes EnvVars for every service unless a service overrides them."
    )
    backend_framework: BackendFramework | None = None
    annotations: dict[str, str] | None = None
    labels: dict[str, str] | None = None


class DGDState(StrEnum):
    INITIALIZING = "initializing"
    PENDING = "pending"
    SUCCESSFUL = "successful"
    FAILED = "failed"


class ServiceReplicaStatus(KubeModel):
    replicas: NonNegativeInt32 | None = Field(default=None, description="Non-terminated replicas.")
    ready_replicas: NonNegativeInt32 | None = None
    restored_replicas: NonNegativeInt32 | None = Field(
        default=None, description="Replicas that started by restoring a checkpoint."
    )
    cold_started_replicas: NonNegativeInt32 | None = Field(
        default=None, description="Replicas that started without a checkpoint."
    )


class ServiceCheckpointStatus(KubeModel):
    checkpoint_name: str | None = Field(default=None, description="The DynamoCheckpoint the service uses.")
    identity_hash: str | None = None
    ready: bool | None = Field(default=None, description="Whether new replicas can restore from it.")


class DynamoGraphDeploymentStatus(KubeModel):
    observed_generation: int | None = None
    state: DGDState | None = None
    conditions: list[Condition] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    services: dict[str, ServiceReplicaStatus] | None = None
    checkpoints: dict[str, ServiceCheckpointStatus] | None = None


class DynamoGraphDeployment(CustomResource):
    """A graph of Dynamo inference services deployed together."""

    resource: ClassVar[ResourceInfo] = ResourceInfo(
        group=API_GROUP,
        version=API_VERSION,
        kind="DynamoGraphDeployment",
        plural="dynamographdeployments",
        singular="dynamographdeployment",
        short_names=("dgd",),
        printer_columns=(
            PrinterColumn("Ready", '.status.conditions[?(@.type=="Ready")].status'),
            PrinterColumn("Backend", ".spec.backendFramework"),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )

    api_version: Literal["nvidia.com/v1alpha1"] = "nvidia.com/v1alpha1"
    kind: Literal["DynamoGraphDeployment"] = "DynamoGraphDeployment"
    spec: DynamoGraphDeploymentSpec
    status: DynamoGraphDeploymentStatus | None = None
