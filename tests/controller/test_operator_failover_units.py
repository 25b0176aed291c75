"""The pure parts of the operator failover: which checkpoint a component's next pod restores from (and
whether it is Ready, in the pod's namespace), which annotations that next pod gets, and the shared loss
judgement with its node grace and pause brake."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.dynamo.operator_chain import Chain, checkpoint_of, next_pod_annotations
from dynamo_snapshot.controller.failover.worker_loss import Judgement, judge_loss
from dynamo_snapshot.kube import Obj, ResourceKind
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, SNAPSHOT_JOB

NS = "team-a"
CANDIDATE = {
    protocol.ANNOTATION_DYNAMO_RESTORE_CANDIDATE: protocol.TRUE,
    protocol.ANNOTATION_DYNAMO_CHECKPOINT_NAME: "snap",
}


def _snapshot(name: str, *, ready: bool, bound: bool = True, uid: str = "u-1") -> Obj:
    conditions = cond.set_condition(
        [], cond.READY, ready, "Captured" if ready else "CaptureInProgress", "", None
    )
    status: dict[str, Any] = {"conditions": conditions}
    if bound:
        status["boundSnapshotContentName"] = f"podsnapshotcontent-{uid}"
    return {"metadata": {"name": name, "namespace": NS, "uid": uid}, "status": status}


def _lookup(*objs: tuple[ResourceKind, Obj]) -> Any:
    """`get` over these objects, all of namespace NS."""
    table = {(kind.kind, obj["metadata"]["name"]): obj for kind, obj in objs}
    return lambda kind, name: table.get((kind.kind, name))


def test_restore_from_names_a_dynamocheckpoint_first_then_a_podsnapshot() -> None:
    ckpt = {"metadata": {"name": "snap"}, "status": {"phase": "Ready"}}
    get = _lookup((CHECKPOINT, ckpt), (POD_SNAPSHOT, _snapshot("snap", ready=False)))
    assert checkpoint_of(NS, {protocol.ANNOTATION_RESTORE_FROM: "snap"}, get) == ("DynamoCheckpoint snap", "")
    # As the webhook and the agent read it: a name with spaces around it is no object's name.
    found, why = checkpoint_of(NS, {protocol.ANNOTATION_RESTORE_FROM: " snap "}, get)
    assert found is None
    assert "is not an object name" in why
    get = _lookup((POD_SNAPSHOT, _snapshot("snap", ready=True)))
    assert checkpoint_of(NS, {protocol.ANNOTATION_RESTORE_FROM: "snap"}, get) == ("PodSnapshot snap", "")


@pytest.mark.parametrize(
    ("objs", "why"),
    [
        ((), "DynamoCheckpoint or PodSnapshot snap is not in namespace team-a"),
        (((POD_SNAPSHOT, _snapshot("snap", ready=False)),), "PodSnapshot snap is not Ready"),
        # Ready but not bound: Dynamo's webhook requires the bound content too.
        (((POD_SNAPSHOT, _snapshot("snap", ready=True, bound=False)),), "PodSnapshot snap is not Ready"),
        (((CHECKPOINT, {"metadata": {"name": "snap"}, "status": {"phase": "Creating"}}),), "is Creating"),
        (((CHECKPOINT, {"metadata": {"name": "snap"}}),), "DynamoCheckpoint snap is Pending"),
    ],
)
def test_no_ready_checkpoint_says_why(objs: tuple[tuple[ResourceKind, Obj], ...], why: str) -> None:
    found, reason = checkpoint_of(NS, {protocol.ANNOTATION_RESTORE_FROM: "snap"}, _lookup(*objs))
    assert found is None
    assert why in reason


def test_dynamo_restore_candidates_name_a_podsnapshot_or_the_snapshotjob_making_one() -> None:
    get = _lookup((POD_SNAPSHOT, _snapshot("snap", ready=True)))
    assert checkpoint_of(NS, CANDIDATE, get) == ("PodSnapshot snap", "")
    # The candidate names a PodSnapshot: a DynamoCheckpoint of that name is not it.
    ckpt = {"metadata": {"name": "snap"}, "status": {"phase": "Ready"}}
    assert checkpoint_of(NS, CANDIDATE, _lookup((CHECKPOINT, ckpt)))[0] is None
    by_job = {**CANDIDATE, protocol.ANNOTATION_DYNAMO_RESTORE_SOURCE_KIND: "SnapshotJob"}
    job = {"metadata": {"name": "snap"}, "status": {"podSnapshotName": "made", "podSnapshotUid": "u-9"}}
    made = _snapshot("made", ready=True, uid="u-9")
    assert checkpoint_of(NS, by_job, _lookup((SNAPSHOT_JOB, job), (POD_SNAPSHOT, made))) == (
        "PodSnapshot made",
        "",
    )
    replaced = _snapshot("made", ready=True, uid="u-other")
    found, why = checkpoint_of(NS, by_job, _lookup((SNAPSHOT_JOB, job), (POD_SNAPSHOT, replaced)))
    assert found is None
    assert "replaced by another of the same name" in why
    pending = {"metadata": {"name": "snap"}, "status": {}}
    assert checkpoint_of(NS, by_job, _lookup((SNAPSHOT_JOB, pending)))[1] == (
        "SnapshotJob snap has produced no PodSnapshot yet"
    )


@pytest.mark.parametrize(
    ("annotations", "why"),
    [
        ({}, "its pods are not restore pods"),
        (
            {
                protocol.ANNOTATION_DYNAMO_RESTORE_CANDIDATE: "false",
                protocol.ANNOTATION_DYNAMO_CHECKPOINT_NAME: "s",
            },
            "not restore pods",
        ),
        ({protocol.ANNOTATION_DYNAMO_RESTORE_CANDIDATE: protocol.TRUE}, "not restore pods"),
        (
            {**CANDIDATE, protocol.ANNOTATION_DYNAMO_RESTORE_SOURCE_KIND: "Checkpoint"},
            "is neither PodSnapshot nor SnapshotJob",
        ),
    ],
)
def test_pods_that_would_not_restore_are_not_failed_over(annotations: dict[str, str], why: str) -> None:
    get = _lookup((POD_SNAPSHOT, _snapshot("s", ready=True)), (POD_SNAPSHOT, _snapshot("snap", ready=True)))
    found, reason = checkpoint_of(NS, annotations, get)
    assert found is None
    assert why in reason


def test_the_next_pod_gets_its_creators_template_annotations_else_the_lost_pods() -> None:
    pod = {"metadata": {"name": "p", "annotations": {protocol.ANNOTATION_RESTORE_FROM: "old"}}}
    template = {"metadata": {"annotations": {protocol.ANNOTATION_RESTORE_FROM: "new"}}, "spec": {}}
    rs = {"kind": "ReplicaSet", "metadata": {"name": "rs"}, "spec": {"template": template}}
    assert next_pod_annotations(Chain(rs, {}), pod) == {protocol.ANNOTATION_RESTORE_FROM: "new"}
    # A template that drops the annotation: the next pod would cold-start, whatever the lost pod had.
    bare = {"kind": "ReplicaSet", "metadata": {"name": "rs"}, "spec": {"template": {"spec": {}}}}
    assert next_pod_annotations(Chain(bare, {}), pod) == {}
    clique = {"kind": "PodClique", "metadata": {"name": "pclq"}, "spec": {"podSpec": {}}}
    assert next_pod_annotations(Chain(clique, {}), pod) == {protocol.ANNOTATION_RESTORE_FROM: "old"}


NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _node(ready: str) -> Obj:
    return {"metadata": {"name": "n"}, "status": {"conditions": [{"type": "Ready", "status": ready}]}}


def _on(node: str = "n", **status: Any) -> Obj:
    return {"metadata": {"name": "p", "annotations": {}}, "spec": {"nodeName": node}, "status": status}


def test_a_worker_on_a_notready_node_counts_through_its_grace_and_is_kept_while_paused() -> None:
    later = NOW + timedelta(seconds=30)
    assert judge_loss(_on(), _node("False"), NOW, lambda n, now: later, False) == Judgement(grace_ends=later)
    earlier = NOW - timedelta(seconds=1)
    assert judge_loss(_on(), _node("False"), NOW, lambda n, now: earlier, True) == Judgement(kept=True)
    lost = judge_loss(_on(), _node("False"), NOW, lambda n, now: earlier, False)
    assert lost == Judgement(cause="node-not-ready")


def test_worker_causes_are_lost_at_once_whatever_the_pause() -> None:
    never = lambda n, now: NOW + timedelta(days=1)  # noqa: E731
    assert judge_loss(_on(phase="Failed"), _node("True"), NOW, never, True).cause == "pod-failed"
    looping = _on(
        containerStatuses=[{"restartCount": 0, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]
    )
    assert judge_loss(looping, _node("True"), NOW, never, True).cause == "crash-loop"
    assert judge_loss(_on(), None, NOW, never, True).cause == "node-deleted"
    assert judge_loss(_on(phase="Running"), _node("True"), NOW, never, True) == Judgement()
