"""DynamoGraphDeployment (nvidia.com/v1alpha1), following NVIDIA Dynamo's own schema.

Only what this project reads or validates is declared (after Dynamo's
deploy/operator/api/v1alpha1: dynamographdeployment_types.go, dynamocomponentdeployment_types.go,
common.go).  Everything else in a Dynamo manifest -- PodSpec fields in extraPodSpec, probes, ingress,
multinode, fields newer Dynamo releases add -- is kept, by the models and by the CRD, so real Dynamo
manifests apply unchanged and survive a read-modify-write.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    JsonValue,
    field_validator,
    model_validator,
)

from dynamo_snapshot.api.checkpoint import CHECKPOINT_NAME_MAX_LENGTH
from dynamo_snapshot.api.container import EnvVar, Resources
from dynamo_snapshot.api.identity import BackendFramework, CheckpointIdentity
from dynamo_snapshot.api.kube import (
    DNS1123_SUBDOMAIN_PATTERN,
    LABEL_VALUE_MAX_LENGTH,
    Condition,
    CustomResource,
    KubeModel,
    NonNegativeInt32,
    ObjectMeta,
    PrinterColumn,
    ResourceInfo,
)
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION, LABEL_GRAPH, LABEL_SERVICE

__all__ = [
    "DGD_MANAGED_FRAMEWORK_MESSAGE",
    "GRAPH_AND_SERVICE_MAX_LENGTH",
    "GRAPH_AND_SERVICE_MESSAGE",
    "GRAPH_NAME_MAX_LENGTH",
    "GRAPH_NAME_MESSAGE",
    "MANUAL_NEEDS_REF_MESSAGE",
    "SERVICE_NAME_LENGTH_MESSAGE",
    "SERVICE_NAME_MAX_LENGTH",
    "SERVICE_NAME_MESSAGE",
    "SERVICE_NAME_PATTERN",
    "WORKER_POD_NAME_MAX_LENGTH",
    "CheckpointMode",
    "DGDState",
    "DynamoGraphDeployment",
    "DynamoGraphDeploymentSpec",
    "DynamoGraphDeploymentStatus",
    "ExtraPodSpec",
    "ServiceCheckpointConfig",
    "ServiceCheckpointStatus",
    "ServiceReplicaStatus",
    "ServiceSpec",
    "checkpoint_identity",
    "graph_name_fits",
    "pod_names_fit",
]

MANUAL_NEEDS_REF_MESSAGE = "checkpoint.mode Manual requires checkpoint.checkpointRef"
DGD_MANAGED_FRAMEWORK_MESSAGE = (
    "checkpoint.enabled without checkpointRef or identity asks for a checkpoint the DGD manages, whose "
    "backend must be known: set spec.backendFramework, or run the main container as "
    "python3 -m dynamo.<vllm|sglang|trtllm>"
)

# --- names --------------------------------------------------------------------------------------------
# The controller names worker pods <graph>-<service>-<5 random characters>, lower-cased
# (podspec.new_pod_name), and labels them with the graph's and the service's names; Kubernetes allows 63
# characters in a pod's hostname and in a label value.  The graph and service names together leave room
# for the suffix, so a pod name is never truncated and always says which service it runs.
WORKER_POD_NAME_MAX_LENGTH = LABEL_VALUE_MAX_LENGTH
_POD_SUFFIX_LENGTH = len("-") + 5
GRAPH_AND_SERVICE_MAX_LENGTH = WORKER_POD_NAME_MAX_LENGTH - _POD_SUFFIX_LENGTH - len("-")
GRAPH_NAME_MAX_LENGTH = LABEL_VALUE_MAX_LENGTH
SERVICE_NAME_MAX_LENGTH = LABEL_VALUE_MAX_LENGTH

GRAPH_NAME_MESSAGE = (
    f"metadata.name must be at most {GRAPH_NAME_MAX_LENGTH} characters: it is the value of the "
    f"{LABEL_GRAPH} label on the graph's pods"
)
GRAPH_AND_SERVICE_MESSAGE = (
    f"metadata.name and each service name together must be at most {GRAPH_AND_SERVICE_MAX_LENGTH} "
    "characters: worker pods are named <metadata.name>-<service name, lower-cased>-<5 characters>, "
    f"and Kubernetes allows {WORKER_POD_NAME_MAX_LENGTH}"
)
# Letters of either case: Dynamo's own examples name services in CamelCase (Frontend, VllmDecodeWorker),
# and pod names take them lower-cased.  Nothing else: an underscore or a dot makes no pod name.
SERVICE_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?$"
SERVICE_NAME_MESSAGE = (
    "service names must be letters, digits and '-', starting and ending with a letter or digit "
    "(such as VllmDecodeWorker or decode-worker): worker pods are named after them, lower-cased"
)
SERVICE_NAME_LENGTH_MESSAGE = (
    f"service names must be at most {SERVICE_NAME_MAX_LENGTH} characters: each is the value of the "
    f"{LABEL_SERVICE} label on its pods"
)
_SERVICE_NAME = re.compile(SERVICE_NAME_PATTERN)


def _service_name(name: str) -> str:
    if _SERVICE_NAME.fullmatch(name) is None:
        raise ValueError(f"{name!r}: {SERVICE_NAME_MESSAGE}")
    if len(name) > SERVICE_NAME_MAX_LENGTH:
        raise ValueError(SERVICE_NAME_LENGTH_MESSAGE)
    return name


ServiceName = Annotated[str, AfterValidator(_service_name)]


# CEL cannot name the offending keys here: a messageExpression joining them exceeds the apiserver's cost
# budget, keys of a map having no maximum length.  The models' messages name them.
_SERVICE_NAME_RULES: list[JsonValue] = [
    {"rule": f"self.all(k, k.matches('{SERVICE_NAME_PATTERN}'))", "message": SERVICE_NAME_MESSAGE},
    {"rule": f"self.all(k, k.size() <= {SERVICE_NAME_MAX_LENGTH})", "message": SERVICE_NAME_LENGTH_MESSAGE},
]
# fieldPath puts the error on a field instead of on the object as a whole.
_GRAPH_RULES: list[JsonValue] = [
    {
        "rule": f"self.metadata.name.size() <= {GRAPH_NAME_MAX_LENGTH}",
        "message": GRAPH_NAME_MESSAGE,
        "fieldPath": ".metadata",
    },
    {
        "rule": "!has(self.spec.services) || self.spec.services.all(k, "
        f"self.metadata.name.size() + k.size() <= {GRAPH_AND_SERVICE_MAX_LENGTH})",
        "message": GRAPH_AND_SERVICE_MESSAGE,
        "fieldPath": ".spec.services",
    },
]

_HAS_REF = "(has(self.checkpointRef) && size(self.checkpointRef) > 0)"
_ENABLED = "(has(self.enabled) && self.enabled)"
_CHECKPOINT_RULES: list[JsonValue] = [
    {
        "rule": f"!{_ENABLED} || !has(self.mode) || self.mode != 'Manual' || {_HAS_REF}",
        "message": MANUAL_NEEDS_REF_MESSAGE,
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
        max_length=CHECKPOINT_NAME_MAX_LENGTH,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="Name of a DynamoCheckpoint in the same namespace to restore from; "
        "when set, identity is not used to find one.  DynamoCheckpoint names are at most "
        f"{CHECKPOINT_NAME_MAX_LENGTH} characters.",
    )
    identity: CheckpointIdentity | None = Field(
        default=None,
        description="What the checkpoint must capture (legacy). Without it and without checkpointRef, the "
        "checkpoint is the DGD's own, of the service as the DGD runs it (Dynamo's DGD-managed checkpoint): "
        "its identity is derived from the service's spec.",
    )

    @model_validator(mode="after")
    def _manual_has_a_ref(self) -> ServiceCheckpointConfig:
        if self.enabled and not self.checkpoint_ref and self.mode is CheckpointMode.MANUAL:
            raise ValueError(MANUAL_NEEDS_REF_MESSAGE)
        return self

    @property
    def auto(self) -> bool:
        """Whether the controller finds or creates the service's DynamoCheckpoint (Auto mode): checkpointing
        on and no checkpointRef (which names the checkpoint to use; identity is then ignored)."""
        return self.enabled and not self.checkpoint_ref and self.mode is CheckpointMode.AUTO


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
    envs: list[EnvVar] | None = Field(default=None, description="Kubernetes EnvVars; each needs a name.")
    env_from_secret: str | None = Field(
        default=None, description="Secret whose keys become environment variables."
    )
    extra_pod_spec: ExtraPodSpec | None = None
    liveness_probe: dict[str, Any] | None = Field(default=None, description="A Kubernetes Probe.")
    readiness_probe: dict[str, Any] | None = Field(default=None, description="A Kubernetes Probe.")
    checkpoint: ServiceCheckpointConfig | None = None


class DynamoGraphDeploymentSpec(KubeModel):
    services: dict[ServiceName, ServiceSpec] | None = Field(
        default=None,
        max_length=25,
        description="The services of the graph, by name: letters, digits and '-', starting and ending with "
        "a letter or digit (CamelCase is fine, pod names take it lower-cased), at most "
        f"{SERVICE_NAME_MAX_LENGTH} characters, and at most {GRAPH_AND_SERVICE_MAX_LENGTH} together with "
        "the graph's metadata.name.",
        json_schema_extra={"x-kubernetes-validations": _SERVICE_NAME_RULES},
    )
    envs: list[EnvVar] | None = Field(
        default=None,
        description="Kubernetes EnvVars for every service unless a service overrides them; "
        "each needs a name.",
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
    """A graph of Dynamo inference services deployed together.

    Its metadata.name is at most 63 characters, and at most 56 together with any service's name.
    """

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _GRAPH_RULES})

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

    @field_validator("metadata")
    @classmethod
    def _name_fits_a_label(cls, metadata: ObjectMeta) -> ObjectMeta:
        return graph_name_fits(metadata)

    @model_validator(mode="after")
    def _pod_names_fit(self) -> DynamoGraphDeployment:
        pod_names_fit(self.metadata.name or "", list(self.spec.services or {}), GRAPH_AND_SERVICE_MESSAGE)
        return self

    @model_validator(mode="after")
    def _dgd_managed_checkpoints_have_a_backend(self) -> DynamoGraphDeployment:
        for name, service in (self.spec.services or {}).items():
            if service.checkpoint is not None and service.checkpoint.auto:
                checkpoint_identity(self.spec, name)
        return self


# --- the identity of a DGD-managed checkpoint -----------------------------------------------------------
# Dynamo's newest API deprecates identity and mode for the checkpoints a DGD manages: checkpoint.enabled alone
# asks for a checkpoint of the service as the DGD runs it, which pods of the same spec restore from
# (ai-dynamo/dynamo api/v1beta1 ComponentCheckpointConfig; its worker rollout hash covers what shapes a
# worker's pod). The checkpoint stays keyed by a 16-char identity hash: one derived from the service.
_DYNAMO_MODULE = re.compile(r"dynamo\.(vllm|sglang|trtllm)$")
_MODEL_FLAGS = ("--model", "--model-path")
# What does not change a worker's pod: scaling, and the checkpoint settings themselves.
_NOT_IN_WORKER_HASH = {"replicas", "checkpoint"}
_GRAPH_IN_WORKER_HASH = {"envs", "labels", "annotations"}


def checkpoint_identity(spec: DynamoGraphDeploymentSpec, service_name: str) -> CheckpointIdentity:
    """The identity of ``service_name``'s checkpoint in Auto mode: its own identity if it has one (legacy),
    else one derived from the service: backendFramework from the graph or from the main container's
    ``python -m dynamo.<framework>``, model from its ``--model`` argument (else the service's name), and
    extraParameters.workerSpecHash, over every field that shapes the worker's pod, so a changed worker
    spec gets a checkpoint of its own. ValueError when the backend cannot be told."""
    service = (spec.services or {})[service_name]
    if service.checkpoint is not None and service.checkpoint.identity is not None:
        return service.checkpoint.identity
    main = (service.extra_pod_spec.main_container if service.extra_pod_spec else None) or {}
    argv = [str(a) for a in [*(main.get("command") or []), *(main.get("args") or [])]]
    framework = spec.backend_framework or _framework_of(argv)
    if framework is None:
        raise ValueError(f"service {service_name}: {DGD_MANAGED_FRAMEWORK_MESSAGE}")
    worker = service.model_dump(by_alias=True, exclude_none=True, mode="json", exclude=_NOT_IN_WORKER_HASH)
    graph = spec.model_dump(by_alias=True, exclude_none=True, mode="json", include=_GRAPH_IN_WORKER_HASH)
    digest = hashlib.sha256(
        json.dumps({"graph": graph, "worker": worker}, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    return CheckpointIdentity(
        model=_model_of(argv) or service_name,
        backend_framework=framework,
        extra_parameters={"workerSpecHash": digest[:16]},
    )


def _framework_of(argv: list[str]) -> BackendFramework | None:
    for flag, value in itertools.pairwise(argv):
        if flag == "-m" and (m := _DYNAMO_MODULE.match(value)):
            return BackendFramework(m.group(1))
    return None


def _model_of(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _MODEL_FLAGS:
            if eq:
                return value or None
            if i + 1 < len(argv):
                return argv[i + 1]
    return None


def graph_name_fits(metadata: ObjectMeta) -> ObjectMeta:
    """A DGD's name becomes a label value on every pod it owns (either API version)."""
    if metadata.name is not None and len(metadata.name) > GRAPH_NAME_MAX_LENGTH:
        raise ValueError(GRAPH_NAME_MESSAGE)
    return metadata


def pod_names_fit(graph: str, members: list[str], message: str) -> None:
    """Worker pods are named after the graph and the member (service or component); ``message`` names
    the rule in the version's own words."""
    too_long = [m for m in members if len(graph) + len(m) > GRAPH_AND_SERVICE_MAX_LENGTH]
    if graph and too_long:
        raise ValueError(f"{message} ({graph!r} with {', '.join(map(repr, too_long))})")
