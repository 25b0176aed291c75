"""The layers' watch tables: which events wake which reconciler, for which keys. Pure logic over caches."""

from __future__ import annotations

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.config import ControllerConfig, InstallMode
from dynamo_snapshot.controller.dynamo import watches as dynamo_layer
from dynamo_snapshot.controller.manager import RECONCILERS, WATCHES
from dynamo_snapshot.controller.snapshot import watches as snapshot_layer
from dynamo_snapshot.kube import DELETED, Obj
from dynamo_snapshot.kube.kinds import CHECKPOINT, DGD, POD_SNAPSHOT, SNAPSHOT_JOB
from tests.helpers.controller_context import bare_context

ADDED, MODIFIED = "ADDED", "MODIFIED"


class _Cache:
    def __init__(self, objs: list[Obj]) -> None:
        self.objs = {f"{o['metadata'].get('namespace', '')}/{o['metadata']['name']}": o for o in objs}

    def get(self, key: str) -> Obj | None:
        return self.objs.get(key)


def _controlled_by(kind: str, name: str = "sj") -> list[Obj]:
    return [{"kind": kind, "name": name, "uid": "u", "controller": True}]


def test_every_reconciled_kind_is_woken_and_every_watch_wakes_a_reconciled_kind() -> None:
    kinds = {r.kind for r in RECONCILERS}
    assert kinds == {DGD.kind, CHECKPOINT.kind, POD_SNAPSHOT.kind, SNAPSHOT_JOB.kind}
    assert {w.kind for w in WATCHES} == kinds
    standalone, beside = ControllerConfig(), ControllerConfig(mode=InstallMode.DYNAMO_OPERATOR)
    assert {r.kind for r in RECONCILERS if r.runs(standalone)} == kinds
    assert {r.kind for r in RECONCILERS if r.runs(beside)} == kinds - {DGD.kind}


def test_a_content_wakes_its_podsnapshot_and_the_checkpoint_controlling_that_only_in_the_namespace() -> None:
    snapshot = {
        "metadata": {
            "namespace": "ns",
            "name": "snap",
            "ownerReferences": _controlled_by(CHECKPOINT.kind, "ckpt"),
        }
    }
    content = {"metadata": {"name": "c"}, "spec": {"snapshotRef": {"namespace": "ns", "name": "snap"}}}
    ctx = bare_context(snapshots=_Cache([snapshot]), settings=ControllerConfig(namespace="ns"))
    assert snapshot_layer.snapshot_of_content(ctx, MODIFIED, content, None) == ["ns/snap"]
    assert dynamo_layer.checkpoint_of_content(ctx, MODIFIED, content, None) == ["ns/ckpt"]
    elsewhere = bare_context(snapshots=_Cache([snapshot]), settings=ControllerConfig(namespace="other"))
    assert snapshot_layer.snapshot_of_content(elsewhere, MODIFIED, content, None) == []
    assert dynamo_layer.checkpoint_of_content(elsewhere, MODIFIED, content, None) == []


def test_a_snapshot_jobs_job_and_pod_wake_it_and_a_deleted_object_wakes_no_reconcile_of_itself() -> None:
    ctx = bare_context()
    job = {
        "metadata": {"namespace": "ns", "name": "j", "ownerReferences": _controlled_by("SnapshotJob", "sj")}
    }
    pod = {"metadata": {"namespace": "ns", "name": "p", "labels": {protocol.LABEL_SNAPSHOT_JOB: "sj"}}}
    stranger = {"metadata": {"namespace": "ns", "name": "x", "ownerReferences": _controlled_by("Job", "sj")}}
    assert snapshot_layer.snapshot_job_of_part(ctx, ADDED, job, None) == ["ns/sj"]
    assert snapshot_layer.snapshot_job_of_part(ctx, ADDED, pod, None) == ["ns/sj"]
    assert snapshot_layer.snapshot_job_of_part(ctx, ADDED, stranger, None) == []
    sj = {
        "metadata": {"namespace": "ns", "name": "sj", "ownerReferences": _controlled_by(CHECKPOINT.kind, "c")}
    }
    assert snapshot_layer.itself(ctx, MODIFIED, sj, None) == ["ns/sj"]
    assert snapshot_layer.itself(ctx, DELETED, sj, None) == []
    # The checkpoint controlling it hears of its deletion all the same.
    assert dynamo_layer.checkpoint_controlling(ctx, DELETED, sj, None) == ["ns/c"]
