"""DynamoGraphDeployment (nvidia.com/v1alpha1), following NVIDIA Dynamo's own schema.

Only what this project reads or validates is declared (after Dynamo's
deploy/operator/api/v1alpha1: dynamographdeployment_types.go, dynamocomponentdeployment_types.go,
common.go).  Everything else in a Dynamo manifest -- PodSpec fields in extraPodSpec, probes, ingress,
multinode, fields newer Dynamo releases add -- is kept, by the models and by the CRD, so real Dynamo
manifests apply unchanged and survive a read-modify-write.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    JsonValue,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from dynamo_snapshot.api.checkpoint import CHECKPOINT_NAME_MAX_LENGTH
from dynamo_snapshot.api.identity import BackendFramework, CheckpointIdentity
from dynamo_snapshot.api.kube import (
    DNS1123_SUBDOMAIN_PATTERN,
    LABEL_VALUE_MAX_LENGTH,
    QUANTITY_MAX_LENGTH,
    QUANTITY_MESSAGE,
    QUANTITY_PATTERN,
    RESOURCE_NAME_MAX_LENGTH,
    RESOURCE_NAME_MESSAGE,
    RESOURCE_NAME_PATTERN,
    Condition,
    CustomResource,
    KubeModel,
    NonNegativeInt32,
    ObjectMeta,
    PrinterColumn,
    ResourceInfo,
    is_extended_resource,
    parse_quantity,
    requires_equal_limit,
    resource_name_problem,
)
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION, LABEL_GRAPH, LABEL_SERVICE, RESOURCE_GPU

__all__ = [
    "CHECKPOINT_NEEDS_SOURCE_MESSAGE",
    "ENV_NAME_MESSAGE",
    "ENV_NAME_REQUIRED_MESSAGE",
    "ENV_VALUE_AND_VALUE_FROM_MESSAGE",
    "EXTENDED_RESOURCE_MESSAGE",
    "GIVEN_TWICE_MESSAGE",
    "GPU_COUNT_MESSAGE",
    "GRAPH_AND_SERVICE_MAX_LENGTH",
    "GRAPH_AND_SERVICE_MESSAGE",
    "GRAPH_NAME_MAX_LENGTH",
    "GRAPH_NAME_MESSAGE",
    "MANUAL_NEEDS_REF_MESSAGE",
    "NOT_A_RESOURCE_MESSAGE",
    "REQUEST_ABOVE_LIMIT_MESSAGE",
    "REQUEST_NOT_LIMIT_MESSAGE",
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

# --- environment variables ------------------------------------------------------------------------------
ENV_NAME_REQUIRED_MESSAGE = "every environment variable needs a name"
ENV_NAME_MESSAGE = "environment variable names must be printable ASCII characters other than '='"
ENV_VALUE_AND_VALUE_FROM_MESSAGE = "an environment variable takes value or valueFrom, not both"
# Kubernetes' relaxed environment variable names: printable ASCII, '=' excepted.
_ENV_NAME_PATTERN = "^[ -<>-~]+$"
_ENV_NAME = re.compile(_ENV_NAME_PATTERN)
_ENV_VAR_SCHEMA: dict[str, JsonValue] = {
    "type": "object",
    "description": "A Kubernetes EnvVar: name, and value or valueFrom.",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "pattern": _ENV_NAME_PATTERN},
        "value": {"type": "string"},
        "valueFrom": {"type": "object", "additionalProperties": True},
    },
    "additionalProperties": True,
    "x-kubernetes-validations": [
        {
            "rule": "!has(self.valueFrom) || !has(self.value) || size(self.value) == 0",
            "message": ENV_VALUE_AND_VALUE_FROM_MESSAGE,
        }
    ],
}


def _env_var(env: dict[str, Any]) -> dict[str, Any]:
    name = env.get("name")
    if name is None or name == "":
        raise ValueError(f"{ENV_NAME_REQUIRED_MESSAGE}: {env!r} has none")
    if not isinstance(name, str) or _ENV_NAME.fullmatch(name) is None:
        raise ValueError(f"{name!r}: {ENV_NAME_MESSAGE}")
    if "value" in env and not isinstance(env["value"], str):
        raise ValueError(f"{name}: value must be a string (quote it in YAML), not {env['value']!r}")
    if "valueFrom" in env and not isinstance(env["valueFrom"], dict):
        raise ValueError(f"{name}: valueFrom must be an object, not {env['valueFrom']!r}")
    if env.get("value") and "valueFrom" in env:
        raise ValueError(f"{name}: {ENV_VALUE_AND_VALUE_FROM_MESSAGE}")
    return env


# Kept as the plain dict Kubernetes takes, so manifests round-trip unchanged; checked like a pod would be.
EnvVar = Annotated[dict[str, Any], AfterValidator(_env_var), WithJsonSchema(_ENV_VAR_SCHEMA)]

# --- resources ----------------------------------------------------------------------------------------------
GPU_COUNT_MESSAGE = 'must be a whole number of GPUs, such as "1": Kubernetes hands out no fractions of a GPU'
EXTENDED_RESOURCE_MESSAGE = (
    "must be a whole number: resources with a domain in their name (such as nvidia.com/gpu) "
    "come in whole units"
)
GIVEN_TWICE_MESSAGE = "is given twice with different values: give it once, or the same value each time"
NOT_A_RESOURCE_MESSAGE = (
    "is neither a field of Dynamo's resources (cpu, memory, gpu, gpuType, custom) nor a Kubernetes "
    "resource name (cpu, memory, ephemeral-storage, hugepages-<size>, or a name with a domain such as "
    "nvidia.com/gpu)"
)
REQUEST_ABOVE_LIMIT_MESSAGE = "a request must not exceed its limit"
REQUEST_NOT_LIMIT_MESSAGE = (
    "the request of a resource with a domain in its name (such as nvidia.com/gpu) must equal its limit"
)
_WHOLE_NUMBER_PATTERN = "^[0-9]+$"
_WHOLE_NUMBER = re.compile(_WHOLE_NUMBER_PATTERN)
# CEL spells property names with '.', '/' and '-' escaped.
_CEL_NVIDIA_GPU = "self.nvidia__dot__com__slash__gpu"


def _rules(*rules: tuple[str, str]) -> dict[str, JsonValue]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}


def _quantity(value: str) -> str:
    parse_quantity(value)
    return value


def _gpu_count(value: str) -> str:
    if _WHOLE_NUMBER.fullmatch(value) is None:
        raise ValueError(f"{value!r} {GPU_COUNT_MESSAGE}")
    return value


def _gpu_count_int_or_string(value: object) -> int | str:
    # Kubernetes quantities are int-or-string: pod manifests often write nvidia.com/gpu: 1 unquoted.
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, str):
        return _gpu_count(value)
    raise ValueError(f"{value!r} {GPU_COUNT_MESSAGE}")


Quantity = Annotated[
    str,
    Field(
        max_length=QUANTITY_MAX_LENGTH,
        json_schema_extra=_rules((f"self.matches('{QUANTITY_PATTERN}')", QUANTITY_MESSAGE)),
    ),
    AfterValidator(_quantity),
]
GpuCount = Annotated[
    str,
    Field(
        max_length=QUANTITY_MAX_LENGTH,
        json_schema_extra=_rules((f"self.matches('{_WHOLE_NUMBER_PATTERN}')", GPU_COUNT_MESSAGE)),
    ),
    AfterValidator(_gpu_count),
]
GpuCountIntOrString = Annotated[
    int | str,
    PlainValidator(_gpu_count_int_or_string),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "maxLength": QUANTITY_MAX_LENGTH,
            **_rules((f"string(self).matches('{_WHOLE_NUMBER_PATTERN}')", GPU_COUNT_MESSAGE)),
        }
    ),
]
ResourceName = Annotated[
    str,
    Field(
        max_length=RESOURCE_NAME_MAX_LENGTH, pattern=RESOURCE_NAME_PATTERN, description=RESOURCE_NAME_MESSAGE
    ),
]


def _gpu_name(item: str) -> str:
    """CEL: the resource name an item's gpu count is for."""
    return f"(has({item}.gpuType) ? {item}.gpuType : '{RESOURCE_GPU}')"


_ITEM_RULES = _rules(
    (
        f"!has(self.gpu) || !has({_CEL_NVIDIA_GPU}) || {_gpu_name('self')} != '{RESOURCE_GPU}'"
        f" || !isQuantity(self.gpu) || !isQuantity(string({_CEL_NVIDIA_GPU}))"
        f" || quantity(self.gpu).compareTo(quantity(string({_CEL_NVIDIA_GPU}))) == 0",
        f"{RESOURCE_GPU} {GIVEN_TWICE_MESSAGE} (gpu and {RESOURCE_GPU})",
    ),
    (
        f"!has(self.gpu) || !has(self.custom) || !({_gpu_name('self')} in self.custom)"
        f" || !isQuantity(self.gpu) || !isQuantity(self.custom[{_gpu_name('self')}])"
        f" || quantity(self.gpu).compareTo(quantity(self.custom[{_gpu_name('self')}])) == 0",
        f"the GPU count {GIVEN_TWICE_MESSAGE} (gpu and custom)",
    ),
)
_CUSTOM_RULES = _rules(
    (f"self.all(k, k.matches('{RESOURCE_NAME_PATTERN}'))", f"keys {RESOURCE_NAME_MESSAGE}"),
    (
        "self.all(k, !k.contains('/') || k.contains('kubernetes.io/') || !isQuantity(self[k])"
        " || quantity(self[k]).isInteger())",
        f"values of resources with a domain {EXTENDED_RESOURCE_MESSAGE}",
    ),
)


def _request_limit_rule(field: str) -> tuple[str, str]:
    both = f"has(self.requests) && has(self.limits) && has(self.requests.{field}) && has(self.limits.{field})"
    valid = f"isQuantity(self.requests.{field}) && isQuantity(self.limits.{field})"
    fits = f"quantity(self.requests.{field}).compareTo(quantity(self.limits.{field})) <= 0"
    return (
        f"!({both}) || !({valid}) || {fits}",
        f"requests.{field} must not exceed limits.{field}: {REQUEST_ABOVE_LIMIT_MESSAGE}",
    )


_RESOURCES_RULES = _rules(
    _request_limit_rule("cpu"),
    _request_limit_rule("memory"),
    (
        "!(has(self.requests) && has(self.limits) && has(self.requests.gpu) && has(self.limits.gpu))"
        f" || {_gpu_name('self.requests')} != {_gpu_name('self.limits')}"
        " || !(isQuantity(self.requests.gpu) && isQuantity(self.limits.gpu))"
        " || quantity(self.requests.gpu).compareTo(quantity(self.limits.gpu)) == 0",
        f"requests.gpu and limits.gpu differ: {REQUEST_NOT_LIMIT_MESSAGE} (give limits.gpu alone)",
    ),
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
        max_length=CHECKPOINT_NAME_MAX_LENGTH,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="Name of a DynamoCheckpoint in the same namespace to restore from; "
        "when set, identity is not used to find one.  DynamoCheckpoint names are at most "
        f"{CHECKPOINT_NAME_MAX_LENGTH} characters.",
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
    """Requests or limits: Dynamo's fields (quantities as strings, e.g. gpu: "1"), and any Kubernetes
    resource by its own name (e.g. nvidia.com/gpu: "1", ephemeral-storage: 10Gi), as Dynamo's docs write
    them.  Every one goes into the worker's container resources."""

    model_config = ConfigDict(json_schema_extra=_ITEM_RULES)

    cpu: Quantity | None = Field(default=None, description='CPU, e.g. "2" or "500m".')
    memory: Quantity | None = Field(default=None, description='Memory, e.g. "8Gi".')
    gpu: GpuCount | None = Field(
        default=None,
        description="Whole number of GPUs (of gpuType), on each node for multinode services.",
    )
    gpu_type: ResourceName | None = Field(
        default=None, description=f'GPU resource name; default "{RESOURCE_GPU}".'
    )
    custom: dict[str, Quantity] | None = Field(
        default=None,
        max_length=64,
        description="More resources by Kubernetes resource name, e.g. rdma/ib.",
        json_schema_extra=_CUSTOM_RULES,
    )
    nvidia_gpu: GpuCountIntOrString | None = Field(
        default=None,
        alias=RESOURCE_GPU,
        description="Whole number of GPUs, as Kubernetes spells the resource; if gpu is given too "
        "(without another gpuType), the two must agree.",
    )

    @model_validator(mode="after")
    def _every_key_is_a_resource(self) -> ResourceItem:
        for key, value in (self.model_extra or {}).items():
            if resource_name_problem(key) is not None:
                raise ValueError(f"{key!r} {NOT_A_RESOURCE_MESSAGE}")
            if not (type(value) is int and value >= 0) and not isinstance(value, str):
                raise ValueError(f"{key}: {value!r} {QUANTITY_MESSAGE}")
        self.quantities()
        return self

    def quantities(self) -> dict[str, str]:
        """Resource name -> quantity, as a container's requests or limits take them.

        Raises ValueError when a value is no quantity, when a resource with a domain is not a whole
        number, and when a resource is given twice (gpu and nvidia.com/gpu, say) with different values.
        """
        given: list[tuple[str, str, str]] = []  # (resource, quantity, where it was given)
        if self.cpu is not None:
            given.append(("cpu", self.cpu, "cpu"))
        if self.memory is not None:
            given.append(("memory", self.memory, "memory"))
        if self.gpu is not None:
            given.append((self.gpu_type or RESOURCE_GPU, self.gpu, "gpu"))
        if self.nvidia_gpu is not None:
            given.append((RESOURCE_GPU, str(self.nvidia_gpu), RESOURCE_GPU))
        for key, value in (self.model_extra or {}).items():
            given.append((key, str(value), key))
        for key, value in (self.custom or {}).items():
            problem = resource_name_problem(key)
            if problem is not None:
                raise ValueError(f"custom: {problem}")
            given.append((key, value, f"custom.{key}"))
        out: dict[str, str] = {}
        first: dict[str, str] = {}
        for name, value, where in given:
            amount = parse_quantity(value)
            if is_extended_resource(name) and amount != amount.to_integral_value():
                raise ValueError(f"{where}: {value!r} {EXTENDED_RESOURCE_MESSAGE}")
            if name in out:
                if parse_quantity(out[name]) != amount:
                    raise ValueError(
                        f"{name} {GIVEN_TWICE_MESSAGE} ({first[name]}: {out[name]!r}, {where}: {value!r})"
                    )
                continue
            out[name], first[name] = value, where
        return out


class Resources(KubeModel):
    """What the service's worker container requests and is limited to."""

    model_config = ConfigDict(json_schema_extra=_RESOURCES_RULES)

    requests: ResourceItem | None = None
    limits: ResourceItem | None = None
    claims: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _requests_fit_limits(self) -> Resources:
        self.container_resources()
        return self

    def container_resources(self) -> dict[str, dict[str, str]]:
        """The container's resources: {"requests": {...}, "limits": {...}}, either left out when empty.

        A resource Kubernetes will not overcommit (GPUs and other resources with a domain, hugepages)
        given only as a request is given as the limit too: Kubernetes requires the limit, and the device
        plugin reads it.  Raises ValueError for a request above its limit, or one of those resources whose
        request and limit differ.
        """
        requests = self.requests.quantities() if self.requests else {}
        limits = self.limits.quantities() if self.limits else {}
        for name, request in requests.items():
            limit = limits.get(name)
            if limit is None:
                if requires_equal_limit(name):
                    limits[name] = request
                continue
            asked, allowed = parse_quantity(request), parse_quantity(limit)
            if requires_equal_limit(name) and asked != allowed:
                raise ValueError(
                    f"requests.{name} ({request!r}) and limits.{name} ({limit!r}) differ: "
                    + REQUEST_NOT_LIMIT_MESSAGE
                )
            if asked > allowed:
                raise ValueError(
                    f"requests.{name} ({request!r}) exceeds limits.{name} ({limit!r}): "
                    + REQUEST_ABOVE_LIMIT_MESSAGE
                )
        out: dict[str, dict[str, str]] = {}
        if requests:
            out["requests"] = requests
        if limits:
            out["limits"] = limits
        return out


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
        if metadata.name is not None and len(metadata.name) > GRAPH_NAME_MAX_LENGTH:
            raise ValueError(GRAPH_NAME_MESSAGE)
        return metadata

    @model_validator(mode="after")
    def _pod_names_fit(self) -> DynamoGraphDeployment:
        name = self.metadata.name or ""
        too_long = [s for s in self.spec.services or {} if len(name) + len(s) > GRAPH_AND_SERVICE_MAX_LENGTH]
        if name and too_long:
            raise ValueError(f"{GRAPH_AND_SERVICE_MESSAGE} ({name!r} with {', '.join(map(repr, too_long))})")
        return self
