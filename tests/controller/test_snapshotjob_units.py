"""The Job a SnapshotJob runs: a pure function over plain dicts."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.podspec import SNAPSHOT_READINESS_PROBE, snapshot_job_source

PROBE = {"httpGet": {"path": "/health", "port": 8000}}


def _snapshot_job(containers: list[dict[str, Any]], **template_meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "SnapshotJob",
        "metadata": {"name": "warm", "namespace": "ns", "uid": "sj-uid-1"},
        "spec": {
            "activeDeadlineSeconds": 600,
            "podSnapshotTemplate": {"targetContainers": ["worker"]},
            "podTemplate": {
                "metadata": template_meta,
                "spec": {"restartPolicy": "OnFailure", "containers": containers},
            },
        },
    }


def test_the_job_runs_the_template_once_owned_and_labelled_by_the_snapshot_job() -> None:
    worker = {
        "name": "worker",
        "image": "w:1",
        "readinessProbe": PROBE,
        "livenessProbe": PROBE,
        "startupProbe": PROBE,
        "env": [{"name": "A", "value": "1"}],
    }
    sidecar = {"name": "proxy", "image": "p:1", "livenessProbe": PROBE}
    obj = _snapshot_job([worker, sidecar], labels={"team": "a"}, annotations={"note": "x"})
    before = copy.deepcopy(obj)

    job = snapshot_job_source(obj, "worker", 600)

    assert obj == before  # the SnapshotJob's own spec is not touched
    labels = {
        protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
        protocol.LABEL_SNAPSHOT_JOB: "warm",
        protocol.LABEL_SNAPSHOT_JOB_UID: "sj-uid-1",
    }
    assert job["metadata"]["name"] == "warm"
    assert job["metadata"]["namespace"] == "ns"
    assert job["metadata"]["labels"] == labels
    (owner,) = job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "SnapshotJob",
        "warm",
        "sj-uid-1",
        True,
    )
    assert (job["spec"]["backoffLimit"], job["spec"]["activeDeadlineSeconds"]) == (0, 600)
    template = job["spec"]["template"]
    assert template["metadata"]["labels"] == {"team": "a", **labels}
    assert template["metadata"]["annotations"] == {
        "note": "x",
        protocol.ANNOTATION_TARGET_CONTAINERS: "worker",
    }
    # The DynamoCheckpoint path's labels would make the node agent refuse the capture.
    assert protocol.LABEL_CHECKPOINT_SOURCE not in template["metadata"]["labels"]
    assert protocol.LABEL_CHECKPOINT_ID not in template["metadata"]["labels"]
    spec = template["spec"]
    assert spec["restartPolicy"] == "Never"
    assert {"name": protocol.CONTROL_VOLUME_NAME, "emptyDir": {}} in spec["volumes"]
    target, other = spec["containers"]
    assert target["readinessProbe"] == SNAPSHOT_READINESS_PROBE
    assert target["readinessProbe"]["exec"]["command"] == ["cat", "/snapshot-control/ready-for-snapshot"]
    assert "livenessProbe" not in target
    assert "startupProbe" not in target
    assert {"name": protocol.ENV_CONTROL_DIR, "value": "/snapshot-control"} in target["env"]
    assert {"name": "A", "value": "1"} in target["env"]
    assert [m["mountPath"] for m in target["volumeMounts"]] == ["/snapshot-control"]
    assert other == sidecar  # only the captured container is reshaped


def test_a_template_without_the_target_is_refused() -> None:
    with pytest.raises(ValueError, match="no container 'worker'"):
        snapshot_job_source(_snapshot_job([{"name": "main", "image": "w:1"}]), "worker", 60)
