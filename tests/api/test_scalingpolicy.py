"""DynamoScalingPolicy: defaults, the rules pydantic enforces, and the CRD generated from it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_snapshot.api.crdgen import build_crd
from dynamo_snapshot.api.kube import ConditionStatus
from dynamo_snapshot.api.resources import CUSTOM_RESOURCES
from dynamo_snapshot.api.scalingpolicy import (
    DUPLICATE_METRIC_NAMES_MESSAGE,
    MIN_EXCEEDS_MAX_MESSAGE,
    PANIC_THRESHOLD_MESSAGE,
    TARGET_PER_REPLICA_MESSAGE,
    TOLERANCE_MESSAGE,
    DynamoScalingPolicy,
    ScalingConditionType,
)
from tests.api.helpers import WAITING, scaling_policy


def _crd_spec() -> dict[str, Any]:
    schema = build_crd(DynamoScalingPolicy)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec: dict[str, Any] = schema["properties"]["spec"]
    return spec


def test_defaults() -> None:
    spec = DynamoScalingPolicy.model_validate(scaling_policy()).spec
    assert spec.min_replicas == 1
    assert spec.evaluation_interval_seconds == 2
    assert spec.tolerance == 0.1
    # At most max(4, 300%) more replicas per 15 s; never unlimited.
    assert (
        spec.scale_up.stabilization_window_seconds,
        spec.scale_up.max_step,
        spec.scale_up.max_percent,
        spec.scale_up.period_seconds,
    ) == (0, 4, 300, 15)
    assert (
        spec.scale_down.stabilization_window_seconds,
        spec.scale_down.max_step,
        spec.scale_down.grace_seconds,
    ) == (60, 1, 30)
    assert (spec.panic.window_seconds, spec.panic.threshold) == (6, 2.0)
    assert spec.stale_after_seconds == 10
    assert spec.query_timeout_seconds == 2
    assert spec.prometheus_url is None
    assert spec.metrics[0].target_per_replica == 4.0


def test_crd_defaults_match_the_model() -> None:
    """The apiserver fills in the same defaults pydantic does, nested objects included."""
    crd = _crd_spec()["properties"]
    model = DynamoScalingPolicy.model_validate(scaling_policy()).spec.model_dump(by_alias=True)
    for key in ("minReplicas", "evaluationIntervalSeconds", "tolerance", "staleAfterSeconds"):
        assert crd[key]["default"] == model[key], key
    assert crd["queryTimeoutSeconds"]["default"] == model["queryTimeoutSeconds"]
    for block in ("scaleUp", "scaleDown", "panic"):
        assert crd[block]["default"] == {}
        defaults = {name: node["default"] for name, node in crd[block]["properties"].items()}
        assert defaults == model[block], block
        # Defaults are documented where users read them: the field descriptions.
        for name, node in crd[block]["properties"].items():
            assert "default" in node["description"], f"{block}.{name}"


def test_min_above_max_is_rejected() -> None:
    with pytest.raises(ValidationError, match=MIN_EXCEEDS_MAX_MESSAGE):
        DynamoScalingPolicy.model_validate(scaling_policy(minReplicas=5, maxReplicas=4))
    DynamoScalingPolicy.model_validate(scaling_policy(minReplicas=4, maxReplicas=4))
    DynamoScalingPolicy.model_validate(scaling_policy(minReplicas=0, maxReplicas=1))


@pytest.mark.parametrize("target", [0, -1, 0.0])
def test_non_positive_target_is_rejected(target: float) -> None:
    bad = scaling_policy(metrics=[{"name": "waiting", "query": WAITING, "targetPerReplica": target}])
    with pytest.raises(ValidationError, match=TARGET_PER_REPLICA_MESSAGE):
        DynamoScalingPolicy.model_validate(bad)


def test_fractional_target_is_fine() -> None:
    spec = scaling_policy(
        metrics=[{"name": "kv", "query": "avg(vllm:kv_cache_usage_perc)", "targetPerReplica": 0.7}]
    )
    assert DynamoScalingPolicy.model_validate(spec).spec.metrics[0].target_per_replica == 0.7


def test_duplicate_metric_names_are_rejected() -> None:
    metrics = [
        {"name": "waiting", "query": WAITING, "targetPerReplica": 4},
        {"name": "running", "query": "sum(vllm:num_requests_running)", "targetPerReplica": 8},
        {"name": "waiting", "query": "sum(other)", "targetPerReplica": 1},
    ]
    with pytest.raises(ValidationError, match=f"{DUPLICATE_METRIC_NAMES_MESSAGE}: waiting"):
        DynamoScalingPolicy.model_validate(scaling_policy(metrics=metrics))
    DynamoScalingPolicy.model_validate(scaling_policy(metrics=metrics[:2]))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"metrics": []}, "at least 1 item"),
        (
            {"metrics": [{"name": f"m{i}", "query": "sum(x)", "targetPerReplica": 1} for i in range(9)]},
            "at most 8 items",
        ),
        ({"metrics": [{"name": "w", "query": "", "targetPerReplica": 1}]}, "at least 1 character"),
        ({"metrics": [{"name": "w", "query": "   ", "targetPerReplica": 1}]}, "pattern"),
        ({"metrics": [{"name": "w", "query": "x" * 4097, "targetPerReplica": 1}]}, "at most 4096"),
        ({"metrics": [{"name": "w", "query": "sum(x)", "targetPerReplica": "4"}]}, "valid number"),
        ({"maxReplicas": 0}, "greater than or equal to 1"),
        ({"minReplicas": -1}, "greater than or equal to 0"),
        ({"maxReplicas": "3"}, "valid integer"),
        ({"target": {"dgdName": "Llama_3", "serviceName": "w"}}, "pattern"),
        ({"target": {"dgdName": "llama"}}, "serviceName"),
        ({"evaluationIntervalSeconds": 0.1}, "greater than or equal to 0.5"),
        ({"evaluationIntervalSeconds": 301}, "less than or equal to 300"),
        ({"tolerance": 1}, TOLERANCE_MESSAGE),
        ({"tolerance": -0.1}, "greater than or equal to 0"),
        ({"panic": {"threshold": 1}}, PANIC_THRESHOLD_MESSAGE),
        ({"scaleUp": {"maxPercent": 0}}, "greater than or equal to 1"),
        ({"scaleUp": {"maxStep": 0}}, "greater than or equal to 1"),
        ({"scaleUp": {"periodSeconds": 0.5}}, "greater than or equal to 1"),
        ({"scaleUp": {"periodSeconds": 1801}}, "less than or equal to 1800"),
        ({"prometheusUrl": "prometheus:9090"}, "pattern"),
    ],
)
def test_bad_specs_are_rejected(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        DynamoScalingPolicy.model_validate(scaling_policy(**spec))


def test_missing_required_fields() -> None:
    for key in ("target", "maxReplicas", "metrics"):
        body = scaling_policy()
        del body["spec"][key]
        with pytest.raises(ValidationError, match=key):
            DynamoScalingPolicy.model_validate(body)


def test_round_trip_with_status() -> None:
    body = scaling_policy(
        namespace="ns",
        minReplicas=0,
        tolerance=0,
        scaleUp={"stabilizationWindowSeconds": 5, "maxStep": 4, "maxPercent": 200, "periodSeconds": 30},
        scaleDown={"stabilizationWindowSeconds": 120, "maxStep": 2, "graceSeconds": 10.5},
        panic={"windowSeconds": 3, "threshold": 1.5},
        prometheusUrl="http://prometheus.monitoring:9090",
    )
    body["status"] = {
        "observedGeneration": 3,
        "currentReplicas": 2,
        "desiredReplicas": 4,
        "readyReplicas": 1,
        "startingReplicas": 1,
        "lastMetrics": {"waiting": 13.0, "kv": None},
        "lastScaleTime": "2026-01-02T03:04:05Z",
        "lastDecision": {
            "time": "2026-01-02T03:04:05Z",
            "desired": 4,
            "reason": "waiting 13 > 2x4",
            "panic": True,
        },
        "conditions": [
            {
                "type": "MetricsAvailable",
                "status": "False",
                "lastTransitionTime": "2026-01-02T03:04:05Z",
                "reason": "NoData",
                "message": "kv: no data",
            }
        ],
    }
    model = DynamoScalingPolicy.model_validate(copy.deepcopy(body))
    assert model.to_dict() == body
    assert DynamoScalingPolicy.model_validate(model.to_dict()) == model
    assert model.status is not None
    assert model.status.last_metrics == {"waiting": 13.0, "kv": None}
    assert model.status.last_decision is not None
    assert model.status.last_decision.panic is True
    [condition] = model.status.conditions or []
    assert condition.type == ScalingConditionType.METRICS_AVAILABLE
    assert condition.status is ConditionStatus.FALSE


def test_unknown_spec_keys_are_dropped_not_kept() -> None:
    """The CRD prunes (and kubectl refuses) unknown keys; a newer policy still parses."""
    body = scaling_policy(futureKnob=1)
    body["spec"]["target"]["typo"] = "x"
    assert "futureKnob" not in DynamoScalingPolicy.model_validate(body).to_dict()["spec"]
    spec = _crd_spec()
    assert "x-kubernetes-preserve-unknown-fields" not in spec
    assert "x-kubernetes-preserve-unknown-fields" not in spec["properties"]["target"]


def test_crd_names_columns_and_rules() -> None:
    assert DynamoScalingPolicy in CUSTOM_RESOURCES
    crd = build_crd(DynamoScalingPolicy)
    assert crd["metadata"]["name"] == "dynamoscalingpolicies.nvidia.com"
    assert crd["spec"]["names"]["shortNames"] == ["dsp"]
    [version] = crd["spec"]["versions"]
    columns = [(column["name"], column["jsonPath"]) for column in version["additionalPrinterColumns"]]
    assert columns == [
        ("DGD", ".spec.target.dgdName"),
        ("Service", ".spec.target.serviceName"),
        ("Min", ".spec.minReplicas"),
        ("Max", ".spec.maxReplicas"),
        ("Desired", ".status.desiredReplicas"),
        ("Current", ".status.currentReplicas"),
        ("Age", ".metadata.creationTimestamp"),
    ]
    spec = _crd_spec()
    assert spec["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"
    assert spec["x-kubernetes-validations"][0]["message"] == MIN_EXCEEDS_MAX_MESSAGE
    metrics = spec["properties"]["metrics"]
    assert (metrics["minItems"], metrics["maxItems"]) == (1, 8)
    assert metrics["x-kubernetes-validations"][0]["message"] == DUPLICATE_METRIC_NAMES_MESSAGE
    item = metrics["items"]["properties"]
    assert item["targetPerReplica"]["x-kubernetes-validations"] == [
        {"rule": "self > 0.0", "message": TARGET_PER_REPLICA_MESSAGE}
    ]
    assert (item["query"]["minLength"], item["query"]["maxLength"]) == (1, 4096)
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["lastMetrics"]["additionalProperties"] == {"type": "number", "nullable": True}
    assert status["conditions"]["x-kubernetes-list-type"] == "map"
