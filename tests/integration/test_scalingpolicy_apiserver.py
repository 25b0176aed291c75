"""The DynamoScalingPolicy CRD on a real kube-apiserver: a valid policy applies and comes back with the
model's defaults, and each bad spec is refused by the apiserver with the reason in its message."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION
from dynamo_snapshot.api.scalingpolicy import (
    DUPLICATE_METRIC_NAMES_MESSAGE,
    MIN_EXCEEDS_MAX_MESSAGE,
    PANIC_THRESHOLD_MESSAGE,
    TARGET_PER_REPLICA_MESSAGE,
    TOLERANCE_MESSAGE,
    DynamoScalingPolicy,
)
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.api.helpers import scaling_policy
from tests.integration.apply import refused, refused_by_both

pytestmark = pytest.mark.cluster

PLURAL = DynamoScalingPolicy.resource.plural


async def _read(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    stored: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        API_GROUP, API_VERSION, namespace, PLURAL, name
    )
    return stored


async def test_valid_policy_applies_with_defaults(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str
) -> None:
    manifest = scaling_policy("decode")
    DynamoScalingPolicy.model_validate(manifest)
    cluster.apply(manifest, namespace)

    stored = await _read(api, namespace, "decode")
    model = DynamoScalingPolicy.model_validate(stored)
    # The apiserver fills in exactly the defaults the model has, nested blocks included.
    assert model.to_dict()["spec"] == stored["spec"]
    assert stored["spec"] == model.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert stored["spec"]["scaleDown"] == {"stabilizationWindowSeconds": 60, "maxStep": 1, "graceSeconds": 30}
    assert stored["spec"]["scaleUp"] == {
        "stabilizationWindowSeconds": 0,
        "maxStep": 4,
        "maxPercent": 300,
        "periodSeconds": 15,
    }
    assert stored["spec"]["metrics"][0]["targetPerReplica"] == 4

    # Status through the status subresource, including a metric without data (null).  A JSON merge
    # patch would delete a null key instead of storing it: status writers use JSON patch or update.
    status = {
        "observedGeneration": 1,
        "currentReplicas": 2,
        "desiredReplicas": 3,
        "readyReplicas": 2,
        "startingReplicas": 0,
        "lastMetrics": {"waiting": 10.0, "kv-cache": None},
        "lastDecision": {"time": "2026-01-02T03:04:05Z", "desired": 3, "reason": "waiting", "panic": False},
    }
    patch = [{"op": "add", "path": "/status", "value": status}]
    cluster.kubectl(
        "patch",
        PLURAL,
        "decode",
        "-n",
        namespace,
        "--subresource=status",
        "--type=json",
        "-p",
        json.dumps(patch),
    )
    stored = await _read(api, namespace, "decode")
    assert stored["status"]["lastMetrics"] == {"waiting": 10, "kv-cache": None}
    model = DynamoScalingPolicy.model_validate(stored)
    assert model.status is not None
    assert model.status.desired_replicas == 3

    header, *rows = cluster.kubectl("get", "dsp", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "DGD", "SERVICE", "MIN", "MAX", "DESIRED", "CURRENT", "AGE"]
    [row] = rows
    assert row.split()[:7] == ["decode", "llama", "VllmDecodeWorker", "1", "8", "3", "2"]


def test_min_above_max_is_refused(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = scaling_policy("min-max", minReplicas=5, maxReplicas=4)
    error = refused_by_both(cluster, namespace, manifest, MIN_EXCEEDS_MAX_MESSAGE)
    assert MIN_EXCEEDS_MAX_MESSAGE in error
    assert "spec.minReplicas" in error


@pytest.mark.parametrize("target", [0, 0.0, -1.5])
def test_non_positive_target_per_replica_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str, target: float
) -> None:
    manifest = scaling_policy("zero-target")
    manifest["spec"]["metrics"][1]["targetPerReplica"] = target
    error = refused_by_both(cluster, namespace, manifest, TARGET_PER_REPLICA_MESSAGE)
    assert TARGET_PER_REPLICA_MESSAGE in error
    assert "spec.metrics[1].targetPerReplica" in error


def test_duplicate_metric_names_are_refused(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = scaling_policy("duplicates")
    manifest["spec"]["metrics"][1]["name"] = "waiting"
    error = refused_by_both(cluster, namespace, manifest, DUPLICATE_METRIC_NAMES_MESSAGE)
    assert DUPLICATE_METRIC_NAMES_MESSAGE in error
    assert "spec.metrics" in error


@pytest.mark.parametrize("query", ["", "  "])
def test_empty_query_is_refused(cluster: LocalCluster, crds: list[str], namespace: str, query: str) -> None:
    manifest = scaling_policy("empty-query")
    manifest["spec"]["metrics"][0]["query"] = query
    error = refused_by_both(cluster, namespace, manifest, "query")
    assert "spec.metrics[0].query" in error
    assert ("at least 1 chars long" if not query else "should match") in error


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({"tolerance": 1}, "spec.tolerance", TOLERANCE_MESSAGE),
        ({"panic": {"threshold": 1}}, "spec.panic.threshold", PANIC_THRESHOLD_MESSAGE),
        ({"maxReplicas": 0}, "spec.maxReplicas", "greater than or equal to 1"),
        (
            {"evaluationIntervalSeconds": 0.1},
            "spec.evaluationIntervalSeconds",
            "greater than or equal to 0.5",
        ),
        ({"metrics": []}, "spec.metrics", "should have at least 1 items"),
        # A scale-up is never unlimited: maxStep 0 is refused, not read as "no limit".
        ({"scaleUp": {"maxStep": 0}}, "spec.scaleUp.maxStep", "greater than or equal to 1"),
        ({"scaleUp": {"periodSeconds": 0}}, "spec.scaleUp.periodSeconds", "greater than or equal to 1"),
    ],
)
def test_other_bad_specs_are_refused(
    cluster: LocalCluster, crds: list[str], namespace: str, spec: dict[str, Any], field: str, reason: str
) -> None:
    manifest = scaling_policy("bad", **spec)
    error = refused_by_both(cluster, namespace, manifest)
    assert field in error
    assert reason in error


def test_unknown_field_is_refused_by_kubectl(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = scaling_policy("typo")
    manifest["spec"]["maxReplica"] = 3
    error = refused(cluster, namespace, copy.deepcopy(manifest))
    assert "maxReplica" in error
