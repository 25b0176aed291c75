"""The generic snapshot API's models (PodSnapshot, PodSnapshotContent, SnapshotJob): NVIDIA Snapshot's own
objects read and write back unchanged, the defaults are upstream's, and bad input names its field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from dynamo_snapshot.api.podsnapshot import (
    CONTENT_NAME_PREFIX,
    PodSnapshot,
    PodSnapshotContent,
    content_name,
)
from dynamo_snapshot.api.protocol import DEFAULT_TARGET_CONTAINER
from dynamo_snapshot.api.snapshotjob import (
    DEFAULT_ACTIVE_DEADLINE_SECONDS,
    SNAPSHOT_JOB_NAME_MESSAGE,
    SnapshotJob,
)
from tests.api.helpers import MODELS, lost

UPSTREAM_DIR = Path(__file__).resolve().parent / "upstream_snapshot"
UPSTREAM_FILES = sorted(UPSTREAM_DIR.glob("*.yaml"))


def upstream(name: str) -> dict[str, Any]:
    document = yaml.safe_load((UPSTREAM_DIR / name).read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


@pytest.mark.parametrize("path", UPSTREAM_FILES, ids=[p.stem for p in UPSTREAM_FILES])
def test_upstream_objects_read_and_write_back_unchanged(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
    model = MODELS[manifest["kind"]].model_validate(manifest)
    assert lost(manifest, model.to_dict()) == []


def test_snapshot_job_defaults_are_upstreams() -> None:
    job = SnapshotJob.model_validate(upstream("snapshotjob-minimal.yaml"))
    assert job.spec.active_deadline_seconds == DEFAULT_ACTIVE_DEADLINE_SECONDS == 3600
    assert job.spec.pod_snapshot_template.target_containers == [DEFAULT_TARGET_CONTAINER] == ["main"]


def test_a_content_is_named_after_its_snapshots_uid() -> None:
    snapshot = "11111111-2222-3333-4444-555555555555"
    content = PodSnapshotContent.model_validate(upstream("podsnapshotcontent.yaml"))
    assert content.metadata.name == content_name(snapshot) == CONTENT_NAME_PREFIX + snapshot
    assert content.spec.snapshot_ref.uid == snapshot
    assert content.spec.source.node_name == "gpu-node-1"


def _with(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(document)
    *parents, last = path.split(".")
    node = changed
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return changed


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("spec.source.podRef.containers", ["main", "sidecar"], "at most 1 item"),
        ("spec.source.podRef.containers", [], "at least 1 item"),
        ("spec.source.podRef.containers", ["Main_1"], "should match pattern"),
        ("spec.source.podRef.name", "", "at least 1 character"),
        ("spec.source.podRef", None, "podRef"),
    ],
)
def test_a_bad_podsnapshot_is_refused_naming_the_field(path: str, value: Any, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        PodSnapshot.model_validate(_with(upstream("podsnapshot.yaml"), path, value))


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("spec.activeDeadlineSeconds", 0, "greater than or equal to 1"),
        ("spec.podSnapshotTemplate.targetContainers", ["worker", "sidecar"], "at most 1 item"),
        ("spec.podTemplate.spec.containers", [], "at least 1 item"),
        ("spec.podTemplate", None, "podTemplate"),
        ("metadata.name", "x" * 64, SNAPSHOT_JOB_NAME_MESSAGE.split(" because")[0]),
    ],
)
def test_a_bad_snapshot_job_is_refused_naming_the_field(path: str, value: Any, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        SnapshotJob.model_validate(_with(upstream("snapshotjob.yaml"), path, value))


def test_a_content_needs_its_node() -> None:
    with pytest.raises(ValidationError, match="nodeName"):
        PodSnapshotContent.model_validate(
            _with(upstream("podsnapshotcontent.yaml"), "spec.source.nodeName", None)
        )
