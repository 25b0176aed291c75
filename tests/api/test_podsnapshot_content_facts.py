"""The artifact and compatibility facts of a PodSnapshotContent, read from its status or, where another
operator's CRD pruned those fields, from the annotations the node agent writes beside them."""

from __future__ import annotations

import json

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.podsnapshot import (
    PodSnapshotArtifact,
    PodSnapshotCompatibility,
    content_artifact,
    content_compatibility,
)

DIGEST = "ef" * 32
ARTIFACT = {"location": "/store/ns/uid", "digest": DIGEST, "sizeBytes": 4096}
COMPATIBILITY = {"gpuProduct": "NVIDIA-H200", "cudaDriverMajor": "580", "gpuCount": 1, "imageId": "sha256:1"}


def _content(status: dict[str, object], annotations: dict[str, str]) -> dict[str, object]:
    return {"metadata": {"name": "podsnapshotcontent-x", "annotations": annotations}, "status": status}


def test_the_status_fields_are_read_where_present() -> None:
    stale = {
        protocol.ANNOTATION_CONTENT_ARTIFACT: json.dumps({**ARTIFACT, "sizeBytes": 1}),
        protocol.ANNOTATION_CONTENT_COMPATIBILITY: json.dumps({"gpuCount": 8}),
    }
    content = _content({"artifact": ARTIFACT, "compatibility": COMPATIBILITY}, stale)
    assert content_artifact(content) == PodSnapshotArtifact.model_validate(ARTIFACT)
    assert content_compatibility(content) == PodSnapshotCompatibility.model_validate(COMPATIBILITY)


def test_the_annotations_are_read_where_the_status_fields_were_pruned() -> None:
    annotations = {
        protocol.ANNOTATION_CONTENT_ARTIFACT: json.dumps(ARTIFACT),
        protocol.ANNOTATION_CONTENT_COMPATIBILITY: json.dumps(COMPATIBILITY),
    }
    content = _content({"conditions": []}, annotations)
    artifact, compatibility = content_artifact(content), content_compatibility(content)
    assert artifact is not None
    assert artifact.to_dict() == ARTIFACT
    assert compatibility is not None
    assert compatibility.to_dict() == COMPATIBILITY


def test_a_content_with_neither_has_no_facts() -> None:
    content = _content({}, {})
    assert content_artifact(content) is None
    assert content_compatibility(content) is None


def test_an_unreadable_annotation_is_named() -> None:
    content = _content({}, {protocol.ANNOTATION_CONTENT_COMPATIBILITY: json.dumps({"gpuCount": -1})})
    with pytest.raises(
        ValueError, match=r"^annotation snapshot\.nvidia\.com/compatibility is not readable: gpuCount: "
    ):
        content_compatibility(content)
