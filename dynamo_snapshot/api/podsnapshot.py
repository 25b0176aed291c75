"""PodSnapshot and PodSnapshotContent (nvidia.com/v1alpha1): the generic snapshot API of NVIDIA Snapshot.

A user asks for a checkpoint of a running pod with a PodSnapshot (namespaced); the controller binds it to
a cluster-scoped PodSnapshotContent, named after the PodSnapshot's UID, which says where the capture runs
and, once it is Ready, what was captured. Field for field as ai-dynamo/snapshot's api/v1alpha1
(podsnapshot_types.go, podsnapshotcontent_types.go): objects written for NVIDIA's operator apply here
unchanged. Status fields beyond upstream's (the artifact and what a node needs to restore it) are
additive: an upstream reader ignores them. Where the CRD is upstream's, the apiserver prunes them: the
node agent writes the same facts in annotations of the content too (``content_artifact`` and
``content_compatibility`` read either). ``status.source`` (CheckpointSource) is upstream's own: what the
capture ran on, for people choosing a restore target; nothing reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import ConfigDict, Field, JsonValue, ValidationError

from dynamo_snapshot.api.kube import (
    Condition,
    CustomResource,
    KubeModel,
    NonNegativeInt32,
    PrinterColumn,
    ResourceInfo,
)
from dynamo_snapshot.api.protocol import (
    ANNOTATION_CONTENT_ARTIFACT,
    ANNOTATION_CONTENT_COMPATIBILITY,
    API_GROUP,
    API_VERSION,
)

__all__ = [
    "CONTAINER_NAME_PATTERN",
    "CONTENT_NAME_PREFIX",
    "SPEC_IMMUTABLE_MESSAGE",
    "CheckpointSource",
    "CheckpointSourceDevices",
    "CheckpointSourceNode",
    "CheckpointSourcePod",
    "ContainerName",
    "NvidiaCheckpointSource",
    "NvidiaCheckpointSourceInstance",
    "PodReference",
    "PodSnapshot",
    "PodSnapshotArtifact",
    "PodSnapshotCompatibility",
    "PodSnapshotContent",
    "PodSnapshotContentSource",
    "PodSnapshotContentSpec",
    "PodSnapshotContentStatus",
    "PodSnapshotReason",
    "PodSnapshotReference",
    "PodSnapshotSource",
    "PodSnapshotSpec",
    "PodSnapshotStatus",
    "content_artifact",
    "content_compatibility",
    "content_name",
]

SPEC_IMMUTABLE_MESSAGE = "spec is immutable"
# A DNS-1123 label: what Kubernetes allows as a container name.
CONTAINER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# PodSnapshotContent names: this prefix and the PodSnapshot's UID, so one PodSnapshot binds one content.
CONTENT_NAME_PREFIX = "podsnapshotcontent-"

_IMMUTABLE: dict[str, JsonValue] = {
    "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": SPEC_IMMUTABLE_MESSAGE}]
}
_CONDITIONS: dict[str, JsonValue] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}

ContainerName = Annotated[str, Field(min_length=1, max_length=63, pattern=CONTAINER_NAME_PATTERN)]


class PodSnapshotReason(StrEnum):
    """Reasons of a PodSnapshot's and a PodSnapshotContent's Ready and Failed conditions."""

    PENDING = "Pending"  # Ready False: bound, the node agent has not captured it yet
    CAPTURED = "Captured"  # Ready True
    SOURCE_POD_NOT_FOUND = "SourcePodNotFound"
    STALE_POD_REFERENCE = "StalePodReference"  # podRef.uid names another pod than the one of that name
    CONTENT_CONFLICT = "ContentConflict"  # the content of this name is bound to another PodSnapshot
    INVALID_TARGET_CONTAINER = "InvalidTargetContainer"  # the pod has no container of that name
    INVALID_SPEC = "InvalidSpec"
    CHECKPOINT_FAILED = "CheckpointFailed"  # the node agent's capture failed
    CAPTURE_IN_PROGRESS = "CaptureInProgress"  # Ready False: the node agent took the capture up
    SOURCE_POD_GONE = "SourcePodGone"  # the source pod was deleted before the capture ended
    SNAPSHOT_FAILED = "SnapshotFailed"  # the content's PodSnapshot failed already: nothing to capture
    NO_NODE_AGENT = "NoNodeAgent"  # no node agent took the capture up in time
    SNAPSHOT_NOT_FOUND = "SnapshotNotFound"  # the content's PodSnapshot does not exist
    SNAPSHOT_DELETED = "SnapshotDeleted"  # the content's PodSnapshot is being deleted
    INVALID_DESTINATION = "InvalidDestination"  # the content or its pod is not on the capturing node
    # The DynamoCheckpoint that controls the PodSnapshot, whose identity seals the artifact:
    CHECKPOINT_NOT_FOUND = "CheckpointNotFound"  # not there, or another one of that name (UID)
    CHECKPOINT_DELETED = "CheckpointDeleted"  # being deleted
    INVALID_IDENTITY = "InvalidIdentity"  # its spec.identity is not a valid CheckpointIdentity


def content_name(snapshot_uid: str) -> str:
    """The PodSnapshotContent a PodSnapshot with this UID binds."""
    return f"{CONTENT_NAME_PREFIX}{snapshot_uid}"


class PodReference(KubeModel):
    """A pod in the PodSnapshot's own namespace, and the container to capture."""

    name: str = Field(min_length=1, description="Name of the pod.")
    uid: str | None = Field(
        default=None, description="UID of the pod; when set, a pod of that name with another UID is refused."
    )
    # One container: a checkpoint captures one process tree.
    containers: list[ContainerName] = Field(
        min_length=1, max_length=1, description="The container to capture (exactly one)."
    )


class PodSnapshotSource(KubeModel):
    """What to capture: a struct, so that other kinds of source can be added beside podRef."""

    pod_ref: PodReference = Field(description="The running pod to capture.")


class PodSnapshotSpec(KubeModel):
    model_config = ConfigDict(json_schema_extra=_IMMUTABLE)

    source: PodSnapshotSource


class PodSnapshotStatus(KubeModel):
    bound_snapshot_content_name: str | None = Field(
        default=None, description="The PodSnapshotContent bound to this PodSnapshot."
    )
    conditions: list[Condition] | None = Field(
        default=None,
        description="Ready (captured and verified) and Failed (terminal); both False or absent: in progress.",
        json_schema_extra=_CONDITIONS,
    )


class PodSnapshot(CustomResource):
    """A request to checkpoint a running pod; pods restore from it with nvidia.com/restore-from."""

    resource: ClassVar[ResourceInfo] = ResourceInfo(
        group=API_GROUP,
        version=API_VERSION,
        kind="PodSnapshot",
        plural="podsnapshots",
        singular="podsnapshot",
        short_names=("podsnap",),
        printer_columns=(
            PrinterColumn("Pod", ".spec.source.podRef.name", description="Captured pod"),
            PrinterColumn(
                "Content", ".status.boundSnapshotContentName", description="Bound PodSnapshotContent"
            ),
            PrinterColumn(
                "Ready", ".status.conditions[?(@.type=='Ready')].status", description="Ready condition"
            ),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )

    api_version: Literal["nvidia.com/v1alpha1"] = "nvidia.com/v1alpha1"
    kind: Literal["PodSnapshot"] = "PodSnapshot"
    spec: PodSnapshotSpec
    status: PodSnapshotStatus | None = None


class PodSnapshotReference(KubeModel):
    """The PodSnapshot a content is bound to."""

    namespace: str = Field(description="Namespace of the PodSnapshot.")
    name: str = Field(description="Name of the PodSnapshot.")
    uid: str | None = Field(default=None, description="UID of the PodSnapshot at binding.")


class PodSnapshotContentSource(KubeModel):
    pod_ref: PodReference = Field(description="The captured pod, its UID pinned at binding.")
    node_name: str = Field(min_length=1, description="The node the pod runs on: its agent captures it.")


class PodSnapshotContentSpec(KubeModel):
    model_config = ConfigDict(json_schema_extra=_IMMUTABLE)

    snapshot_ref: PodSnapshotReference
    source: PodSnapshotContentSource


class PodSnapshotArtifact(KubeModel):
    """Where the captured artifact is, and the digest every restore checks it against."""

    location: str | None = Field(default=None, description="The artifact's path in the store.")
    digest: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the artifact's sealed manifest."
    )
    size_bytes: int | None = Field(default=None, ge=0, description="Bytes in the artifact's files.")


class PodSnapshotCompatibility(KubeModel):
    """What a node and a container need to restore the snapshot."""

    gpu_product: str | None = Field(default=None, description="nvidia.com/gpu.product of the source node.")
    cuda_driver_major: str | None = Field(default=None, description="CUDA driver major version.")
    gpu_count: NonNegativeInt32 | None = Field(default=None, description="GPUs the captured process used.")
    image_id: str | None = Field(
        default=None, description="The image (by digest) the captured container ran: a restore needs it."
    )


class CheckpointSourceNode(KubeModel):
    """The node the checkpoint was captured on."""

    name: str | None = Field(default=None, description="Node the source pod ran on.")
    architecture: str | None = Field(
        default=None, description="The node's CPU architecture as GOARCH spells it (amd64, arm64, ...)."
    )
    kernel_version: str | None = Field(default=None, description="The node's kernel release.")


class CheckpointSourcePod(KubeModel):
    """The container the checkpoint was captured from, and the limits it ran under."""

    image: str | None = Field(default=None, description="Container image reference the capture ran.")
    image_digest: str | None = Field(
        default=None, description="Which build of the image ran, which a mutable tag does not say."
    )
    memory: str | None = Field(default=None, description="The container's memory limit; absent without one.")
    cpu: str | None = Field(default=None, description="The container's CPU limit; absent without one.")


class NvidiaCheckpointSourceInstance(KubeModel):
    """One GPU the captured container could see."""

    product_name: str | None = Field(default=None, description="GPU model as nvidia-smi reports it.")


class NvidiaCheckpointSource(KubeModel):
    """The NVIDIA GPUs the capture saw."""

    driver_version: str | None = Field(default=None, description="NVIDIA driver the capture ran against.")
    instances: list[NvidiaCheckpointSourceInstance] | None = Field(
        default=None, description="One entry per GPU the captured container could see."
    )


# One field per vendor, so several can be there at once; a vendor not named here is kept (KubeModel's
# schema preserves unknown fields), so a newer writer's values survive this CRD.
class CheckpointSourceDevices(KubeModel):
    """The devices the capture could see, by vendor."""

    nvidia: NvidiaCheckpointSource | None = None


# Restores never read it: their gates compare the artifact's manifest. A value the agent could not read
# is absent, not empty.
class CheckpointSource(KubeModel):
    """What the checkpoint was captured on, written with Ready; informational only."""

    node: CheckpointSourceNode | None = None
    pod: CheckpointSourcePod | None = None
    devices: CheckpointSourceDevices | None = None


class PodSnapshotContentStatus(KubeModel):
    conditions: list[Condition] | None = Field(
        default=None, description="Ready (captured and verified) and Failed.", json_schema_extra=_CONDITIONS
    )
    artifact: PodSnapshotArtifact | None = None
    compatibility: PodSnapshotCompatibility | None = None
    source: CheckpointSource | None = None


class PodSnapshotContent(CustomResource):
    """A captured (or capturing) pod checkpoint: cluster-scoped, made by the controller for a PodSnapshot."""

    resource: ClassVar[ResourceInfo] = ResourceInfo(
        group=API_GROUP,
        version=API_VERSION,
        kind="PodSnapshotContent",
        plural="podsnapshotcontents",
        singular="podsnapshotcontent",
        short_names=("podsnapcontent",),
        scope="Cluster",
        printer_columns=(
            PrinterColumn("PodSnapshot", ".spec.snapshotRef.name", description="Bound PodSnapshot"),
            PrinterColumn("Namespace", ".spec.snapshotRef.namespace", description="PodSnapshot namespace"),
            PrinterColumn(
                "Ready", ".status.conditions[?(@.type=='Ready')].status", description="Ready condition"
            ),
            PrinterColumn("Size", ".status.artifact.sizeBytes", type="integer", description="Artifact bytes"),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )

    api_version: Literal["nvidia.com/v1alpha1"] = "nvidia.com/v1alpha1"
    kind: Literal["PodSnapshotContent"] = "PodSnapshotContent"
    spec: PodSnapshotContentSpec
    status: PodSnapshotContentStatus | None = None


_Facts = TypeVar("_Facts", PodSnapshotArtifact, PodSnapshotCompatibility)


def _content_facts(
    content: Mapping[str, Any], field: str, annotation: str, model: type[_Facts]
) -> _Facts | None:
    """``status.<field>`` of a content where the status holds it, else the JSON of ``annotation``; None
    where neither does. One that is not such an object raises ValueError naming it."""
    found = (content.get("status") or {}).get(field)
    text = ((content.get("metadata") or {}).get("annotations") or {}).get(annotation)
    try:
        if found:
            return model.model_validate(found)
        return model.model_validate_json(text) if text else None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the value"
        source = f"status.{field}" if found else f"annotation {annotation}"
        raise ValueError(f"{source} is not readable: {where}: {first['msg']}") from None


def content_artifact(content: Mapping[str, Any]) -> PodSnapshotArtifact | None:
    """Where a content's artifact is and its digest: ``status.artifact``, else the annotation
    ``snapshot.nvidia.com/artifact`` (kept where another operator's CRD prunes that status field)."""
    return _content_facts(content, "artifact", ANNOTATION_CONTENT_ARTIFACT, PodSnapshotArtifact)


def content_compatibility(content: Mapping[str, Any]) -> PodSnapshotCompatibility | None:
    """What restoring a content's artifact needs: ``status.compatibility``, else the annotation
    ``snapshot.nvidia.com/compatibility``."""
    return _content_facts(
        content, "compatibility", ANNOTATION_CONTENT_COMPATIBILITY, PodSnapshotCompatibility
    )
