"""The generic snapshot API's CRDs on a real kube-apiserver: NVIDIA Snapshot's objects apply unchanged and
come back whole, the apiserver fills in upstream's defaults, and bad input — two containers, a target
container the pod does not have, a changed spec, a name too long for a label — is refused by the apiserver
itself with the reason in its message."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_snapshot.api.podsnapshot import SPEC_IMMUTABLE_MESSAGE
from dynamo_snapshot.api.snapshotjob import SNAPSHOT_JOB_NAME_MESSAGE, TARGET_CONTAINERS_MESSAGE
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.api.helpers import MODELS, lost
from tests.api.test_snapshot_api import UPSTREAM_FILES, upstream
from tests.integration.apply import refused, refused_by_both, server_dry_run

pytestmark = pytest.mark.cluster

CLUSTER_SCOPED = {"PodSnapshotContent"}


def _get(cluster: LocalCluster, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    plural = MODELS[manifest["kind"]].resource.plural
    scope = [] if manifest["kind"] in CLUSTER_SCOPED else ["-n", namespace]
    got = cluster.kubectl("get", *scope, f"{plural}.nvidia.com", manifest["metadata"]["name"], "-o", "json")
    stored: dict[str, Any] = json.loads(got.stdout)
    return stored


@pytest.mark.parametrize("path", UPSTREAM_FILES, ids=[p.stem for p in UPSTREAM_FILES])
def test_upstream_object_applies_unchanged_and_reads_back_whole(
    cluster: LocalCluster, crds: list[str], namespace: str, path: Path
) -> None:
    manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
    scope = [] if manifest["kind"] in CLUSTER_SCOPED else ["-n", namespace]
    # The file itself, as a user would apply it.
    cluster.kubectl("apply", *scope, "-f", str(path))
    try:
        stored = _get(cluster, namespace, manifest)
        assert lost(manifest["spec"], stored["spec"]) == []
        assert lost(manifest["metadata"].get("labels", {}), stored["metadata"].get("labels", {})) == []
        model = MODELS[manifest["kind"]].model_validate(stored)
        assert model.to_dict()["spec"] == stored["spec"]
    finally:
        if manifest["kind"] in CLUSTER_SCOPED:
            cluster.kubectl("delete", "-f", str(path), "--wait=false", check=False)


def test_the_apiserver_fills_in_upstreams_defaults(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    proc = server_dry_run(cluster, namespace, upstream("snapshotjob-minimal.yaml"), check=True)
    spec = json.loads(proc.stdout)["spec"]
    assert spec["activeDeadlineSeconds"] == 3600
    assert spec["podSnapshotTemplate"]["targetContainers"] == ["main"]
    # What the apiserver stores is what the model makes of the same manifest.
    model = MODELS["SnapshotJob"].model_validate(upstream("snapshotjob-minimal.yaml"))
    assert (
        model.spec.model_dump(mode="json", by_alias=True, exclude_none=True)["podSnapshotTemplate"]
        == (spec["podSnapshotTemplate"])
    )


def _changed(name: str, edit: dict[str, Any]) -> dict[str, Any]:
    manifest = upstream(name)
    spec = manifest["spec"]
    for path, value in edit.items():
        *parents, last = path.split(".")
        node = spec
        for key in parents:
            node = node[key]
        node[last] = value
    return manifest


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("podsnapshot.yaml", {"source.podRef.containers": ["main", "sidecar"]}, "must have at most 1 item"),
        ("podsnapshot.yaml", {"source.podRef.containers": ["Main_1"]}, "should match"),
        ("podsnapshot.yaml", {"source.podRef.name": ""}, "should be at least 1 chars long"),
        ("snapshotjob.yaml", {"activeDeadlineSeconds": 0}, "should be greater than or equal to 1"),
        ("snapshotjob.yaml", {"podSnapshotTemplate.targetContainers": ["engine"]}, TARGET_CONTAINERS_MESSAGE),
    ],
)
def test_bad_input_is_refused_by_model_and_apiserver(
    cluster: LocalCluster, crds: list[str], namespace: str, name: str, edit: dict[str, Any], message: str
) -> None:
    manifest = _changed(name, edit)
    error = refused_by_both(cluster, namespace, manifest, dry_run=True)
    assert message in error


def test_a_snapshot_job_name_must_fit_a_label(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = upstream("snapshotjob-minimal.yaml")
    manifest["metadata"]["name"] = "x" * 64
    error = refused_by_both(cluster, namespace, manifest, dry_run=True)
    assert SNAPSHOT_JOB_NAME_MESSAGE in error


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("podsnapshot.yaml", {"source.podRef.name": "another-pod"}),
        ("snapshotjob.yaml", {"activeDeadlineSeconds": 60}),
    ],
)
def test_a_spec_cannot_change_once_created(
    cluster: LocalCluster, crds: list[str], namespace: str, name: str, edit: dict[str, Any]
) -> None:
    cluster.apply(upstream(name), namespace)
    changed = _changed(name, edit)
    MODELS[changed["kind"]].model_validate(changed)  # a valid object: only the change is refused
    error = refused(cluster, namespace, copy.deepcopy(changed))
    assert SPEC_IMMUTABLE_MESSAGE in error
