"""DynamoGraphDeployment v1beta1: the models, and conversion to and from v1alpha1 (pure, no cluster)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from dynamo_snapshot.api.dgd_conversion import (
    V1ALPHA1,
    V1BETA1,
    ConversionError,
    convert_review,
    to_v1alpha1,
    to_v1beta1,
)
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.graphdeployment_v1beta1 import (
    DUPLICATE_COMPONENT_MESSAGE,
    JOB_WITH_REF_MESSAGE,
    ONE_EPP_MESSAGE,
    CheckpointStartupPolicy,
    ComponentType,
    DynamoGraphDeploymentV1Beta1,
)
from dynamo_snapshot.api.protocol import ANNOTATION_DGD_SPEC, ANNOTATION_DGD_STATUS
from tests.api.examples import MANIFEST_FILES

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted((Path(__file__).parent / "fixtures" / "dgd_v1beta1").glob("*.yaml"))


def _alpha_examples() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted([*(ROOT / "examples").rglob("*.yaml"), *MANIFEST_FILES]):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if isinstance(doc, dict) and doc.get("kind") == "DynamoGraphDeployment":
                found.append((f"{path.relative_to(ROOT)}#{index}", doc))
    return found


ALPHA_EXAMPLES = _alpha_examples()


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


@pytest.fixture(params=FIXTURES, ids=[p.stem for p in FIXTURES])
def beta(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _load(request.param)


def _component(dgd: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in dgd["spec"]["components"] if c["name"] == name)


def test_there_are_examples_of_both_versions() -> None:
    assert len(FIXTURES) >= 4
    assert len(ALPHA_EXAMPLES) >= 6
    for path in FIXTURES:
        assert path.read_text(encoding="utf-8").startswith("# Reproduced from ai-dynamo/dynamo examples/")


# --- models ---------------------------------------------------------------------------------------------
def test_upstream_examples_parse(beta: dict[str, Any]) -> None:
    model = DynamoGraphDeploymentV1Beta1.model_validate(beta)
    assert model.spec.components
    assert all(c.pod_template and c.type is not None for c in model.spec.components)
    assert model.to_dict() == beta


def test_the_snapshot_example_reads_its_checkpoint() -> None:
    model = DynamoGraphDeploymentV1Beta1.model_validate(
        _load(FIXTURES[-1].with_name("vllm-agg-snapshot-tp8.yaml"))
    )
    worker = next(c for c in model.spec.components or [] if c.name == "VllmDecodeWorker")
    assert worker.type is ComponentType.WORKER
    assert worker.experimental
    assert worker.experimental.checkpoint
    assert worker.experimental.checkpoint.enabled is True
    assert worker.experimental.checkpoint.startup_policy is CheckpointStartupPolicy.WAIT_FOR_CHECKPOINT


def _with_component(**fields: Any) -> dict[str, Any]:
    return {
        "apiVersion": V1BETA1,
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g"},
        "spec": {"components": [{"name": "worker", **fields}]},
    }


def _refusal(document: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        DynamoGraphDeploymentV1Beta1.model_validate(document)
    return str(caught.value)


def test_bad_startup_policy_is_refused_naming_the_choices() -> None:
    message = _refusal(
        _with_component(experimental={"checkpoint": {"enabled": True, "startupPolicy": "Later"}})
    )
    assert "startupPolicy" in message
    assert "'Immediate' or 'WaitForCheckpoint'" in message


def test_checkpoint_needs_enabled_and_refuses_job_with_ref() -> None:
    assert "enabled" in _refusal(_with_component(experimental={"checkpoint": {"startupPolicy": "Immediate"}}))
    job_and_ref = {"enabled": True, "checkpointRef": "snap", "job": {"gmsClientContainers": ["gms-saver"]}}
    assert JOB_WITH_REF_MESSAGE in _refusal(_with_component(experimental={"checkpoint": job_and_ref}))
    bad_container = {"enabled": True, "targetContainerName": "Main_1"}
    assert "targetContainerName" in _refusal(_with_component(experimental={"checkpoint": bad_container}))


def test_missing_and_bad_component_names_are_refused() -> None:
    nameless = _with_component()
    del nameless["spec"]["components"][0]["name"]
    assert "spec.components.0.name" in _refusal(nameless)
    assert "Field required" in _refusal(nameless)
    assert "component names must be 1 to 63" in _refusal(_with_component(name="bad_name"))
    assert "component names must be 1 to 63" in _refusal(_with_component(name="a" * 64))


def test_duplicate_names_and_two_epps_are_refused() -> None:
    document = _with_component()
    document["spec"]["components"].append({"name": "Worker"})
    message = _refusal(document)
    assert DUPLICATE_COMPONENT_MESSAGE in message
    assert "'worker' and 'Worker'" in message
    document = _with_component(type="epp")
    document["spec"]["components"].append({"name": "epp2", "type": "epp"})
    assert ONE_EPP_MESSAGE in _refusal(document)


def test_type_replicas_min_available_and_pod_name_length() -> None:
    assert "'frontend', 'worker', 'prefill', 'decode', 'planner' or 'epp'" in _refusal(
        _with_component(type="main")
    )
    assert "greater than or equal to 0" in _refusal(_with_component(replicas=-1))
    assert "minAvailable must be less than" in _refusal(_with_component(replicas=1, minAvailable=2))
    DynamoGraphDeploymentV1Beta1.model_validate(_with_component(replicas=0, minAvailable=2))
    long_graph = _with_component(name="w" * 30)
    long_graph["metadata"]["name"] = "g" * 30
    assert "worker pods are named after both" in _refusal(long_graph)


# --- conversion: Dynamo's mapping -------------------------------------------------------------------------
def test_upstream_examples_map_to_v1alpha1_fields_without_annotations(beta: dict[str, Any]) -> None:
    alpha = to_v1alpha1(beta)
    assert alpha["apiVersion"] == V1ALPHA1
    reserved = {ANNOTATION_DGD_SPEC, ANNOTATION_DGD_STATUS} & set(alpha["metadata"].get("annotations") or {})
    assert not reserved, "Dynamo's examples need nothing kept aside"
    assert set(alpha["spec"]["services"]) == {c["name"] for c in beta["spec"]["components"]}
    assert to_v1beta1(alpha) == beta


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_upstream_examples_as_v1alpha1_pass_the_v1alpha1_model(path: Path) -> None:
    DynamoGraphDeployment.model_validate(to_v1alpha1(_load(path)))


def test_disaggregated_types_and_pod_fields_map_as_dynamo_maps_them() -> None:
    alpha = to_v1alpha1(_load(FIXTURES[0].with_name("sglang-disagg-multinode.yaml")))
    decode = alpha["spec"]["services"]["decode"]
    assert decode["componentType"] == "worker"
    assert decode["subComponentType"] == "decode"
    assert decode["envFromSecret"] == "hf-token-secret"
    assert decode["resources"] == {"limits": {"gpu": "4"}}
    assert decode["multinode"] == {"nodeCount": 2}
    assert decode["extraPodSpec"]["mainContainer"]["command"] == ["python3", "-m", "dynamo.sglang"]
    assert alpha["spec"]["envs"][1] == {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"}
    snapshot = to_v1alpha1(_load(FIXTURES[0].with_name("vllm-agg-snapshot-tp8.yaml")))
    worker = snapshot["spec"]["services"]["VllmDecodeWorker"]
    assert worker["checkpoint"] == {"enabled": True, "startupPolicy": "WaitForCheckpoint"}
    assert worker["resources"]["requests"] == {"custom": {"ephemeral-storage": "20Gi"}}


@pytest.mark.parametrize(("where", "alpha"), ALPHA_EXAMPLES, ids=[w for w, _ in ALPHA_EXAMPLES])
def test_repo_v1alpha1_examples_round_trip(where: str, alpha: dict[str, Any]) -> None:
    DynamoGraphDeployment.model_validate(alpha)
    beta = to_v1beta1(alpha)
    assert beta["apiVersion"] == V1BETA1
    assert [c["name"] for c in beta["spec"]["components"]] == sorted(alpha["spec"]["services"])
    assert to_v1alpha1(beta) == alpha
    back_to_beta = to_v1beta1(to_v1alpha1(beta))
    assert back_to_beta == beta


def test_v1alpha1_checkpoint_lands_under_experimental() -> None:
    alpha = next(doc for where, doc in ALPHA_EXAMPLES if where.endswith("vllm/dgd-auto.yaml#0"))
    beta = to_v1beta1(alpha)
    worker = next(c for c in beta["spec"]["components"] if "experimental" in c)
    service = alpha["spec"]["services"][worker["name"]]
    assert worker["experimental"]["checkpoint"] == service["checkpoint"]
    assert "checkpoint" not in worker


# --- conversion: what has no counterpart, unknown fields, edits ------------------------------------------
def _alpha_with_everything() -> dict[str, Any]:
    return {
        "apiVersion": V1ALPHA1,
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g", "namespace": "ns", "labels": {"team": "a"}, "uid": "u-1"},
        "futureTopLevel": {"x": 1},
        "spec": {
            "pvcs": [{"name": "cache", "create": False}],
            "envs": [{"name": "A", "value": "1"}],
            "topologyConstraint": {"topologyProfile": "racks", "packDomain": "rack"},
            "futureSpecField": [1, 2],
            "services": {
                "Worker": {
                    "componentType": "worker",
                    "replicas": 2,
                    "annotations": {"only": "alpha"},
                    "labels": {"tier": "gpu"},
                    "serviceName": "legacy-name",
                    "envs": [{"name": "B", "value": "2"}],
                    "extraPodSpec": {
                        "mainContainer": {"image": "img:1", "env": [{"name": "B", "value": "3"}]}
                    },
                    "sharedMemory": {"size": "16Gi"},
                    "scalingAdapter": {"enabled": False},
                    "volumeMounts": [
                        {"name": "cache", "mountPoint": "/cache", "useAsCompilationCache": True}
                    ],
                    "futureServiceField": {"deep": ["kept"]},
                    "podTemplate": {"not": "a v1alpha1 field"},
                },
                "Frontend": {"componentType": "frontend", "replicas": 1},
                "Gone": None,
            },
        },
        "status": {
            "state": "pending",
            "services": {"Worker": {"componentName": "g-worker", "replicas": 2, "restoredReplicas": 1}},
            "rollingUpdate": {"phase": "InProgress", "updatedServices": ["Frontend"]},
            "futureStatus": True,
        },
    }


def test_v1alpha1_only_and_unknown_fields_survive_a_round_trip() -> None:
    alpha = _alpha_with_everything()
    original = copy.deepcopy(alpha)
    beta = to_v1beta1(alpha)
    assert alpha == original, "conversion does not change its input"
    assert beta["futureTopLevel"] == {"x": 1}
    assert beta["spec"]["futureSpecField"] == [1, 2]
    assert beta["spec"]["env"] == [{"name": "A", "value": "1"}]
    assert beta["spec"]["topologyConstraint"] == {"clusterTopologyName": "racks", "packDomain": "rack"}
    worker = _component(beta, "Worker")
    assert worker["futureServiceField"] == {"deep": ["kept"]}
    assert worker["sharedMemorySize"] == "16Gi"
    assert worker["compilationCache"] == {"pvcName": "cache", "mountPath": "/cache"}
    assert worker["podTemplate"]["spec"]["containers"][0]["env"] == [{"name": "B", "value": "3"}]
    assert "scalingAdapter" not in worker
    assert beta["status"]["components"]["Worker"]["componentNames"] == ["g-worker"]
    assert beta["status"]["rollingUpdate"]["updatedComponents"] == ["Frontend"]
    kept = json.loads(beta["metadata"]["annotations"][ANNOTATION_DGD_SPEC])
    assert kept["pvcs"] == [{"name": "cache", "create": False}]
    assert kept["services"]["Worker"]["labels"] == {"tier": "gpu"}
    assert kept["services"]["Gone"] is None
    assert ANNOTATION_DGD_STATUS in beta["metadata"]["annotations"]
    assert to_v1alpha1(beta) == original


def _beta_with_everything() -> dict[str, Any]:
    return {
        "apiVersion": V1BETA1,
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g", "annotations": {"user": "note"}},
        "spec": {
            "backendFramework": "vllm",
            "priorityClassName": "high",
            "components": [
                {
                    "name": "zeta",
                    "type": "prefill",
                    "frontendSidecar": "fe",
                    "experimental": {
                        "grove": {"forceScalingGroup": True},
                        "gpuMemoryService": {"mode": "IntraPod"},
                    },
                    "podTemplate": {
                        "metadata": {"labels": {"a": "b"}, "finalizers": ["odd"]},
                        "spec": {
                            "containers": [
                                {"name": "fe", "image": "fe:1"},
                                {"name": "main", "image": "w:1", "env": [{"name": "X", "value": "1"}]},
                            ],
                            "nodeSelector": {"gpu": "h200"},
                        },
                    },
                    "futureComponentField": "kept",
                },
                {"name": "alpha", "type": "frontend", "scalingAdapter": {}, "sharedMemorySize": "0"},
            ],
        },
        "status": {
            "state": "successful",
            "components": {"zeta": {"componentNames": ["old", "new"], "replicas": 1}},
        },
    }


def test_v1beta1_only_and_unknown_fields_and_order_survive_a_round_trip() -> None:
    beta = _beta_with_everything()
    alpha = to_v1alpha1(beta)
    zeta = alpha["spec"]["services"]["zeta"]
    assert zeta["componentType"] == "worker"
    assert zeta["subComponentType"] == "prefill"
    assert zeta["gpuMemoryService"] == {"enabled": True, "mode": "IntraPod"}
    assert zeta["envs"] == [{"name": "X", "value": "1"}]
    assert zeta["extraPodSpec"]["nodeSelector"] == {"gpu": "h200"}
    assert zeta["futureComponentField"] == "kept"
    assert alpha["spec"]["services"]["alpha"]["scalingAdapter"] == {"enabled": True}
    assert alpha["spec"]["services"]["alpha"]["sharedMemory"] == {"disabled": True}
    assert alpha["status"]["services"]["zeta"]["componentName"] == "new"
    assert alpha["metadata"]["annotations"]["user"] == "note"
    kept = json.loads(alpha["metadata"]["annotations"][ANNOTATION_DGD_SPEC])
    assert [c["name"] for c in kept["components"]] == ["zeta", "alpha"]
    assert to_v1beta1(alpha) == beta


def test_an_edit_wins_and_fields_without_counterpart_come_back() -> None:
    beta = to_v1beta1(_alpha_with_everything())
    _component(beta, "Worker")["replicas"] = 5
    alpha = to_v1alpha1(beta)
    worker = alpha["spec"]["services"]["Worker"]
    assert worker["replicas"] == 5
    assert worker["labels"] == {"tier": "gpu"}
    assert worker["annotations"] == {"only": "alpha"}
    assert alpha["spec"]["services"]["Frontend"] == {"componentType": "frontend", "replicas": 1}
    assert alpha["spec"]["pvcs"] == [{"name": "cache", "create": False}]


def test_unreadable_reserved_annotations_are_dropped_as_dynamo_drops_them() -> None:
    beta = _load(FIXTURES[0])
    beta["metadata"]["annotations"] = {ANNOTATION_DGD_SPEC: "{not json", "keep": "me"}
    alpha = to_v1alpha1(beta)
    assert alpha["metadata"]["annotations"] == {"keep": "me"}


def test_conversion_refuses_what_it_cannot_convert() -> None:
    beta = _with_component()
    beta["spec"]["components"].append({"name": "worker"})
    with pytest.raises(ConversionError, match="two components named 'worker'"):
        to_v1alpha1(beta)
    del beta["spec"]["components"][0]["name"]
    with pytest.raises(ConversionError, match=r"spec.components\[0\] has no name"):
        to_v1alpha1(beta)
    with pytest.raises(
        ConversionError, match=re.escape("apiVersion 'nvidia.com/v1beta1' is not nvidia.com/v1alpha1")
    ):
        to_v1beta1(_with_component())
    with pytest.raises(ConversionError, match=re.escape("spec.services must be a map")):
        to_v1beta1({"apiVersion": V1ALPHA1, "kind": "DynamoGraphDeployment", "spec": {"services": []}})


# --- ConversionReview -------------------------------------------------------------------------------------
def _review(desired: str, *objects: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {"uid": "req-1", "desiredAPIVersion": desired, "objects": list(objects)},
    }


def test_convert_review_converts_every_object_both_ways() -> None:
    betas = [_load(p) for p in FIXTURES]
    answer = convert_review(_review(V1ALPHA1, *betas))
    assert answer["apiVersion"] == "apiextensions.k8s.io/v1"
    assert answer["kind"] == "ConversionReview"
    response = answer["response"]
    assert response["uid"] == "req-1"
    assert response["result"] == {"status": "Success"}
    assert [o["apiVersion"] for o in response["convertedObjects"]] == [V1ALPHA1] * len(betas)
    again = convert_review(_review(V1BETA1, *response["convertedObjects"]))["response"]
    assert again["convertedObjects"] == betas
    same = convert_review(_review(V1BETA1, betas[0]))["response"]
    assert same["convertedObjects"] == [betas[0]]


def _failure(review: Any) -> str:
    response = convert_review(review)["response"]
    assert response["result"]["status"] == "Failure"
    assert "convertedObjects" not in response
    message = response["result"]["message"]
    assert isinstance(message, str)
    return message


def test_convert_review_answers_failures_with_clear_messages() -> None:
    good = _load(FIXTURES[0])
    message = _failure(_review("nvidia.com/v2", good))
    assert "desiredAPIVersion 'nvidia.com/v2' is not served" in message
    assert V1BETA1 in message
    bad = _with_component(experimental={"checkpoint": {"enabled": True, "startupPolicy": "Soon"}})
    bad["metadata"]["namespace"] = "ns"
    message = _failure(_review(V1ALPHA1, good, bad))
    assert message.startswith("objects[1] (ns/g): spec.components.0.experimental.checkpoint.startupPolicy")
    assert "'Immediate' or 'WaitForCheckpoint'" in message
    assert "is not a DynamoGraphDeployment version" in _failure(_review(V1ALPHA1, {"apiVersion": "v1"}))
    assert "not an apiextensions.k8s.io/v1 ConversionReview" in _failure({"kind": "Nope"})
    assert "not an apiextensions.k8s.io/v1 ConversionReview" in _failure(["not", "a", "review"])
    assert "has no request" in _failure({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"})
    assert convert_review(_review("nvidia.com/v2"))["response"]["uid"] == "req-1"


def test_the_empty_response_the_apiserver_sends_beside_its_request_is_ignored() -> None:
    review = _review(V1ALPHA1, _load(FIXTURES[0])) | {"response": {"uid": "", "result": {"metadata": {}}}}
    assert convert_review(review)["response"]["result"] == {"status": "Success"}


def test_a_component_type_outside_v1beta1s_enum_is_kept_aside_and_comes_back() -> None:
    alpha: dict[str, Any] = {
        "apiVersion": V1ALPHA1,
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g"},
        "spec": {"services": {"Worker": {"componentType": "main", "replicas": 1}}},
    }
    beta = to_v1beta1(alpha)
    assert "type" not in beta["spec"]["components"][0]
    DynamoGraphDeploymentV1Beta1.model_validate(beta)  # a v1beta1 object the apiserver would take back
    assert ANNOTATION_DGD_SPEC in beta["metadata"]["annotations"]
    assert to_v1alpha1(beta) == alpha
