"""DynamoGraphDeployment nvidia.com/v1beta1, Dynamo's newer shape of the graph, field for field.

After Dynamo's deploy/operator/api/v1beta1 (dynamographdeployment_types.go,
dynamocomponentdeployment_types.go, common_types.go).  v1beta1 lists the graph's parts as
``spec.components`` (each with its own ``name``) where v1alpha1 keys ``spec.services`` by name, and
gives each one a native ``podTemplate`` instead of v1alpha1's resources/envs/probes/extraPodSpec.
Checkpointing lives under ``components[].experimental.checkpoint``.  Only what this project reads or
writes is declared, with upstream's kubebuilder bounds; every other key is kept as given, as in the
v1alpha1 models.  ``dgd_conversion`` converts to and from v1alpha1.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, JsonValue, field_validator, model_validator

from dynamo_snapshot.api.container import EnvVar
from dynamo_snapshot.api.graphdeployment import (
    GRAPH_AND_SERVICE_MAX_LENGTH,
    GRAPH_NAME_MAX_LENGTH,
    GRAPH_NAME_MESSAGE,
    SERVICE_NAME_MAX_LENGTH,
    SERVICE_NAME_PATTERN,
    CheckpointMode,
    DGDState,
    graph_name_fits,
    pod_names_fit,
)
from dynamo_snapshot.api.identity import BackendFramework, CheckpointIdentity
from dynamo_snapshot.api.kube import (
    Condition,
    CustomResource,
    KubeModel,
    NonNegativeInt32,
    ObjectMeta,
    PositiveInt32,
    PrinterColumn,
    ResourceInfo,
)
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION_V1BETA1

# Worker pods are named after the graph and the component.
_COMPONENT_NAMES_MESSAGE = (
    f"metadata.name and each component name together must be at most {GRAPH_AND_SERVICE_MAX_LENGTH} "
    "characters: worker pods are named after both"
)

__all__ = [
    "COMPONENTS_MAX_ITEMS",
    "COMPONENT_NAME_MESSAGE",
    "CONTAINER_NAME_PATTERN",
    "DUPLICATE_COMPONENT_MESSAGE",
    "JOB_WITH_REF_MESSAGE",
    "MIN_AVAILABLE_MESSAGE",
    "ONE_EPP_MESSAGE",
    "CheckpointDeletionPolicy",
    "CheckpointStartupPolicy",
    "Component",
    "ComponentCheckpointConfig",
    "ComponentCheckpointJobConfig",
    "ComponentCheckpointStatus",
    "ComponentExperimentalSpec",
    "ComponentReplicaStatus",
    "ComponentType",
    "DynamoGraphDeploymentV1Beta1",
    "DynamoGraphDeploymentV1Beta1Spec",
    "DynamoGraphDeploymentV1Beta1Status",
]

COMPONENTS_MAX_ITEMS = 25
COMPONENT_NAME_MESSAGE = (
    "component names must be 1 to 63 letters, digits and '-', starting and ending with a letter or "
    "digit (such as VllmDecodeWorker or decode-worker)"
)
DUPLICATE_COMPONENT_MESSAGE = "component names must be unique case-insensitively"
ONE_EPP_MESSAGE = "at most one component may have type epp"
MIN_AVAILABLE_MESSAGE = "minAvailable must be less than or equal to replicas unless replicas is 0"
JOB_WITH_REF_MESSAGE = "checkpoint.job cannot be set when checkpointRef is specified"
# A Kubernetes container name (DNS-1123 label), as upstream's targetContainerName and job containers.
CONTAINER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_COMPONENT_NAME = re.compile(SERVICE_NAME_PATTERN)


# The same rules as CEL, so that the apiserver refuses with the models' messages what they refuse: v1beta1
# is the version stored and, in crds/, the only one served (no controller has to be up to say why).
_COMPONENT_RULES: list[JsonValue] = [
    {
        "rule": f"self.name.size() <= {SERVICE_NAME_MAX_LENGTH} && "
        f"self.name.matches('{SERVICE_NAME_PATTERN}')",
        "message": COMPONENT_NAME_MESSAGE,
        "fieldPath": ".name",
    },
    {
        "rule": "!has(self.minAvailable) || (has(self.replicas) && self.replicas == 0) || "
        "self.minAvailable <= (has(self.replicas) ? self.replicas : 1)",
        "message": MIN_AVAILABLE_MESSAGE,
        "fieldPath": ".minAvailable",
    },
]
# Dynamo's own rules on the list (deploy/operator/api/v1beta1 DynamoGraphDeploymentSpec.Components); a
# list keyed by name besides, so that the apiserver refuses two entries of one name outright.
_COMPONENTS_RULES: list[JsonValue] = [
    {"rule": "self.filter(c, has(c.type) && c.type == 'epp').size() <= 1", "message": ONE_EPP_MESSAGE},
    {
        "rule": "self.all(c1, self.filter(c2, c2.name.lowerAscii() == c1.name.lowerAscii()).size() == 1)",
        "message": DUPLICATE_COMPONENT_MESSAGE,
    },
]
_GRAPH_RULES: list[JsonValue] = [
    {
        "rule": f"self.metadata.name.size() <= {GRAPH_NAME_MAX_LENGTH}",
        "message": GRAPH_NAME_MESSAGE,
        "fieldPath": ".metadata",
    },
    {
        "rule": "!has(self.spec.components) || self.spec.components.all(c, "
        f"self.metadata.name.size() + c.name.size() <= {GRAPH_AND_SERVICE_MAX_LENGTH})",
        "message": _COMPONENT_NAMES_MESSAGE,
        "fieldPath": ".spec.components",
    },
]
_CHECKPOINT_RULES: list[JsonValue] = [
    {
        "rule": "!has(self.job) || !has(self.checkpointRef) || size(self.checkpointRef) == 0",
        "message": JOB_WITH_REF_MESSAGE,
    },
]


def _component_name(name: str) -> str:
    if not 1 <= len(name) <= SERVICE_NAME_MAX_LENGTH or _COMPONENT_NAME.fullmatch(name) is None:
        raise ValueError(f"{name!r}: {COMPONENT_NAME_MESSAGE}")
    return name


# maxLength bounds the cost the apiserver estimates for the list rules, which compare names pairwise.
ComponentName = Annotated[
    str, AfterValidator(_component_name), Field(json_schema_extra={"maxLength": SERVICE_NAME_MAX_LENGTH})
]
ContainerName = Annotated[str, Field(min_length=1, max_length=63, pattern=CONTAINER_NAME_PATTERN)]


class ComponentType(StrEnum):
    """The role of a component; prefill and decode are first-class here (v1alpha1's subComponentType)."""

    FRONTEND = "frontend"
    WORKER = "worker"
    PREFILL = "prefill"
    DECODE = "decode"
    PLANNER = "planner"
    EPP = "epp"


class CheckpointStartupPolicy(StrEnum):
    """When worker replicas start relative to a DGD-managed checkpoint becoming Ready."""

    IMMEDIATE = "Immediate"
    WAIT_FOR_CHECKPOINT = "WaitForCheckpoint"


class CheckpointDeletionPolicy(StrEnum):
    """Whether a DGD-managed checkpoint and its artifact outlive the DynamoGraphDeployment."""

    DELETE = "Delete"
    RETAIN = "Retain"


class ComponentCheckpointJobConfig(KubeModel):
    """Customizes the SnapshotJob capture pod of a DGD-managed checkpoint."""

    gms_client_containers: list[ContainerName] | None = Field(
        default=None, description="Capture-pod containers wired as GPU Memory Service clients."
    )
    pod_template: dict[str, Any] | None = Field(
        default=None, description="A Kubernetes PodTemplateSpec merged into the capture pod."
    )


class ComponentCheckpointConfig(KubeModel):
    """Checkpoint/restore for one component (components[].experimental.checkpoint)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _CHECKPOINT_RULES})

    enabled: bool = Field(strict=True, description="Whether checkpointing is enabled; required.")
    mode: CheckpointMode | None = Field(
        default=None,
        description="Deprecated: omit.  enabled without checkpointRef means a DGD-managed checkpoint.",
    )
    startup_policy: CheckpointStartupPolicy | None = Field(
        default=None,
        description="Immediate (default): start cold now, restore later pods once the checkpoint is Ready. "
        "WaitForCheckpoint: keep workers at zero until it is Ready.",
    )
    deletion_policy: CheckpointDeletionPolicy | None = Field(
        default=None, description="Delete (default) or Retain the DGD-managed checkpoint with the graph."
    )
    checkpoint_ref: str | None = Field(
        default=None, description="A PodSnapshot of the same namespace to restore from."
    )
    identity: CheckpointIdentity | None = Field(
        default=None, description="Deprecated: ignored for DGD-managed checkpoints; kept as given."
    )
    target_container_name: ContainerName | None = Field(
        default=None, description="The container to snapshot and restore (default main)."
    )
    job: ComponentCheckpointJobConfig | None = None

    @model_validator(mode="after")
    def _job_only_without_ref(self) -> ComponentCheckpointConfig:
        if self.job is not None and self.checkpoint_ref:
            raise ValueError(JOB_WITH_REF_MESSAGE)
        return self


class ComponentExperimentalSpec(KubeModel):
    """Preview features of a component; gpuMemoryService, failover, grove are kept as given."""

    checkpoint: ComponentCheckpointConfig | None = None


class Component(KubeModel):
    """One component of the graph: v1alpha1's service, with a native pod template."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _COMPONENT_RULES})

    name: ComponentName = Field(description="Stable logical name, unique in spec.components.")
    type: ComponentType | None = Field(default=None, description="Role of the component.")
    replicas: NonNegativeInt32 | None = None
    min_available: PositiveInt32 | None = None
    pod_template: dict[str, Any] | None = Field(
        default=None, description="A Kubernetes PodTemplateSpec; the operator fills the container main."
    )
    experimental: ComponentExperimentalSpec | None = None

    @model_validator(mode="after")
    def _min_available_fits(self) -> Component:
        if self.min_available is None or self.replicas == 0:
            return self
        if self.min_available > (1 if self.replicas is None else self.replicas):
            raise ValueError(MIN_AVAILABLE_MESSAGE)
        return self


class DynamoGraphDeploymentV1Beta1Spec(KubeModel):
    components: list[Component] | None = Field(
        default=None,
        max_length=COMPONENTS_MAX_ITEMS,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": _COMPONENTS_RULES,
        },
    )
    env: list[EnvVar] | None = Field(default=None, description="Prepended to every component's env.")
    backend_framework: BackendFramework | None = None
    annotations: dict[str, str] | None = None
    labels: dict[str, str] | None = None

    @field_validator("components")
    @classmethod
    def _names_unique_one_epp(cls, components: list[Component] | None) -> list[Component] | None:
        seen: dict[str, str] = {}
        for component in components or []:
            earlier = seen.get(component.name.lower())
            if earlier is not None:
                raise ValueError(f"{DUPLICATE_COMPONENT_MESSAGE} ({earlier!r} and {component.name!r})")
            seen[component.name.lower()] = component.name
        if sum(c.type is ComponentType.EPP for c in components or []) > 1:
            raise ValueError(ONE_EPP_MESSAGE)
        return components


class ComponentReplicaStatus(KubeModel):
    component_kind: str | None = None
    component_names: list[str] | None = None
    replicas: NonNegativeInt32 | None = None
    updated_replicas: NonNegativeInt32 | None = None
    ready_replicas: NonNegativeInt32 | None = None
    available_replicas: NonNegativeInt32 | None = None
    restored_replicas: NonNegativeInt32 | None = Field(
        default=None, description="Replicas that started by restoring a checkpoint."
    )
    cold_started_replicas: NonNegativeInt32 | None = Field(
        default=None, description="Replicas that started without a checkpoint."
    )


class ComponentCheckpointStatus(KubeModel):
    checkpoint_name: str | None = Field(default=None, description="The checkpoint the component uses.")
    checkpoint_id: str | None = Field(default=None, description="Deprecated legacy artifact ID.")
    identity_hash: str | None = Field(default=None, description="Deprecated legacy identity hash.")
    ready: bool | None = None


class DynamoGraphDeploymentV1Beta1Status(KubeModel):
    observed_generation: int | None = None
    state: DGDState | None = None
    conditions: list[Condition] | None = None
    components: dict[str, ComponentReplicaStatus] | None = None
    checkpoints: dict[str, ComponentCheckpointStatus] | None = None


class DynamoGraphDeploymentV1Beta1(CustomResource):
    """A graph of Dynamo components (nvidia.com/v1beta1).

    Its metadata.name is at most 63 characters, and at most 56 together with any component's name,
    as in v1alpha1: worker pods are named after both.
    """

    resource: ClassVar[ResourceInfo] = ResourceInfo(
        group=API_GROUP,
        version=API_VERSION_V1BETA1,
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

    model_config = ConfigDict(
        title="DynamoGraphDeployment", json_schema_extra={"x-kubernetes-validations": _GRAPH_RULES}
    )

    api_version: Literal["nvidia.com/v1beta1"] = "nvidia.com/v1beta1"
    kind: Literal["DynamoGraphDeployment"] = "DynamoGraphDeployment"
    spec: DynamoGraphDeploymentV1Beta1Spec = Field(default_factory=DynamoGraphDeploymentV1Beta1Spec)
    status: DynamoGraphDeploymentV1Beta1Status | None = None

    @field_validator("metadata")
    @classmethod
    def _name_fits_a_label(cls, metadata: ObjectMeta) -> ObjectMeta:
        return graph_name_fits(metadata)

    @model_validator(mode="after")
    def _pod_names_fit(self) -> DynamoGraphDeploymentV1Beta1:
        components = [c.name for c in self.spec.components or []]
        pod_names_fit(self.metadata.name or "", components, _COMPONENT_NAMES_MESSAGE)
        return self
