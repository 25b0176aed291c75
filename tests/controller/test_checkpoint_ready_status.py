"""A DynamoCheckpoint's Ready status from its PodSnapshot's content: the content's status fields, else the
annotations the node agent keeps where another operator's PodSnapshotContent CRD prunes them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.dynamo.checkpoint_reconciler import ready_status

DIGEST = "b" * 64
ARTIFACT = {"location": "/artifacts/ns/uid-1", "digest": DIGEST, "sizeBytes": 10}
COMPAT = {"gpuProduct": "NVIDIA-H200", "cudaDriverMajor": "580", "gpuCount": 1}
SNAPSHOT = {"metadata": {"name": "snap-a", "namespace": "ns", "uid": "uid-1"}}


def _content(
    status: dict[str, Any] | None = None, annotations: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "podsnapshotcontent-uid-1",
            "annotations": {
                k: json.dumps(v) if isinstance(v, dict) else v for k, v in (annotations or {}).items()
            },
        },
        "spec": {"source": {"podRef": {"name": "worker-0"}}},
        "status": status or {},
    }


def test_the_annotations_stand_in_for_a_pruned_status() -> None:
    content = _content(
        annotations={
            protocol.ANNOTATION_CONTENT_ARTIFACT: ARTIFACT,
            protocol.ANNOTATION_CONTENT_COMPATIBILITY: COMPAT,
        }
    )
    status = ready_status(SNAPSHOT, content)
    assert status["phase"] == "Ready"
    assert (status["location"], status["artifactDigest"]) == ("/artifacts/ns/uid-1", DIGEST)
    assert status["compatibility"] == COMPAT
    assert status["sourcePod"] == "worker-0"


def test_the_status_wins_over_the_annotations() -> None:
    other = dict(ARTIFACT, digest="c" * 64)
    content = _content({"artifact": ARTIFACT}, {protocol.ANNOTATION_CONTENT_ARTIFACT: other})
    assert ready_status(SNAPSHOT, content)["artifactDigest"] == DIGEST


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (
            _content(),
            f"artifact digest (status.artifact, else annotation {protocol.ANNOTATION_CONTENT_ARTIFACT}",
        ),
        (_content(annotations={protocol.ANNOTATION_CONTENT_ARTIFACT: "{not json"}), "annotation"),
        (
            _content({"compatibility": {"gpuCount": -1}, "artifact": ARTIFACT}),
            "status.compatibility is not readable",
        ),
    ],
    ids=["nothing", "garbled-annotation", "bad-compatibility"],
)
def test_a_content_without_readable_facts_fails_the_checkpoint_saying_why(
    content: dict[str, Any], says: str
) -> None:
    status = ready_status(SNAPSHOT, content)
    assert status["phase"] == "Failed"
    assert says in status["message"]
    assert "podsnapshotcontent-uid-1" in status["message"]
