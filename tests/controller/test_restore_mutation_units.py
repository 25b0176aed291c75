"""The restore webhook's decision, pure: a pod created with nvidia.com/restore-from and what the name finds
in its namespace -> JSON Patch, warnings or a denial. Patches are applied here (RFC 6902 add/replace) and
the resulting pod is checked, so a test reads what the apiserver would store."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.admission import AdmissionReview, allow, deny
from dynamo_snapshot.api.checkpoint import DynamoCheckpoint
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.controller.podspec import restore_pod
from dynamo_snapshot.controller.snapshot.restore_mutation import Found, Outcome, mutate
from tests.controller.conftest import IDENTITY, dgd_manifest

Obj = dict[str, Any]
NS = "team-a"
SNAP_UID = "11111111-2222-3333-4444-555555555555"
COMPAT = {"gpuProduct": "NVIDIA-H200", "cudaDriverMajor": "570", "gpuCount": 2, "imageId": "sha256:abc"}
EXPECTED_AFFINITY = [
    {"key": protocol.LABEL_GPU_PRODUCT, "operator": "In", "values": ["NVIDIA-H200"]},
    {"key": protocol.LABEL_CUDA_DRIVER_MAJOR, "operator": "In", "values": ["570"]},
    {"key": protocol.LABEL_GPU_COUNT, "operator": "Gt", "values": ["1"]},
]
GATE = {"conditionType": protocol.POD_CONDITION_RESTORED}


def apply_patch(obj: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 add and replace (all the webhook emits) on a copy of ``obj``."""
    out = copy.deepcopy(obj)
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        node: Any = out
        for token in parents:
            node = node[int(token)] if isinstance(node, list) else node[token]
        if isinstance(node, list):
            index = int(last)
            assert op["op"] == "replace", op
            assert index < len(node), op
            node[index] = op["value"]
        else:
            assert op["op"] == "add" or last in node, op
            node[last] = op["value"]
    return out


def pod(restore_from: str | None = "snap-a", *, containers: tuple[str, ...] = ("main",), **ann: str) -> Obj:
    annotations = dict(ann)
    if restore_from is not None:
        annotations[protocol.ANNOTATION_RESTORE_FROM] = restore_from
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "restored-", "namespace": NS, "annotations": annotations},
        "spec": {"containers": [{"name": c, "image": "worker:1"} for c in containers]},
    }


def snapshot(ready: bool = True, container: str = "main", **status: Any) -> Obj:
    status_, reason = ("True", "Captured") if ready else ("False", "Pending")
    message = "Checkpoint captured and verified" if ready else "Waiting for node agent to capture"
    conditions = [{"type": "Ready", "status": status_, "reason": reason, "message": message}]
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {"name": "snap-a", "namespace": NS, "uid": SNAP_UID},
        "spec": {"source": {"podRef": {"name": "worker-0", "containers": [container]}}},
        "status": {
            "boundSnapshotContentName": f"podsnapshotcontent-{SNAP_UID}",
            "conditions": conditions,
            **status,
        },
    }


def content(compat: Obj | None = COMPAT, uid: str = SNAP_UID) -> Obj:
    status: Obj = {"artifact": {"digest": "a" * 64}}
    if compat is not None:
        status["compatibility"] = compat
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshotContent",
        "metadata": {"name": f"podsnapshotcontent-{uid}"},
        "spec": {"snapshotRef": {"namespace": NS, "name": "snap-a", "uid": uid}},
        "status": status,
    }


def checkpoint(phase: str = "Ready", **meta: Any) -> Obj:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": "ckpt-1", "namespace": NS, "uid": "c-uid", **meta},
        "spec": {"identity": IDENTITY, "job": {"podTemplateSpec": {"spec": {"containers": []}}}},
        "status": {"phase": phase, "compatibility": {"gpuProduct": "NVIDIA-H200", "gpuCount": 1}},
    }


READY = Found(snapshot=snapshot(), content=content())


def shaped(p: Obj, found: Found = READY) -> tuple[Obj, Outcome]:
    outcome = mutate(p, NS, found)
    assert outcome.denied is None, outcome.denied
    return apply_patch(p, outcome.patch), outcome


def container(p: Obj, name: str) -> Obj:
    return next(c for c in p["spec"]["containers"] if c["name"] == name)


def env(c: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env") or []}


def required_terms(p: Obj) -> list[Obj]:
    terms: list[Obj] = p["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    return terms


def assert_standby(p: Obj, target: str) -> None:
    c = container(p, target)
    variables = env(c)
    for name in (*protocol.ENV_CONTROL_DIRS,):
        assert variables[name] == protocol.CONTROL_MOUNT_PATH
    for name in protocol.ENV_RESTORE_STANDBYS:
        assert variables[name] == "1"
    # Its own subdirectory of the volume, as the snapshot project's pod contract asks.
    assert {
        "name": protocol.CONTROL_VOLUME_NAME,
        "mountPath": protocol.CONTROL_MOUNT_PATH,
        "subPath": target,
    } in c["volumeMounts"]
    assert {"name": protocol.CONTROL_VOLUME_NAME, "emptyDir": {}} in p["spec"]["volumes"]
    assert p["metadata"]["labels"][protocol.LABEL_RESTORE_TARGET] == protocol.TRUE
    assert p["spec"]["readinessGates"].count(GATE) == 1


# --------------------------------------------------------------------------- shaped


def test_a_pod_restoring_a_ready_podsnapshot_is_shaped_for_the_agent_and_placed_where_it_fits() -> None:
    out, outcome = shaped(pod(containers=("main", "sidecar")))
    assert outcome.warnings == []
    assert outcome.targets == ("main",)
    assert_standby(out, "main")
    assert out["metadata"]["labels"][protocol.LABEL_CHECKPOINT_ID] == "snap-a"
    assert required_terms(out) == [{"matchExpressions": EXPECTED_AFFINITY}]
    # Nothing but the target changes: the sidecar is as it was; the annotations gain the target's name.
    assert container(out, "sidecar") == {"name": "sidecar", "image": "worker:1"}
    assert out["metadata"]["annotations"] == {
        **pod()["metadata"]["annotations"],
        protocol.ANNOTATION_TARGET_CONTAINERS: "main",
    }


def test_shaping_twice_changes_nothing_the_second_time() -> None:
    once, _ = shaped(pod())
    again = mutate(once, NS, READY)
    assert again.denied is None
    assert again.patch == []
    assert again.warnings == []


def test_the_controllers_own_dgd_restore_pod_gets_only_the_gate_and_no_duplicates() -> None:
    dgd_obj = dgd_manifest("g")
    dgd_obj["metadata"].update(namespace=NS, uid="dgd-uid")
    dgd = DynamoGraphDeployment.model_validate(dgd_obj)
    ckpt_obj = checkpoint()
    made = restore_pod(dgd_obj, dgd, "VllmWorker", DynamoCheckpoint.model_validate(ckpt_obj))
    outcome = mutate(made, NS, Found(checkpoint=ckpt_obj))
    assert outcome.denied is None
    assert outcome.warnings == []
    assert outcome.patch == [{"op": "add", "path": "/spec/readinessGates", "value": [GATE]}]
    out = apply_patch(made, outcome.patch)
    for term in required_terms(out):
        exprs = term["matchExpressions"]
        assert len(exprs) == len({json.dumps(e, sort_keys=True) for e in exprs})


def test_compatibility_is_anded_into_every_term_the_pod_already_has_and_its_gates_are_kept() -> None:
    p = pod()
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    pool = {"key": "pool", "operator": "In", "values": ["gpu"]}
    p["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchExpressions": [pool]}]
            }
        }
    }
    p["spec"]["readinessGates"] = [{"conditionType": "example.com/Warm"}]
    out, _ = shaped(p)
    assert required_terms(out) == [
        {"matchExpressions": [zone, *EXPECTED_AFFINITY]},
        {"matchExpressions": [pool, *EXPECTED_AFFINITY]},
    ]
    assert out["spec"]["readinessGates"] == [{"conditionType": "example.com/Warm"}, GATE]


def test_existing_labels_are_patched_key_by_key_and_kept() -> None:
    p = pod()
    p["metadata"]["labels"] = {"app": "w", protocol.LABEL_CHECKPOINT_ID: "stale"}
    outcome = mutate(p, NS, READY)
    label_ops = [op for op in outcome.patch if op["path"].startswith("/metadata/labels")]
    assert {op["path"] for op in label_ops} == {
        "/metadata/labels/nvidia.com~1snapshot-is-restore-target",
        "/metadata/labels/nvidia.com~1snapshot-checkpoint-id",
    }
    out = apply_patch(p, outcome.patch)
    assert out["metadata"]["labels"] == {
        "app": "w",
        protocol.LABEL_CHECKPOINT_ID: "snap-a",
        protocol.LABEL_RESTORE_TARGET: protocol.TRUE,
    }


def test_the_identity_container_map_restores_into_main() -> None:
    p = pod(containers=("sidecar", "main"), **{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: " main = main "})
    out, outcome = shaped(p)
    assert outcome.targets == ("main",)
    assert_standby(out, "main")
    assert container(out, "sidecar") == {"name": "sidecar", "image": "worker:1"}


def test_without_a_map_the_captured_container_is_the_target() -> None:
    found = Found(snapshot=snapshot(container="worker"), content=content())
    out, outcome = shaped(pod(containers=("worker",)), found)
    assert outcome.targets == ("worker",)
    assert_standby(out, "worker")


def test_a_ready_dynamocheckpoint_wins_and_its_compatibility_places_the_pod() -> None:
    out, outcome = shaped(pod("ckpt-1"), Found(checkpoint=checkpoint()))
    assert outcome.warnings == []
    assert outcome.targets == ("main",)
    assert out["metadata"]["labels"][protocol.LABEL_CHECKPOINT_ID] == "ckpt-1"
    assert required_terms(out) == [
        {
            "matchExpressions": [
                {"key": protocol.LABEL_GPU_PRODUCT, "operator": "In", "values": ["NVIDIA-H200"]},
                {"key": protocol.LABEL_GPU_COUNT, "operator": "Gt", "values": ["0"]},
            ]
        }
    ]


def test_a_compatibility_kept_in_the_contents_annotation_places_the_pod() -> None:
    # Another operator's PodSnapshotContent CRD prunes status.compatibility; the agent keeps it annotated.
    pruned = content(compat=None)
    pruned["metadata"]["annotations"] = {protocol.ANNOTATION_CONTENT_COMPATIBILITY: json.dumps(COMPAT)}
    out, outcome = shaped(pod(), Found(snapshot=snapshot(), content=pruned))
    assert outcome.warnings == []
    assert required_terms(out) == required_terms(shaped(pod())[0])


def test_a_content_without_compatibility_adds_no_affinity() -> None:
    out, outcome = shaped(pod(), Found(snapshot=snapshot(), content=content(compat=None)))
    assert outcome.warnings == []
    assert "affinity" not in out["spec"]
    assert_standby(out, "main")


# --------------------------------------------------------------------------- admitted with a warning


@pytest.mark.parametrize(
    ("found", "says"),
    [
        (Found(), f"no DynamoCheckpoint or PodSnapshot named 'snap-a' in namespace {NS}"),
        (Found(snapshot=snapshot(ready=False)), "PodSnapshot 'snap-a' is not Ready (Waiting for node agent"),
        (Found(snapshot=snapshot(), content=None), "PodSnapshot 'snap-a' has no PodSnapshotContent bound"),
        (Found(snapshot=snapshot(), content=content(uid="other")), "has no PodSnapshotContent bound"),
        (
            Found(snapshot={**snapshot(), "metadata": {**snapshot()["metadata"], "deletionTimestamp": "x"}}),
            "PodSnapshot 'snap-a' is being deleted",
        ),
        (Found(checkpoint=checkpoint("Creating")), "DynamoCheckpoint 'snap-a' is not Ready (phase Creating)"),
        (Found(checkpoint=checkpoint(deletionTimestamp="x")), "DynamoCheckpoint 'snap-a' is being deleted"),
        (
            Found(snapshot=snapshot(), content=content(compat={"gpuCount": -1})),
            "content: status.compatibility is not readable: gpuCount:",
        ),
    ],
    ids=[
        "missing",
        "not-ready",
        "no-content",
        "content-of-another",
        "snapshot-deleted",
        "ckpt-creating",
        "ckpt-deleted",
        "bad-compat",
    ],
)
def test_a_snapshot_that_cannot_be_restored_now_is_admitted_with_a_warning_still_on_standby(
    found: Found, says: str
) -> None:
    out, outcome = shaped(pod(), found)
    assert len(outcome.warnings) == 1, outcome.warnings
    assert says in outcome.warnings[0]
    assert f"{protocol.POD_CONDITION_RESTORED}=False" in outcome.warnings[0]
    assert_standby(out, "main")
    assert "affinity" not in out["spec"]


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("p", "found", "says"),
    [
        (pod("other-ns/snap"), READY, "there is no cross-namespace restore"),
        (pod(""), READY, "nvidia.com/restore-from is empty"),
        (pod("  "), READY, "nvidia.com/restore-from is empty"),
        (pod("Snap_A"), READY, "is not an object name (a DNS-1123 subdomain"),
        (pod("-snap"), READY, "is not an object name"),
        (pod("s" * 254), READY, "is not an object name"),
        (pod("s" * 64), READY, "is longer than 63 characters"),
        (pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main"}), READY, "is not source=destination"),
        (pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "=main"}), READY, "is not source=destination"),
        (pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main="}), READY, "is not source=destination"),
        (pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: " , "}), READY, "restore-container-map is empty"),
        (
            pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main=main,worker=engine"}),
            READY,
            "names 2 sources (main, worker)",
        ),
        (
            pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main=main,main=main"}),
            READY,
            "names destination 'main' twice",
        ),
        (
            pod(
                containers=("engine-0",),
                **{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main=engine-0,main=engine-1"},
            ),
            READY,
            "the pod has no container 'engine-1' to restore into (it has engine-0)",
        ),
        (
            pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main=Engine_0"}),
            READY,
            "destination 'Engine_0' is not a container name",
        ),
        (
            pod(containers=("engine",), **{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "worker=engine"}),
            READY,
            "the snapshot captured container 'main', not 'worker': write main=engine",
        ),
        (
            pod(containers=("engine",), **{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "worker=engine"}),
            Found(checkpoint=checkpoint()),
            "captured container 'main', not 'worker'",
        ),
        (
            pod(containers=("engine",)),
            READY,
            "the pod has no container 'main' to restore into (it has engine)",
        ),
        (
            pod(containers=("main",)),
            Found(snapshot=snapshot(container="worker"), content=content()),
            "no container 'worker' to restore into",
        ),
    ],
    ids=[
        "cross-namespace",
        "empty",
        "blank",
        "not-dns",
        "leading-dash",
        "too-long-name",
        "too-long-label",
        "map-no-equals",
        "map-no-source",
        "map-no-dest",
        "map-empty",
        "map-two-sources",
        "map-destination-twice",
        "map-missing-destination",
        "map-bad-dest",
        "map-wrong-source",
        "map-wrong-source-ckpt",
        "no-main",
        "no-captured",
    ],
)
def test_a_request_that_cannot_be_right_is_refused_with_the_reason(p: Obj, found: Found, says: str) -> None:
    outcome = mutate(p, NS, found)
    assert outcome.denied is not None
    assert says in outcome.denied, outcome.denied
    assert outcome.patch == []


def test_a_map_to_another_container_is_still_checked_when_the_snapshot_is_missing() -> None:
    assert "not a container name" in (
        mutate(pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main=A"}), NS, Found()).denied or ""
    )
    # The captured container is unknown then: the source is taken as given, with the warning; the
    # destination is still one the node agent restores into.
    out, outcome = shaped(pod(**{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "x=main"}), Found())
    assert outcome.targets == ("main",)
    assert len(outcome.warnings) == 1
    assert_standby(out, "main")
    out, outcome = shaped(
        pod(containers=("engine",), **{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "x=engine"}), Found()
    )
    assert outcome.targets == ("engine",)
    assert_standby(out, "engine")


def test_a_map_into_another_container_shapes_that_one_and_names_it_the_target() -> None:
    out, outcome = shaped(
        pod(containers=("sidecar", "engine"), **{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: "main=engine"}),
        READY,
    )
    assert outcome.targets == ("engine",)
    assert_standby(out, "engine")
    assert out["metadata"]["annotations"][protocol.ANNOTATION_TARGET_CONTAINERS] == "engine"
    sidecar = next(c for c in out["spec"]["containers"] if c["name"] == "sidecar")
    assert not any(e["name"] == protocol.ENV_RESTORE_STANDBY for e in sidecar.get("env") or [])


def test_a_map_of_several_destinations_shapes_each_and_lists_them_all() -> None:
    mapping = "main=engine-0,main=engine-1"
    out, outcome = shaped(
        pod(
            containers=("engine-0", "engine-1", "sidecar"),
            **{protocol.ANNOTATION_RESTORE_CONTAINER_MAP: mapping},
        ),
        READY,
    )
    assert outcome.targets == ("engine-0", "engine-1")
    for engine in outcome.targets:
        assert_standby(out, engine)
        container = next(c for c in out["spec"]["containers"] if c["name"] == engine)
        mounts = [m for m in container["volumeMounts"] if m["name"] == protocol.CONTROL_VOLUME_NAME]
        assert [m.get("subPath") for m in mounts] == [engine], "each destination its own sentinels"
    assert out["metadata"]["annotations"][protocol.ANNOTATION_TARGET_CONTAINERS] == "engine-0,engine-1"
    sidecar = next(c for c in out["spec"]["containers"] if c["name"] == "sidecar")
    assert not any(e["name"] == protocol.ENV_RESTORE_STANDBY for e in sidecar.get("env") or [])
    assert [v["name"] for v in out["spec"]["volumes"]].count(protocol.CONTROL_VOLUME_NAME) == 1


def test_a_pod_without_the_annotation_is_left_alone() -> None:
    assert mutate(pod(None), NS, READY) == Outcome()


# --------------------------------------------------------------------------- the review on the wire


def test_the_answer_echoes_the_uid_and_carries_the_patch_base64_encoded() -> None:
    review = AdmissionReview.model_validate(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE",
                "namespace": NS,
                "object": pod(),
                "userInfo": {"username": "alice"},
            },
        }
    )
    assert review.request is not None
    assert review.request.object == pod()
    ops = [{"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}]
    answer = review.answer(allow("u-1", ops, ["careful"]))
    assert answer == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {
            "uid": "u-1",
            "allowed": True,
            "patch": base64.b64encode(json.dumps(ops, separators=(",", ":")).encode()).decode(),
            "patchType": "JSONPatch",
            "warnings": ["careful"],
        },
    }
    assert review.answer(allow("u-2"))["response"] == {"uid": "u-2", "allowed": True}
    refused = review.answer(deny("u-3", "no"))["response"]
    assert refused == {
        "uid": "u-3",
        "allowed": False,
        "status": {"code": 403, "message": "no", "reason": "Forbidden"},
    }
