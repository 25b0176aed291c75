"""Worker pod manifests: pure functions over plain dicts."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CHECKPOINT_NAME_MAX_LENGTH, DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import (
    GRAPH_AND_SERVICE_MAX_LENGTH,
    GRAPH_NAME_MAX_LENGTH,
    DynamoGraphDeployment,
)
from dynamo_snapshot.api.snapshotjob import DEFAULT_ACTIVE_DEADLINE_SECONDS, SnapshotJob
from dynamo_snapshot.controller.podspec import (
    MAIN_CONTAINER,
    auto_checkpoint_name,
    checkpoint_job_name,
    checkpoint_snapshot_job,
    cold_start_pod,
    gpus_of_pod,
    new_pod_name,
    restore_pod,
)
from tests.controller.conftest import IDENTITY, dgd_manifest


def test_a_restore_pod_says_which_pod_it_replaces() -> None:
    obj = dgd_manifest("g")
    obj["metadata"].update(namespace="ns", uid="u-1")
    dgd = DynamoGraphDeployment.model_validate(obj)
    ckpt = DynamoCheckpoint.model_validate(
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "DynamoCheckpoint",
            "metadata": {"name": "c1", "namespace": "ns"},
            "spec": {"identity": IDENTITY, "job": {"podTemplateSpec": {"spec": {"containers": []}}}},
        }
    )
    pod = restore_pod(
        obj, dgd, "VllmWorker", ckpt, name="g-vllmworker-abcde-r", replaces="g-vllmworker-abcde"
    )
    annotations = pod["metadata"]["annotations"]
    assert annotations[protocol.ANNOTATION_REPLACES] == "g-vllmworker-abcde"
    assert annotations[protocol.ANNOTATION_RESTORE_FROM] == "c1"
    assert pod["metadata"]["labels"][protocol.LABEL_START_MODE] == protocol.StartMode.RESTORE.value
    assert (
        protocol.ANNOTATION_REPLACES
        not in restore_pod(obj, dgd, "VllmWorker", ckpt)["metadata"]["annotations"]
    )
    # The main container stands by (Dynamo 1.6 reads the first name, NVIDIA's operator sets the second)
    # and finds the control dir under both names; a cold start gets none of them.
    main = next(c for c in pod["spec"]["containers"] if c["name"] == MAIN_CONTAINER)
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert {n: env.get(n) for n in protocol.ENV_RESTORE_STANDBYS} == {
        "SNAPSHOT_RESTORE_STANDBY": "1",
        "DYN_SNAPSHOT_RESTORE_STANDBY": "1",
    }
    assert {n: env.get(n) for n in protocol.ENV_CONTROL_DIRS} == {
        n: protocol.CONTROL_MOUNT_PATH for n in protocol.ENV_CONTROL_DIRS
    }
    cold = cold_start_pod(obj, dgd, "VllmWorker")
    cold_env = {e["name"] for c in cold["spec"]["containers"] for e in c.get("env") or []}
    assert not cold_env & {*protocol.ENV_RESTORE_STANDBYS, *protocol.ENV_CONTROL_DIRS}


def _pod_resources(resources: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The main container's resources of a cold-start pod of a service with ``resources``, and its GPUs."""
    obj = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g", "namespace": "ns", "uid": "u-1"},
        "spec": {"services": {"VllmWorker": {"resources": resources}}},
    }
    pod = cold_start_pod(obj, DynamoGraphDeployment.model_validate(obj), "VllmWorker")
    [main] = [c for c in pod["spec"]["containers"] if c["name"] == MAIN_CONTAINER]
    return main.get("resources", {}), gpus_of_pod(pod)


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        # Dynamo's own shape.
        ({"limits": {"gpu": "1"}}, {"limits": {"nvidia.com/gpu": "1"}}),
        # The Kubernetes spelling Dynamo's docs use too; it used to reach the pod as no GPU at all.
        (
            {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "2", "memory": "8Gi"}},
            {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": "1"}},
        ),
        ({"limits": {"nvidia.com/gpu": 2}}, {"limits": {"nvidia.com/gpu": "2"}}),
        # GPUs as requests only: the device plugin reads limits, and Kubernetes requires them.
        (
            {"requests": {"gpu": "4", "cpu": "32", "custom": {"rdma/ib": "1"}}},
            {
                "requests": {"cpu": "32", "nvidia.com/gpu": "4", "rdma/ib": "1"},
                "limits": {"nvidia.com/gpu": "4", "rdma/ib": "1"},
            },
        ),
    ],
)
def test_the_worker_asks_for_what_the_service_says(
    resources: dict[str, Any], expected: dict[str, Any]
) -> None:
    got, gpus = _pod_resources(resources)
    assert got == expected
    assert gpus == int(expected["limits"]["nvidia.com/gpu"])


def test_a_worker_without_resources_asks_for_none() -> None:
    assert _pod_resources({}) == ({}, 0)


def test_names_at_their_limits_make_valid_untruncated_pod_job_and_checkpoint_names() -> None:
    graph = "g" * (GRAPH_AND_SERVICE_MAX_LENGTH - 16)
    service = "VllmDecodeWorker"
    DynamoGraphDeployment.model_validate({"metadata": {"name": graph}, "spec": {"services": {service: {}}}})
    pod = new_pod_name(graph, service)
    assert len(pod) == 63
    assert pod.startswith(f"{graph}-vllmdecodeworker-")

    checkpoint = "c" * CHECKPOINT_NAME_MAX_LENGTH
    assert checkpoint_job_name(checkpoint) == f"{checkpoint}-checkpoint"
    assert len(checkpoint_job_name(checkpoint)) == 63

    # The controller's own names for Auto-mode checkpoints fit the limit of every DynamoCheckpoint name.
    auto = auto_checkpoint_name("g" * GRAPH_NAME_MAX_LENGTH, "96429b2725761a09", "0f1e2d3c-aaaa-bbbb")
    assert len(auto) <= CHECKPOINT_NAME_MAX_LENGTH
    DynamoCheckpoint.model_validate(
        {"metadata": {"name": auto}, "spec": {"identity": IDENTITY, "job": {"podTemplateSpec": {}}}}
    )


def test_a_checkpoint_is_taken_by_a_snapshot_job_it_controls_running_its_template_as_given() -> None:
    template = {
        "metadata": {"labels": {"team": "a"}},
        "spec": {"containers": [{"name": "main", "image": "w:1"}, {"name": "proxy", "image": "p:1"}]},
    }
    obj = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": "c1", "namespace": "ns", "uid": "c-uid"},
        "spec": {"identity": IDENTITY, "job": {"podTemplateSpec": template}},
    }
    ckpt = DynamoCheckpoint.model_validate(obj)

    job = checkpoint_snapshot_job(obj, ckpt, "0123456789abcdef")

    SnapshotJob.model_validate(job)  # what the SnapshotJob reconcile reads
    meta = job["metadata"]
    assert (meta["name"], meta["namespace"]) == ("c1-checkpoint", "ns")
    assert meta["labels"] == {
        protocol.LABEL_MANAGED_BY: protocol.MANAGED_BY_VALUE,
        protocol.LABEL_CHECKPOINT_ID: "c1",
        protocol.LABEL_CHECKPOINT_HASH: "0123456789abcdef",
    }
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "DynamoCheckpoint",
        "c1",
        "c-uid",
        True,
    )
    assert job["spec"] == {
        "podTemplate": template,
        "activeDeadlineSeconds": DEFAULT_ACTIVE_DEADLINE_SECONDS,
        "podSnapshotTemplate": {"targetContainers": [MAIN_CONTAINER]},
    }
    assert job["spec"]["podTemplate"] is not obj["spec"]["job"]["podTemplateSpec"]
    # No label of the old checkpoint-source path: the capture goes through the PodSnapshot only.
    assert protocol.LABEL_CHECKPOINT_SOURCE not in str(job)
