"""What authorizes the agent to capture or restore: objects in the pod's namespace, not its labels."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from dynamo_snapshot.agent.authorize import (
    ContentRefused,
    Refused,
    capture_checkpoint_name,
    content_grant,
    restore_grant,
    snapshot_to_restore,
)
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.api.podsnapshot import PodSnapshotReason

IDENTITY = {"model": "Qwen/Qwen3-0.6B", "backendFramework": "vllm"}
CKPT_UID = "0b5c3f4e-7d6a-4a59-9c1e-3f2b8e6d1a70"
SNAP_UID = "6f1d2c3b-4a5e-4f60-8b7c-9d0e1f2a3b4c"
POD_UID = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
DGD_UID = "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b"
OTHER_UID = "11111111-2222-4333-8444-555555555555"
DIGEST = "ab" * 32
NODE = "gpu-1"
Obj = dict[str, Any]
NO_DIGEST = (
    "DynamoCheckpoint 'ckpt' records no artifact digest (status.artifactDigest): take the checkpoint again"
)
NOT_ITS_POD = (
    "DynamoCheckpoint 'ckpt' belongs to DynamoGraphDeployment 'g'; pod g-worker-1 is not one of its pods"
)


def _ckpt(**status: Any) -> Obj:
    return {
        "metadata": {"name": "ckpt", "namespace": "team-a", "uid": CKPT_UID},
        "spec": {"identity": IDENTITY},
        "status": {"podSnapshotName": "ckpt-checkpoint", **status},
    }


def _ready_ckpt() -> Obj:
    return _ckpt(phase="Ready", artifactDigest=DIGEST)


def _dgd_checkpoint() -> Obj:
    ckpt = _ready_ckpt()
    ckpt["metadata"]["ownerReferences"] = [
        {"kind": "DynamoGraphDeployment", "name": "g", "uid": DGD_UID, "controller": True}
    ]
    return ckpt


def _snapshot(owner_uid: str | None = CKPT_UID, ready: bool = True) -> Obj:
    refs = [
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "DynamoCheckpoint",
            "name": "ckpt",
            "uid": owner_uid,
            "controller": True,
        }
    ]
    condition = {"type": "Ready", "status": "True" if ready else "False", "reason": "Pending"}
    return {
        "metadata": {
            "name": "ckpt-checkpoint",
            "namespace": "team-a",
            "uid": SNAP_UID,
            "ownerReferences": refs if owner_uid else [],
        },
        "spec": {"source": {"podRef": {"name": "ckpt-checkpoint-x1", "containers": ["main"]}}},
        "status": {"boundSnapshotContentName": f"podsnapshotcontent-{SNAP_UID}", "conditions": [condition]},
    }


def _content(digest: str | None = DIGEST, namespace: str = "team-a", pod_uid: str = POD_UID) -> Obj:
    return {
        "metadata": {"name": f"podsnapshotcontent-{SNAP_UID}", "uid": "c0", "generation": 1},
        "spec": {
            "snapshotRef": {"namespace": namespace, "name": "ckpt-checkpoint", "uid": SNAP_UID},
            "source": {
                "nodeName": NODE,
                "podRef": {"name": "ckpt-checkpoint-x1", "uid": pod_uid, "containers": ["main"]},
            },
        },
        "status": {"artifact": {"digest": digest}} if digest else {},
    }


def _target(owner_uid: str | None = None, name: str = "ckpt", namespace: str = "team-a") -> Obj:
    refs = [{"kind": "DynamoGraphDeployment", "name": "g", "uid": owner_uid, "controller": True}]
    return {
        "metadata": {
            "name": "g-worker-1",
            "namespace": namespace,
            "uid": POD_UID,
            "labels": {protocol.LABEL_RESTORE_TARGET: "true"},
            "annotations": {protocol.ANNOTATION_RESTORE_FROM: name},
            "ownerReferences": refs if owner_uid else [],
        },
        "spec": {"containers": [{"name": "main"}]},
    }


# ------------------------------------------------------------------ restore from a DynamoCheckpoint
def test_a_checkpoints_restore_reads_the_podsnapshot_it_records() -> None:
    assert snapshot_to_restore("ckpt", _ready_ckpt()) == "ckpt-checkpoint"
    assert snapshot_to_restore("ckpt", _ckpt(podSnapshotName=None)) == ""
    assert snapshot_to_restore("snap", None) == "snap"


def test_a_restore_is_granted_the_recorded_artifact_of_its_checkpoints_podsnapshot() -> None:
    grant = restore_grant(_target(), _ready_ckpt(), _snapshot(), _content())
    assert grant.checkpoint_name == "ckpt"
    assert grant.artifact_key == f"team-a/{SNAP_UID}"
    assert grant.manifest_digest == DIGEST


def test_a_dgds_checkpoint_restores_into_that_dgds_pods() -> None:
    grant = restore_grant(_target(DGD_UID), _dgd_checkpoint(), _snapshot(), _content())
    assert grant.artifact_key == f"team-a/{SNAP_UID}"


def _deleting(obj: Obj) -> Obj:
    obj = copy.deepcopy(obj)
    obj["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return obj


@pytest.mark.parametrize(
    ("pod", "ckpt", "snapshot", "content", "message"),
    [
        (
            _target(namespace="team-b"),
            None,
            None,
            None,
            "neither a DynamoCheckpoint nor a PodSnapshot named 'ckpt' exists in namespace team-b: a pod is "
            "restored only from one of its own namespace",
        ),
        (
            _target(),
            _deleting(_ready_ckpt()),
            _snapshot(),
            _content(),
            "DynamoCheckpoint 'ckpt' is being deleted",
        ),
        (
            _target(),
            _ckpt(phase="Creating", artifactDigest=DIGEST),
            _snapshot(),
            _content(),
            "DynamoCheckpoint 'ckpt' is not Ready (phase Creating)",
        ),
        (
            _target(),
            _ckpt(phase="Ready"),
            _snapshot(),
            _content(),
            NO_DIGEST,
        ),
        (
            _target(),
            _ckpt(phase="Ready", artifactDigest="not-a-digest"),
            _snapshot(),
            _content(),
            NO_DIGEST,
        ),
        (
            _target(),
            _ckpt(phase="Ready", artifactDigest=DIGEST, podSnapshotName=None),
            None,
            None,
            "DynamoCheckpoint 'ckpt' records no PodSnapshot (status.podSnapshotName)",
        ),
        (
            _target(),
            _ready_ckpt(),
            None,
            None,
            "PodSnapshot 'ckpt-checkpoint' of DynamoCheckpoint 'ckpt' does not exist",
        ),
        (
            _target(),
            _ready_ckpt(),
            _snapshot(owner_uid=OTHER_UID),
            _content(),
            "PodSnapshot 'ckpt-checkpoint' is not controlled by DynamoCheckpoint 'ckpt'",
        ),
        (
            _target(),
            _ready_ckpt(),
            _snapshot(owner_uid=None),
            _content(),
            "PodSnapshot 'ckpt-checkpoint' is not controlled by DynamoCheckpoint 'ckpt'",
        ),
        (
            _target(),
            _ready_ckpt(),
            _snapshot(ready=False),
            _content(),
            "PodSnapshot 'ckpt-checkpoint' is not Ready (Pending)",
        ),
        (
            _target(),
            _ready_ckpt(),
            _snapshot(),
            None,
            "PodSnapshot 'ckpt-checkpoint' has no content bound to it",
        ),
        (
            _target(),
            _ready_ckpt(),
            _snapshot(),
            _content(namespace="team-b"),
            "PodSnapshot 'ckpt-checkpoint' has no content bound to it",
        ),
        (
            _target(),
            _ready_ckpt(),
            _snapshot(),
            _content("cd" * 32),
            f"artifact digest mismatch: the content of PodSnapshot 'ckpt-checkpoint' records {'cd' * 32}, "
            f"DynamoCheckpoint 'ckpt' records {DIGEST} (status.artifactDigest)",
        ),
        (
            _target(),
            _dgd_checkpoint(),
            _snapshot(),
            _content(),
            NOT_ITS_POD,
        ),
        (
            _target(OTHER_UID),
            _dgd_checkpoint(),
            _snapshot(),
            _content(),
            NOT_ITS_POD,
        ),
    ],
    ids=[
        "other-namespace",
        "deleting",
        "not-ready",
        "no-digest",
        "bad-digest",
        "no-podsnapshot-recorded",
        "podsnapshot-missing",
        "podsnapshot-of-another-checkpoint",
        "podsnapshot-of-no-checkpoint",
        "podsnapshot-not-ready",
        "no-content",
        "content-of-another-namespace",
        "digest-mismatch",
        "bare-pod-for-a-dgds-checkpoint",
        "another-dgds-pod",
    ],
)
def test_a_restore_from_a_checkpoint_is_refused_without_a_grant(
    pod: Obj, ckpt: Obj | None, snapshot: Obj | None, content: Obj | None, message: str
) -> None:
    with pytest.raises(Refused) as e:
        restore_grant(pod, ckpt, snapshot, content)
    assert str(e.value) == message


def test_a_pod_naming_nothing_is_refused() -> None:
    pod = _target()
    pod["metadata"]["annotations"] = {}
    with pytest.raises(Refused, match="names nothing to restore from"):
        restore_grant(pod, None, None, None)


# ------------------------------------------------------------------ restore from a PodSnapshot
def test_a_podsnapshot_named_directly_is_granted_its_contents_artifact() -> None:
    snapshot = _snapshot(owner_uid=None)
    grant = restore_grant(_target(name="ckpt-checkpoint"), None, snapshot, _content())
    assert (grant.checkpoint_name, grant.artifact_key, grant.manifest_digest) == (
        "ckpt-checkpoint",
        f"team-a/{SNAP_UID}",
        DIGEST,
    )


@pytest.mark.parametrize(
    ("snapshot", "content", "words"),
    [
        (_snapshot(owner_uid=None, ready=False), _content(), "is not Ready"),
        (_deleting(_snapshot(owner_uid=None)), _content(), "is being deleted"),
        (_snapshot(owner_uid=None), _content(digest=None), "records no artifact digest"),
    ],
    ids=["not-ready", "deleting", "no-digest"],
)
def test_a_podsnapshot_named_directly_is_refused_without_a_grant(
    snapshot: Obj, content: Obj, words: str
) -> None:
    with pytest.raises(Refused, match=words):
        restore_grant(_target(name="ckpt-checkpoint"), None, snapshot, content)


def test_a_checkpoints_podsnapshot_named_directly_is_held_to_the_checkpoints_rules() -> None:
    """Naming a DynamoCheckpoint's PodSnapshot instead of the checkpoint is no way around the checkpoint:
    a graph's checkpoint still goes only into that graph's pods, and only while the checkpoint is Ready."""
    direct = "ckpt-checkpoint"
    grant = restore_grant(_target(DGD_UID, name=direct), None, _snapshot(), _content(), _dgd_checkpoint())
    assert (grant.artifact_key, grant.manifest_digest) == (f"team-a/{SNAP_UID}", DIGEST)
    with pytest.raises(Refused) as refused:
        restore_grant(_target(OTHER_UID, name=direct), None, _snapshot(), _content(), _dgd_checkpoint())
    assert str(refused.value) == NOT_ITS_POD
    with pytest.raises(Refused, match="is not Ready"):
        restore_grant(_target(name=direct), None, _snapshot(), _content(), _ckpt(phase="Creating"))
    with pytest.raises(Refused, match="belongs to DynamoCheckpoint 'ckpt', which no longer exists"):
        restore_grant(_target(name=direct), None, _snapshot(), _content(), None)
    replaced = _ready_ckpt()
    replaced["metadata"]["uid"] = OTHER_UID
    with pytest.raises(Refused, match="which no longer exists"):
        restore_grant(_target(name=direct), None, _snapshot(), _content(), replaced)


def _into(containers: list[str], **annotations: str) -> Obj:
    pod = _target(name="ckpt-checkpoint")
    pod["metadata"]["annotations"].update(annotations)
    pod["spec"]["containers"] = [{"name": c} for c in containers]
    return pod


MAP, TARGETS = protocol.ANNOTATION_RESTORE_CONTAINER_MAP, protocol.ANNOTATION_TARGET_CONTAINERS


def test_the_captured_container_goes_into_the_one_the_map_or_its_name_says() -> None:
    snapshot, content = _snapshot(owner_uid=None), _content()
    for pod in (
        _into(["sidecar", "engine"], **{MAP: "main=engine"}),
        _into(["engine"], **{MAP: " main = engine "}),
        # Without a map: the container of the captured name, once the pod names it its target (the
        # webhook writes snapshot-target-containers).
        _into(["sidecar", "main"], **{TARGETS: "main"}),
        _into(["main", "sidecar"]),
    ):
        assert restore_grant(pod, None, snapshot, content).artifact_key == f"team-a/{SNAP_UID}"


def test_a_fan_out_grants_every_destination_in_the_order_written() -> None:
    pod = _into(["sidecar", "engine-1", "engine-0"], **{MAP: "main=engine-0,main=engine-1"})
    grant = restore_grant(pod, None, _snapshot(owner_uid=None), _content())
    assert grant.destinations == ("engine-0", "engine-1")
    assert restore_grant(_into(["main"]), None, _snapshot(owner_uid=None), _content()).destinations == (
        "main",
    )


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        (
            _into(["main"], **{MAP: "main=engine"}),
            "the pod has no container 'engine' to restore container 'main'",
        ),
        (_into(["engine"], **{MAP: "worker=engine"}), "the snapshot captured container 'main', not 'worker'"),
        (_into(["engine"]), "the pod has no container 'main' to restore container 'main' into"),
        (_into(["main", "engine"], **{TARGETS: "engine"}), "the pod names 'engine' as its target"),
        (_into(["main", "engine"], **{MAP: "main=main,worker=engine"}), "names 2 sources"),
        (
            _into(["engine-0"], **{MAP: "main=engine-0,main=engine-1"}),
            "the pod has no container 'engine-1' to restore container 'main'",
        ),
    ],
    ids=[
        "map-to-missing",
        "map-wrong-source",
        "no-captured-name",
        "other-target",
        "two-sources",
        "fan-out-to-missing",
    ],
)
def test_a_destination_the_pod_does_not_name_or_have_is_refused(pod: Obj, says: str) -> None:
    with pytest.raises(Refused, match=re.escape(says)):
        restore_grant(pod, None, _snapshot(owner_uid=None), _content())


# ------------------------------------------------------------------ capture
def _source_pod() -> Obj:
    return {
        "metadata": {"name": "ckpt-checkpoint-x1", "namespace": "team-a", "uid": POD_UID},
        "spec": {"nodeName": NODE, "containers": [{"name": "main"}]},
    }


def _pending_snapshot(owner_uid: str | None = CKPT_UID) -> Obj:
    snapshot = _snapshot(owner_uid, ready=False)
    snapshot["status"] = {}
    return snapshot


def test_a_checkpoints_podsnapshot_is_captured_with_the_checkpoints_identity() -> None:
    snapshot = _pending_snapshot()
    assert capture_checkpoint_name(snapshot) == "ckpt"
    grant = content_grant(_content(digest=None), snapshot, _source_pod(), NODE, _ckpt(phase="Creating"))
    assert grant.identity is not None
    assert grant.identity.compute_hash() == compute_identity_hash(IDENTITY)
    assert (grant.binding.namespace, grant.binding.checkpoint_name, grant.binding.checkpoint_uid) == (
        "team-a",
        "ckpt-checkpoint",
        SNAP_UID,
    )
    assert grant.binding.key == f"team-a/{SNAP_UID}"
    assert grant.binding.source_pod_uid == POD_UID


def test_a_podsnapshot_of_no_checkpoint_is_captured_without_an_identity() -> None:
    snapshot = _pending_snapshot(owner_uid=None)
    assert capture_checkpoint_name(snapshot) is None
    grant = content_grant(_content(digest=None), snapshot, _source_pod(), NODE)
    assert grant.identity is None
    assert grant.binding.key == f"team-a/{SNAP_UID}"


def test_an_owner_of_another_group_is_no_checkpoint() -> None:
    snapshot = _pending_snapshot()
    snapshot["metadata"]["ownerReferences"][0]["apiVersion"] = "example.com/v1"
    assert capture_checkpoint_name(snapshot) is None


def _bad_identity() -> Obj:
    ckpt = _ckpt(phase="Creating")
    ckpt["spec"]["identity"] = {"backendFramework": "vllm"}
    return ckpt


def _replaced() -> Obj:
    ckpt = _ckpt(phase="Creating")
    ckpt["metadata"]["uid"] = OTHER_UID
    return ckpt


def test_any_one_container_of_the_source_pod_is_captured_but_only_one_it_has() -> None:
    content = _content(digest=None)
    pod = _source_pod()
    pod["spec"]["containers"] = [{"name": "sidecar"}, {"name": "engine"}]
    snapshot = _pending_snapshot(owner_uid=None)
    for obj in (content, snapshot):
        obj["spec"]["source"]["podRef"]["containers"] = ["engine"]
    grant = content_grant(content, snapshot, pod, NODE)
    assert grant.binding.source_pod_uid == POD_UID
    for obj in (content, snapshot):
        obj["spec"]["source"]["podRef"]["containers"] = ["main"]
    with pytest.raises(ContentRefused, match=r"has no container \['main'\]"):
        content_grant(content, snapshot, pod, NODE)


@pytest.mark.parametrize(
    ("ckpt", "reason", "message"),
    [
        (
            None,
            PodSnapshotReason.CHECKPOINT_NOT_FOUND,
            "DynamoCheckpoint team-a/ckpt, which controls the PodSnapshot, does not exist",
        ),
        (
            _replaced(),
            PodSnapshotReason.CHECKPOINT_NOT_FOUND,
            "DynamoCheckpoint team-a/ckpt is not the one that controls the PodSnapshot (its UID differs)",
        ),
        (
            _deleting(_ckpt(phase="Creating")),
            PodSnapshotReason.CHECKPOINT_DELETED,
            "DynamoCheckpoint team-a/ckpt is being deleted",
        ),
        (
            _bad_identity(),
            PodSnapshotReason.INVALID_IDENTITY,
            "DynamoCheckpoint team-a/ckpt has an invalid identity: Field required",
        ),
    ],
    ids=["missing", "another-uid", "deleting", "invalid-identity"],
)
def test_a_checkpoints_podsnapshot_is_not_captured_without_its_checkpoint(
    ckpt: Obj | None, reason: str, message: str
) -> None:
    with pytest.raises(ContentRefused) as e:
        content_grant(_content(digest=None), _pending_snapshot(), _source_pod(), NODE, ckpt)
    assert (e.value.reason, str(e.value)) == (reason, message)
