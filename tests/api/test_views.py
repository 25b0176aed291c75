"""Typed views read what the cluster holds: absent or null fields, and fields of a wrong type, read as
empty; nothing is copied or changed."""

from __future__ import annotations

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import (
    CheckpointView,
    NodeView,
    PodSnapshotContentView,
    PodSnapshotView,
    PodView,
    SnapshotJobView,
    still_live,
)


def test_a_bare_object_reads_as_empty() -> None:
    for raw in ({}, {"metadata": None, "spec": None, "status": None}, {"metadata": [], "status": "x"}):
        pod = PodView(raw)
        assert (pod.meta.name, pod.meta.namespace, pod.meta.uid) == ("", "", "")
        assert (dict(pod.meta.labels), dict(pod.meta.annotations)) == ({}, {})
        assert (pod.meta.deleting, pod.meta.controller, pod.meta.owner_uids) == (False, None, set())
        assert (pod.node_name, pod.pod_ip, pod.container_names) == ("", "", [])
        assert (pod.restore_from, pod.condition("Ready")) == (None, {})
        assert not pod.condition_true("Ready")


def test_a_pod() -> None:
    raw = {
        "metadata": {
            "name": "w-1",
            "namespace": "team-a",
            "uid": "u1",
            "deletionTimestamp": "2026-01-01T00:00:00Z",
            "annotations": {
                protocol.ANNOTATION_RESTORE_FROM: " ckpt",
                protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "a=b",
            },
            "ownerReferences": [
                {"kind": "ReplicaSet", "name": "rs", "uid": "o1"},
                {"kind": "DynamoGraphDeployment", "name": "g", "uid": "o2", "controller": True, "x": 1},
            ],
        },
        "spec": {"nodeName": "n1", "containers": [{"name": "main"}, {"name": "side"}]},
        "status": {"podIP": "10.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    pod = PodView(raw)
    assert pod.meta.deleting
    assert pod.restore_from == " ckpt"  # as written: the rules in api.restore_request judge it
    assert pod.container_map == "a=b"
    assert pod.meta.owner_uids == {"o1", "o2"}
    assert pod.meta.controller == {"kind": "DynamoGraphDeployment", "name": "g", "uid": "o2"}
    assert pod.container_names == ["main", "side"]
    assert (pod.node_name, pod.pod_ip, pod.condition_true("Ready")) == ("n1", "10.0.0.2", True)
    assert pod.raw is raw


def test_snapshots_contents_and_checkpoints() -> None:
    ref = {"name": "p", "uid": "pu", "containers": ["main"]}
    snap = PodSnapshotView({"spec": {"source": {"podRef": ref}}, "status": {"boundSnapshotContentName": "c"}})
    assert (snap.source.name, snap.source.uid, snap.source.containers, snap.bound_content) == (
        "p",
        "pu",
        ["main"],
        "c",
    )
    content = PodSnapshotContentView(
        {"spec": {"snapshotRef": {"name": "s", "uid": "su"}, "source": {"nodeName": "n", "podRef": ref}}}
    )
    assert (content.snapshot_ref["uid"], content.source_node, content.source.name) == ("su", "n", "p")
    ckpt = CheckpointView(
        {"spec": {"identity": {"model": "m"}}, "status": {"phase": "Ready", "artifactDigest": 3}}
    )
    assert (ckpt.phase, ckpt.artifact_digest, ckpt.pod_snapshot_name, ckpt.identity) == (
        "Ready",
        "",  # not a string: read as absent
        "",
        {"model": "m"},
    )


def test_the_main_container_is_main_else_the_first() -> None:
    two = {"spec": {"containers": [{"name": "side"}, {"name": "main"}]}}
    assert PodView(two).main_container == {"name": "main"}
    one = {
        "spec": {"containers": [{"name": "engine"}]},
        "status": {"containerStatuses": [{"name": "engine"}]},
    }
    assert PodView(one).main_container == {"name": "engine"}
    assert PodView(one).main_status == {"name": "engine"}
    assert PodView({}).main_container is None


def test_a_container_by_name_with_its_status() -> None:
    raw = {
        "spec": {
            "containers": [
                {"name": "side", "image": "busybox"},
                {
                    "name": "main",
                    "image": "nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.9",
                    "resources": {"limits": {"memory": "64Gi", "cpu": 8, "nvidia.com/gpu": "1"}},
                },
            ]
        },
        "status": {"containerStatuses": [{"name": "main", "imageID": "nvcr.io/x@sha256:ab"}]},
    }
    main = PodView(raw).container("main")
    assert main is not None
    assert (main.name, main.image, main.image_id) == (
        "main",
        "nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.9",
        "nvcr.io/x@sha256:ab",
    )
    assert (main.limit("memory"), main.limit("cpu"), main.limit("ephemeral-storage")) == ("64Gi", "8", "")
    side = PodView(raw).container("side")
    assert side is not None
    assert (side.image, side.image_id, side.limit("memory")) == ("busybox", "", "")  # no status yet
    assert PodView(raw).container("other") is None
    odd = {"spec": {"containers": [{"name": "main", "image": 3, "resources": {"limits": {"cpu": True}}}]}}
    found = PodView(odd).container("main")
    assert found is not None
    assert (found.image, found.limit("cpu")) == ("", "")


def test_conditions_and_generation() -> None:
    raw = {"metadata": {"generation": 3}, "status": {"conditions": [{"type": "Ready"}, "junk"]}}
    view = PodSnapshotView(raw)
    assert view.meta.generation == 3
    assert view.conditions == [{"type": "Ready"}]
    assert PodSnapshotView({"metadata": {"generation": True}}).meta.generation is None


def test_still_live() -> None:
    seen = {"metadata": {"uid": "a"}}
    assert still_live({"metadata": {"uid": "a"}}, seen)
    assert not still_live(None, seen)
    assert not still_live({"metadata": {"uid": "b"}}, seen)
    assert not still_live({"metadata": {"uid": "a", "deletionTimestamp": "t"}}, seen)


def test_metadata_read_for_writes_and_finalizers() -> None:
    owner = {"kind": "DynamoCheckpoint", "name": "c", "uid": "o1", "controller": True}
    raw = {
        "metadata": {
            "generateName": "w-",
            "resourceVersion": "42",
            "finalizers": ["a/b", 3],
            "ownerReferences": [owner, "junk"],
        }
    }
    meta = PodView(raw).meta
    assert (meta.generate_name, meta.resource_version, meta.finalizers) == ("w-", "42", ["a/b"])
    assert meta.owner_references == [owner]  # as written, its flags too: copied onto what it makes
    assert meta.owner_references[0] is owner
    bare = PodView({"metadata": {"resourceVersion": 42, "finalizers": None}}).meta
    assert (bare.generate_name, bare.resource_version, bare.finalizers, bare.owner_references) == (
        "",
        "",
        [],
        [],
    )


def test_a_pods_phase() -> None:
    assert PodView({"status": {"phase": "Running"}}).phase == "Running"
    assert PodView({"status": {"phase": None}}).phase == ""
    assert PodView({}).phase == ""


def test_a_snapshot_job() -> None:
    template = {"spec": {"containers": [{"name": "main"}]}}
    raw = {
        "spec": {"podTemplate": template},
        "status": {
            "sourceJobUid": "j1",
            "podSnapshotName": "s",
            "podSnapshotUid": "su",
            "startedAt": "2026-01-01T00:00:00Z",
        },
    }
    view = SnapshotJobView(raw)
    assert view.pod_template is template
    assert (view.source_job_uid, view.pod_snapshot_name, view.pod_snapshot_uid, view.started_at) == (
        "j1",
        "s",
        "su",
        "2026-01-01T00:00:00Z",
    )
    bare = SnapshotJobView({"spec": {"podTemplate": []}, "status": {"podSnapshotUid": 7}})
    assert (bare.pod_template, bare.source_job_uid, bare.pod_snapshot_uid, bare.started_at) == (
        {},
        "",
        "",
        "",
    )


def test_a_worker_pod() -> None:
    raw = {
        "metadata": {"name": "w", "labels": {protocol.LABEL_START_MODE: protocol.StartMode.RESTORE.value}},
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "startTime": "2026-01-01T00:00:00Z",
            "initContainerStatuses": [{"name": "init"}, "junk"],
            "containerStatuses": [{"name": "main"}],
        },
    }
    pod = PodView(raw)
    assert (pod.phase, pod.reason, pod.start_time, pod.finished) == (
        "Failed",
        "Evicted",
        "2026-01-01T00:00:00Z",
        True,
    )
    assert pod.init_container_statuses == [{"name": "init"}]
    assert pod.start_mode == protocol.StartMode.RESTORE.value
    bare = PodView({"status": {"phase": None}})
    assert (bare.phase, bare.finished, bare.start_mode) == ("", False, protocol.StartMode.COLD.value)
    assert not PodView({"status": {"phase": "Running"}}).finished


def test_a_node() -> None:
    taint = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    raw = {
        "spec": {"taints": [taint, "junk"]},
        "status": {"conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready"}]},
    }
    node = NodeView(raw)
    assert node.taints == [taint]
    assert node.ready == ""  # a Ready condition without a status: not True, and not absent
    assert NodeView({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}).ready == "True"
    assert NodeView({}).ready is None
    assert NodeView({"spec": {"taints": None}}).taints == []
    assert NodeView({"spec": {"unschedulable": True}}).unschedulable
    assert not NodeView({}).unschedulable
