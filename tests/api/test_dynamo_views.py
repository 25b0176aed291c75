"""The Dynamo layer's typed views read a DGD (as cached at v1alpha1 and as stored at v1beta1), its services
and status, and a scaling adapter as the caches hold them: absent, null or mistyped fields read as absent,
and nothing is copied or changed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dynamo_snapshot.api.dynamo_views import (
    GraphDeploymentView,
    ScalingAdapterView,
    ServiceCheckpointView,
    StoredGraphDeploymentView,
)
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.api.graphdeployment_v1beta1 import DynamoGraphDeploymentV1Beta1


def _dgd() -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g", "namespace": "team-a", "uid": "u", "generation": 4},
        "spec": {
            "backendFramework": "vllm",
            "services": {
                "Frontend": {"componentType": "frontend"},
                "decode": {
                    "componentType": "worker",
                    "subComponentType": "decode",
                    "replicas": 3,
                    "extraPodSpec": {
                        "mainContainer": {"image": "vllm:1", "args": ["serve"]},
                        "nodeSelector": {"gpu": "h100"},
                    },
                    "checkpoint": {"enabled": True, "checkpointRef": "ckpt-1"},
                },
                "prefill": {"replicas": 0, "checkpoint": {"enabled": True}},
            },
        },
        "status": {
            "state": "pending",
            "observedGeneration": 3,
            "checkpoints": {"decode": {"checkpointName": "ckpt-1", "identityHash": "abc", "ready": True}},
            "services": {"decode": {"replicas": 3, "readyReplicas": 2, "restoredReplicas": 2}},
        },
    }


def test_a_dgd_reads_as_the_model_reads_it() -> None:
    raw = _dgd()
    before = copy.deepcopy(raw)
    view = GraphDeploymentView(raw)
    model = DynamoGraphDeployment.model_validate(raw)
    assert model.spec.services is not None
    assert list(view.services) == list(model.spec.services) == ["Frontend", "decode", "prefill"]
    for name, svc in model.spec.services.items():
        seen = view.services[name]
        assert (seen.name, seen.replicas, seen.component_type) == (
            name,
            svc.replicas,
            svc.component_type or "",
        )
        cfg = svc.checkpoint
        assert seen.checkpoint.enabled == (cfg is not None and cfg.enabled)
        assert seen.checkpoint.auto == (cfg is not None and cfg.auto)
        assert seen.checkpoint.checkpoint_ref == ((cfg.checkpoint_ref if cfg else None) or "")
    decode = view.services["decode"]
    assert decode.main_container == {"image": "vllm:1", "args": ["serve"]}
    assert decode.extra_pod_spec["nodeSelector"] == {"gpu": "h100"}
    assert (decode.sub_component_type, decode.desired_replicas) == ("decode", 3)
    assert view.services["Frontend"].desired_replicas == 1  # none named: one
    assert view.services["prefill"].desired_replicas == 0
    assert (view.meta.generation, view.observed_generation, view.state) == (4, 3, "pending")
    used = view.checkpoint_status("decode")
    assert (used.checkpoint_name, used.identity_hash, used.ready) == ("ckpt-1", "abc", True)
    counts = view.replica_status("decode")
    assert (counts.replicas, counts.ready_replicas, counts.restored_replicas) == (3, 2, 2)
    assert counts.cold_started_replicas == 0
    assert raw == before  # a lens: nothing copied into it, nothing changed


def test_services_are_looked_up_by_name() -> None:
    view = GraphDeploymentView(_dgd())
    found = view.service("decode")
    assert found is not None
    assert found.raw is _dgd_service(view, "decode")
    assert view.service("missing") is None
    unknown = view.checkpoint_status("Frontend")
    assert (unknown.checkpoint_name, unknown.identity_hash, unknown.ready) == ("", "", False)
    assert view.replica_status("missing").replicas == 0


def _dgd_service(view: GraphDeploymentView, name: str) -> object:
    return view.spec["services"][name]


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"metadata": None, "spec": None, "status": None},
        {"spec": {"services": None}, "status": {"checkpoints": "x", "services": []}},
        {"spec": {"services": []}, "status": {"state": 3, "observedGeneration": True}},
    ],
)
def test_a_bare_or_mistyped_dgd_reads_as_empty(raw: dict[str, Any]) -> None:
    view = GraphDeploymentView(raw)
    assert view.services == {}
    assert view.service("decode") is None
    assert (view.state, view.observed_generation) == ("", None)
    assert not view.checkpoint_status("decode").ready
    assert view.replica_status("decode").replicas == 0


def test_a_mistyped_service_reads_as_absent_fields() -> None:
    raw = {
        "spec": {
            "services": {
                "a": None,
                "b": {
                    "replicas": True,
                    "componentType": 1,
                    "extraPodSpec": {"mainContainer": "x"},
                    "checkpoint": {"enabled": "true", "checkpointRef": 5, "identity": "x", "mode": 2},
                },
            }
        }
    }
    view = GraphDeploymentView(raw)
    a, b = view.services["a"], view.services["b"]
    assert (a.replicas, a.desired_replicas, a.component_type, a.main_container) == (None, 1, "", {})
    assert (b.replicas, b.component_type, b.main_container) == (None, "", {})
    cfg = b.checkpoint
    assert (cfg.enabled, cfg.checkpoint_ref, cfg.identity, cfg.mode, cfg.auto) == (
        False,
        "",
        {},
        "Auto",
        False,
    )


@pytest.mark.parametrize(
    ("raw", "auto"),
    [
        ({"enabled": True}, True),
        ({"enabled": True, "mode": "Auto"}, True),
        ({"enabled": True, "mode": "Manual", "checkpointRef": "c"}, False),
        ({"enabled": True, "checkpointRef": "c"}, False),
        ({"enabled": False}, False),
        ({"identity": {"model": "m"}}, False),
    ],
)
def test_auto_mode_is_the_models_rule(raw: dict[str, Any], auto: bool) -> None:
    assert ServiceCheckpointView(raw).auto is auto


def _stored() -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g", "namespace": "team-a"},
        "spec": {
            "components": [
                {"name": "Frontend", "type": "frontend"},
                {"name": "decode", "type": "worker", "replicas": 3},
                {"name": "prefill", "type": "worker", "replicas": 0},
            ]
        },
    }


def test_a_stored_dgd_reads_each_component_at_its_index_as_the_model_reads_it() -> None:
    raw = _stored()
    before = copy.deepcopy(raw)
    view = StoredGraphDeploymentView(raw)
    model = DynamoGraphDeploymentV1Beta1.model_validate(raw)
    assert model.spec.components is not None
    for index, component in enumerate(model.spec.components):
        seen = view.component(component.name)
        assert seen is not None
        assert (seen.index, seen.name, seen.replicas) == (index, component.name, component.replicas)
        assert seen.raw is raw["spec"]["components"][index]
    desired = {n: c.desired_replicas for n in ("Frontend", "decode", "prefill") if (c := view.component(n))}
    assert desired == {"Frontend": 1, "decode": 3, "prefill": 0}  # none named: one
    assert view.component("missing") is None
    assert raw == before


def test_a_mistyped_component_keeps_the_others_at_their_index_in_the_list() -> None:
    raw = {"spec": {"components": [None, "x", {"name": 5}, {"name": "decode", "replicas": "3"}]}}
    found = StoredGraphDeploymentView(raw).component("decode")
    assert found is not None
    assert (found.index, found.replicas, found.desired_replicas) == (3, None, 1)


@pytest.mark.parametrize(
    "raw", [{}, {"spec": None}, {"spec": {"components": None}}, {"spec": {"components": {}}}]
)
def test_a_stored_dgd_without_components_has_none(raw: dict[str, Any]) -> None:
    assert StoredGraphDeploymentView(raw).component("decode") is None


@pytest.mark.parametrize(
    ("spec", "read"),
    [
        ({"replicas": 2, "dgdRef": {"name": "g", "serviceName": "decode"}}, (2, "g", "decode")),
        ({"replicas": 0, "dgdRef": {"name": "g", "componentName": "decode"}}, (0, "g", "decode")),
        ({"dgdRef": {"name": "g", "serviceName": "a", "componentName": "b"}}, (0, "g", "a")),
        ({"replicas": True, "dgdRef": {"name": 1, "serviceName": None}}, (0, "", "")),
        ({"replicas": "2", "dgdRef": "g"}, (0, "", "")),
    ],
)
def test_a_scaling_adapter_reads_its_replicas_and_the_service_it_scales(
    spec: dict[str, Any], read: tuple[int, str, str]
) -> None:
    raw = {"metadata": {"name": "g-decode", "namespace": "team-a"}, "spec": spec}
    view = ScalingAdapterView(raw)
    assert (view.replicas, view.dgd_name, view.service_name) == read
    assert (view.meta.name, view.meta.namespace) == ("g-decode", "team-a")
