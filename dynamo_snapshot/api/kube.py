"""Kubernetes building blocks shared by every custom resource model.

Models speak the API's camelCase on the wire and snake_case in Python.  ``KubeModel`` keeps keys it
does not declare, so an object read from the cluster and written back loses nothing a newer Dynamo
(or a user) put there; the CRD generator turns that same choice into
``x-kubernetes-preserve-unknown-fields`` so the apiserver keeps them too.  ``StrictKubeModel`` is for
the few shapes where an unknown key is a mistake that must be reported, not carried along.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, localcontext
from enum import StrEnum
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = [
    "DNS1123_SUBDOMAIN_MAX_LENGTH",
    "DNS1123_SUBDOMAIN_PATTERN",
    "INT32_MAX",
    "LABEL_VALUE_MAX_LENGTH",
    "QUANTITY_MAX_LENGTH",
    "QUANTITY_MESSAGE",
    "QUANTITY_PATTERN",
    "RESOURCE_NAME_MAX_LENGTH",
    "RESOURCE_NAME_MESSAGE",
    "RESOURCE_NAME_PATTERN",
    "Condition",
    "ConditionStatus",
    "CustomResource",
    "KubeModel",
    "NonNegativeInt32",
    "ObjectMeta",
    "PositiveInt32",
    "PrinterColumn",
    "ResourceInfo",
    "StrictKubeModel",
    "Timestamp",
    "is_extended_resource",
    "parse_quantity",
    "requires_equal_limit",
    "resource_name_problem",
]

INT32_MAX = 2**31 - 1

# Go's int32 fields reject anything wider, and the apiserver rejects "2" for an integer: strict ints
# keep Python from accepting what Dynamo's operator or the apiserver would refuse.
NonNegativeInt32 = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
PositiveInt32 = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]

# Kept as the RFC 3339 text the apiserver sends, so objects round-trip byte for byte.
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]

DNS1123_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_SUBDOMAIN_MAX_LENGTH = 253
LABEL_VALUE_MAX_LENGTH = 63

# Patterns below spell "." and "+" as character classes so one string is a valid regular expression in
# Python, in the apiserver's OpenAPI patterns and inside CEL string literals (where "\." is no escape).

# Kubernetes' quantity grammar (resource.ParseQuantity) without the minus sign: no resource request or
# limit may be negative.
QUANTITY_PATTERN = r"^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
QUANTITY_MAX_LENGTH = 64
QUANTITY_MESSAGE = 'must be a Kubernetes quantity, such as "2", "500m" or "8Gi", and not negative'
_QUANTITY = re.compile(QUANTITY_PATTERN)
_BINARY_SI = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

# What a container may ask for (Kubernetes' ValidateContainerResourceName): the standard resources, or a
# qualified name with a domain (an extended resource such as nvidia.com/gpu).
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
RESOURCE_NAME_PATTERN = (
    r"^(cpu|memory|ephemeral-storage|hugepages-[-A-Za-z0-9_.]+"
    rf"|{_DNS_SUBDOMAIN}/([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
RESOURCE_NAME_MAX_LENGTH = DNS1123_SUBDOMAIN_MAX_LENGTH + 1 + LABEL_VALUE_MAX_LENGTH
RESOURCE_NAME_MESSAGE = (
    "must be a Kubernetes resource name: cpu, memory, ephemeral-storage, hugepages-<size>, "
    "or a name with a domain such as nvidia.com/gpu"
)
_RESOURCE_NAME = re.compile(RESOURCE_NAME_PATTERN)
_HUGEPAGES_PREFIX = "hugepages-"
_REQUESTS_PREFIX = "requests."
_NATIVE_DOMAIN = "kubernetes.io/"


class KubeModel(BaseModel):
    """Base for API objects: camelCase aliases, unknown keys kept."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="allow",
    )

    def to_dict(self) -> dict[str, Any]:
        """The object as the API spells it, with only the fields that were given."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class StrictKubeModel(KubeModel):
    """For shapes where an unknown key is a typo to reject, e.g. the hashed checkpoint identity."""

    model_config = ConfigDict(extra="forbid")


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(KubeModel):
    """One observation of an aspect of the object's state (the standard metav1.Condition shape)."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        description="Type of condition in CamelCase or in foo.example.com/CamelCase.",
    )
    status: ConditionStatus = Field(description="Status of the condition: True, False or Unknown.")
    observed_generation: NonNegativeInt32 | None = Field(
        default=None, description="The .metadata.generation the condition was set from."
    )
    last_transition_time: Timestamp = Field(description="Last time the condition changed status.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="Programmatic CamelCase identifier of the reason for the last transition.",
    )
    message: str = Field(max_length=32768, description="Human-readable details about the transition.")


class ObjectMeta(KubeModel):
    """The subset of metav1.ObjectMeta this project reads; everything else is carried through."""

    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    finalizers: list[str] | None = None
    owner_references: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class PrinterColumn:
    """A column of ``kubectl get`` output (CRD additionalPrinterColumns)."""

    name: str
    json_path: str
    type: str = "string"
    description: str = ""
    priority: int = 0


@dataclass(frozen=True)
class ResourceInfo:
    """How a custom resource is registered with the apiserver."""

    group: str
    version: str
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...] = ()
    scope: str = "Namespaced"
    printer_columns: tuple[PrinterColumn, ...] = field(default_factory=tuple)
    status_subresource: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{self.group}"


class CustomResource(KubeModel):
    """A top-level custom resource.  Subclasses set ``resource`` and declare apiVersion, kind, spec."""

    resource: ClassVar[ResourceInfo]

    metadata: ObjectMeta = Field(default_factory=ObjectMeta)


def parse_quantity(text: str) -> Decimal:
    """The value of a Kubernetes quantity ("500m" -> 0.5, "8Gi" -> 8589934592).

    Raises ValueError with ``QUANTITY_MESSAGE`` for anything else, negative quantities included.
    """
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} {QUANTITY_MESSAGE}")
    number, suffix = match.group(1), match.group(3) or ""
    # Exact for every quantity that fits the 64 characters a field allows, exponents aside.
    with localcontext(prec=QUANTITY_MAX_LENGTH + 20):
        try:
            if suffix in _BINARY_SI:
                return Decimal(number) * _BINARY_SI[suffix]
            exponent = _DECIMAL_SI[suffix] if suffix in _DECIMAL_SI else int(suffix[1:])
            return Decimal(number).scaleb(exponent)
        except ArithmeticError:
            raise ValueError(f"{text!r}: the exponent is out of range") from None


def resource_name_problem(name: str) -> str | None:
    """Why a container could not ask for resource ``name``, or None when it can."""
    if len(name) > RESOURCE_NAME_MAX_LENGTH or _RESOURCE_NAME.fullmatch(name) is None:
        return f"{name!r} {RESOURCE_NAME_MESSAGE}"
    if "/" in name:
        if name.startswith(_REQUESTS_PREFIX):
            return f"{name!r}: names starting with {_REQUESTS_PREFIX!r} are Kubernetes' quota names"
        domain, _, short = name.partition("/")
        if len(short) > LABEL_VALUE_MAX_LENGTH:
            return f"{name!r}: the part after the domain must be at most {LABEL_VALUE_MAX_LENGTH} characters"
        # Kubernetes checks an extended resource's quota name, requests.<name>, as a qualified name.
        if is_extended_resource(name) and len(_REQUESTS_PREFIX + domain) > DNS1123_SUBDOMAIN_MAX_LENGTH:
            return f"{name!r}: the domain is too long for an extended resource"
    return None


def is_extended_resource(name: str) -> bool:
    """A resource outside Kubernetes' own (a name with a domain other than kubernetes.io), e.g. GPUs.

    Kubernetes hands these out in whole units only, and only where the request equals the limit.
    """
    return "/" in name and _NATIVE_DOMAIN not in name


def requires_equal_limit(name: str) -> bool:
    """Whether Kubernetes requires the limit of ``name`` to be set, and equal to its request."""
    return is_extended_resource(name) or name.startswith(_HUGEPAGES_PREFIX)
