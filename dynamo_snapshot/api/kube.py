"""Kubernetes building blocks shared by every custom resource model.

Models speak the API's camelCase on the wire and snake_case in Python.  ``KubeModel`` keeps keys it
does not declare, so an object read from the cluster and written back loses nothing a newer Dynamo
(or a user) put there; the CRD generator turns that same choice into
``x-kubernetes-preserve-unknown-fields`` so the apiserver keeps them too.  ``StrictKubeModel`` is for
the few shapes where an unknown key is a mistake that must be reported, not carried along.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = [
    "DNS1123_SUBDOMAIN_MAX_LENGTH",
    "DNS1123_SUBDOMAIN_PATTERN",
    "INT32_MAX",
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
