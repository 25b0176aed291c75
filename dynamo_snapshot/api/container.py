"""What a DynamoGraphDeployment service says about its worker container: environment variables and
resources (requests and limits, GPUs), checked as the apiserver and the kubelet would check a pod's."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    JsonValue,
    PlainValidator,
    WithJsonSchema,
    model_validator,
)

from dynamo_snapshot.api.kube import (
    QUANTITY_MAX_LENGTH,
    QUANTITY_MESSAGE,
    QUANTITY_PATTERN,
    RESOURCE_NAME_MAX_LENGTH,
    RESOURCE_NAME_MESSAGE,
    RESOURCE_NAME_PATTERN,
    KubeModel,
    is_extended_resource,
    parse_quantity,
    requires_equal_limit,
    resource_name_problem,
)
from dynamo_snapshot.api.protocol import RESOURCE_GPU

__all__ = [
    "ENV_NAME_MESSAGE",
    "ENV_NAME_REQUIRED_MESSAGE",
    "ENV_VALUE_AND_VALUE_FROM_MESSAGE",
    "EXTENDED_RESOURCE_MESSAGE",
    "GIVEN_TWICE_MESSAGE",
    "GPU_COUNT_MESSAGE",
    "NOT_A_RESOURCE_MESSAGE",
    "REQUEST_ABOVE_LIMIT_MESSAGE",
    "REQUEST_NOT_LIMIT_MESSAGE",
    "EnvVar",
    "ResourceItem",
    "Resources",
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
