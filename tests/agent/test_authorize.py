"""What authorizes the agent to checkpoint or restore a pod: objects in its namespace, not its labels."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dynamo_snapshot.agent.authorize import Refused, checkpoint_grant, restore_grant
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import compute_identity_hash

IDENTITY = {"model": "Qwen/Qwen3-0.6B", "backendFramework": "vllm"}
CKPT_UID = "0b5c3f4e-7d6a-4a59-9c1e-3f2b8e6d1a70"
JOB_UID = "6f1d2c3b-4a5e-4f60-8b7c-9d0e1f2a3b4c"
POD_UID = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
DGD_UID = "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b"
DIGEST = "ab" * 32


def _ckpt(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "ckpt", "namespace": "team-a", "uid": CKPT_UID},
        "spec": {"identity": IDENTITY},
        "status": status,
    }


def _job() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "ckpt-checkpoint",
            "namespace": "team-a",
            "uid": JOB_UID,
            "ownerReferences": [
                {"kind": "DynamoCheckpoint", "name": "ckpt", "uid": CKPT_UID, "controller": True}
            ],
        }
    }


def _source() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "ckpt-checkpoint-x1",
            "namespace": "team-a",
            "uid": POD_UID,
            "labels": {protocol.LABEL_CHECKPOINT_SOURCE: "true", protocol.LABEL_CHECKPOINT_ID: "ckpt"},
            "ownerReferences": [
                {"kind": "Job", "name": "ckpt-checkpoint", "uid": JOB_UID, "controller": True}
            ],
        }
    }


def _target(owner_uid: str | None = None) -> dict[str, Any]:
    refs = [{"kind": "DynamoGraphDeployment", "name": "g", "uid": owner_uid, "controller": True}]
    return {
        "metadata": {
            "name": "g-worker-1",
            "namespace": "team-a",
            "uid": POD_UID,
            "labels": {protocol.LABEL_RESTORE_TARGET: "true"},
            "annotations": {protocol.ANNOTATION_RESTORE_FROM: "ckpt"},
            "ownerReferences": refs if owner_uid else [],
        }
    }


def test_the_checkpoint_jobs_pod_is_granted_a_bound_checkpoint() -> None:
    grant = checkpoint_grant(_source(), _ckpt(phase="Creating"), _job())
    assert grant.identity_hash == compute_identity_hash(IDENTITY)
    assert grant.binding.namespace == "team-a"
    assert grant.binding.checkpoint_uid == CKPT_UID
    assert grant.binding.source_pod_uid == POD_UID


def _foreign_job() -> dict[str, Any]:
    job = _job()
    job["metadata"]["ownerReferences"][0]["uid"] = "ffffffff-ffff-4fff-8fff-ffffffffffff"
    return job


def _unowned_source() -> dict[str, Any]:
    pod = _source()
    pod["metadata"]["ownerReferences"] = []
    return pod


@pytest.mark.parametrize(
    ("pod", "ckpt", "job", "words"),
    [
        (_source(), None, _job(), "not found in namespace team-a"),
        (_unowned_source(), _ckpt(), None, "not run by the checkpoint Job"),
        (_source(), _ckpt(), _foreign_job(), "not run by the checkpoint Job"),
        (_source(), _ckpt(phase="Ready"), _job(), "Ready already"),
        (_source(), _ckpt(phase="Failed"), _job(), "Failed already"),
    ],
    ids=["no-checkpoint", "no-job", "another-checkpoints-job", "ready", "failed"],
)
def test_a_checkpoint_is_refused_without_a_grant(
    pod: dict[str, Any], ckpt: dict[str, Any] | None, job: dict[str, Any] | None, words: str
) -> None:
    with pytest.raises(Refused, match=words):
        checkpoint_grant(pod, ckpt, job)


def test_a_deleting_checkpoint_is_neither_taken_nor_restored() -> None:
    ckpt = _ckpt(phase="Ready", artifactDigest=DIGEST)
    ckpt["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    with pytest.raises(Refused, match="being deleted"):
        restore_grant(_target(), ckpt)
    with pytest.raises(Refused, match="being deleted"):
        checkpoint_grant(_source(), ckpt, _job())


def test_a_restore_is_granted_the_recorded_artifact_of_its_namespace() -> None:
    grant = restore_grant(_target(), _ckpt(phase="Ready", artifactDigest=DIGEST))
    assert grant.artifact_key == f"team-a/{CKPT_UID}"
    assert grant.manifest_digest == DIGEST


def _dgd_checkpoint() -> dict[str, Any]:
    ckpt = _ckpt(phase="Ready", artifactDigest=DIGEST)
    ckpt["metadata"]["ownerReferences"] = [
        {"kind": "DynamoGraphDeployment", "name": "g", "uid": DGD_UID, "controller": True}
    ]
    return ckpt


@pytest.mark.parametrize(
    ("pod", "ckpt", "words"),
    [
        (_target(), None, "not found in namespace team-a"),
        (_target(), _ckpt(phase="Creating", artifactDigest=DIGEST), "not Ready"),
        (_target(), _ckpt(phase="Ready"), "records no artifact digest"),
        (_target(), _ckpt(phase="Ready", artifactDigest="not-a-digest"), "records no artifact digest"),
        (_target(), _dgd_checkpoint(), "not one of its pods"),
        (_target("11111111-2222-4333-8444-555555555555"), _dgd_checkpoint(), "not one of its pods"),
    ],
    ids=["other-namespace", "not-ready", "no-digest", "bad-digest", "bare-pod", "another-dgds-pod"],
)
def test_a_restore_is_refused_without_a_grant(
    pod: dict[str, Any], ckpt: dict[str, Any] | None, words: str
) -> None:
    with pytest.raises(Refused, match=words):
        restore_grant(pod, ckpt)


def test_a_dgds_checkpoint_restores_into_that_dgds_pods() -> None:
    assert restore_grant(_target(DGD_UID), _dgd_checkpoint()).checkpoint_name == "ckpt"


def test_a_pod_naming_no_checkpoint_is_refused() -> None:
    pod = copy.deepcopy(_target())
    pod["metadata"]["annotations"] = {}
    with pytest.raises(Refused, match="names no DynamoCheckpoint"):
        restore_grant(pod, None)
