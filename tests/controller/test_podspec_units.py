"""Worker pod manifests: pure functions over plain dicts."""

from __future__ import annotations

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.controller.podspec import restore_pod
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
