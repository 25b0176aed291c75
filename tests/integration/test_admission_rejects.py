"""Specs whose pods Kubernetes would refuse (the graph would wait forever) are refused at admission by
the generated CRDs, with the models' own message; what Dynamo writes is still admitted: CamelCase
service names, names at their limits, and resources in Dynamo's shape and in the Kubernetes shape its
docs use (nvidia.com/gpu: "1")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynamo_snapshot.api.checkpoint import CHECKPOINT_NAME_MESSAGE
from dynamo_snapshot.api.container import (
    ENV_VALUE_AND_VALUE_FROM_MESSAGE,
    EXTENDED_RESOURCE_MESSAGE,
    GIVEN_TWICE_MESSAGE,
    GPU_COUNT_MESSAGE,
    REQUEST_ABOVE_LIMIT_MESSAGE,
    REQUEST_NOT_LIMIT_MESSAGE,
)
from dynamo_snapshot.api.graphdeployment import (
    GRAPH_AND_SERVICE_MESSAGE,
    GRAPH_NAME_MESSAGE,
    SERVICE_NAME_LENGTH_MESSAGE,
    SERVICE_NAME_MESSAGE,
    DynamoGraphDeployment,
)
from dynamo_snapshot.api.kube import QUANTITY_MESSAGE, RESOURCE_NAME_MESSAGE
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.api.helpers import MODELS, lost
from tests.integration.apply import refused_by_both, server_dry_run

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def crds(crds: list[str], v1alpha1_served: None) -> list[str]:
    """The CRDs with v1alpha1 DGDs served too (the chart's arrangement): this module applies v1alpha1
    manifests. crds/ alone serves v1beta1 only (test_crds_as_shipped.py)."""
    return crds


def _graph(name: str = "g", services: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"services": {"worker": {"replicas": 1}} if services is None else services, **spec},
    }


def _worker(**service: Any) -> dict[str, Any]:
    return _graph(services={"worker": {"replicas": 1, **service}})


def _checkpoint(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": name},
        "spec": {
            "identity": {"model": "Qwen/Qwen3-0.6B", "backendFramework": "vllm"},
            "job": {"podTemplateSpec": {"spec": {"containers": [{"name": "main", "image": "worker:1"}]}}},
        },
    }


def _admitted(cluster: LocalCluster, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the apiserver would store for ``manifest`` (nothing is stored), checked to keep every field
    and to validate with the model again."""
    proc = server_dry_run(cluster, namespace, manifest)
    assert proc.returncode == 0, f"refused {json.dumps(manifest)}:\n{proc.stderr}"
    stored: dict[str, Any] = json.loads(proc.stdout)
    assert lost(manifest["spec"], stored["spec"]) == []
    MODELS[manifest["kind"]].model_validate(stored)
    return stored


# --- the specs the tester found admitted -----------------------------------------------------------------


def test_an_env_without_a_name_is_refused(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    error = refused_by_both(cluster, namespace, _worker(envs=[{"value": "x"}]), "needs a name", dry_run=True)
    assert "spec.services.worker.envs[0].name: Required value" in error

    graph_env = _graph(envs=[{"name": "A", "value": "1"}, {"value": "x"}])
    error = refused_by_both(cluster, namespace, graph_env, "needs a name", dry_run=True)
    assert "spec.envs[1].name: Required value" in error


def test_a_fractional_gpu_count_is_refused(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = _worker(resources={"limits": {"gpu": "0.5"}})
    error = refused_by_both(cluster, namespace, manifest, "whole number of GPUs", dry_run=True)
    assert "spec.services[worker].resources.limits.gpu" in error
    assert GPU_COUNT_MESSAGE in error


def test_a_70_character_graph_name_is_refused(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = _graph("g" * 70)
    error = refused_by_both(cluster, namespace, manifest, "at most 63 characters", dry_run=True)
    assert f"metadata: Invalid value: {GRAPH_NAME_MESSAGE}" in error
    assert f"spec.services: Invalid value: {GRAPH_AND_SERVICE_MESSAGE}" in error


def test_a_70_character_service_name_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    manifest = _graph(services={"Frontend": {}, "w" * 70: {"replicas": 1}})
    error = refused_by_both(cluster, namespace, manifest, "at most 63 characters", dry_run=True)
    assert f"spec.services: Invalid value: {SERVICE_NAME_LENGTH_MESSAGE}" in error
    assert f"spec.services: Invalid value: {GRAPH_AND_SERVICE_MESSAGE}" in error


def test_a_service_named_with_an_underscore_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    manifest = _graph(services={"Frontend": {}, "my_worker": {"replicas": 1}})
    error = refused_by_both(cluster, namespace, manifest, "service names must be", dry_run=True)
    assert f"spec.services: Invalid value: {SERVICE_NAME_MESSAGE}" in error


def test_a_70_character_checkpoint_name_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    for name in ("c" * 70, "c" * 53):
        error = refused_by_both(cluster, namespace, _checkpoint(name), "at most 52 characters", dry_run=True)
        assert f"metadata: Invalid value: {CHECKPOINT_NAME_MESSAGE}" in error


# --- more of what a pod would be refused for -------------------------------------------------------------


@pytest.mark.parametrize(
    ("resources", "match", "expected"),
    [
        ({"limits": {"gpu": "1", "nvidia.com/gpu": "2"}}, "given twice", GIVEN_TWICE_MESSAGE),
        ({"limits": {"gpu": "1", "custom": {"nvidia.com/gpu": "2"}}}, "given twice", GIVEN_TWICE_MESSAGE),
        ({"limits": {"nvidia.com/gpu": "0.5"}}, "whole number of GPUs", GPU_COUNT_MESSAGE),
        ({"limits": {"nvidia.com/gpu": -1}}, "whole number of GPUs", GPU_COUNT_MESSAGE),
        ({"limits": {"cpu": "two"}}, "Kubernetes quantity", QUANTITY_MESSAGE),
        ({"requests": {"memory": "-8Gi"}}, "Kubernetes quantity", QUANTITY_MESSAGE),
        ({"limits": {"custom": {"rdma_ib": "1"}}}, "resource name", RESOURCE_NAME_MESSAGE),
        ({"limits": {"custom": {"rdma/ib": "0.5"}}}, "whole number", EXTENDED_RESOURCE_MESSAGE),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}, "exceed", REQUEST_ABOVE_LIMIT_MESSAGE),
        (
            {"requests": {"gpu": "2"}, "limits": {"gpu": "1"}},
            "must equal its limit",
            REQUEST_NOT_LIMIT_MESSAGE,
        ),
    ],
)
def test_resources_a_pod_would_refuse_are_refused(
    cluster: LocalCluster,
    crds: list[str],
    namespace: str,
    resources: dict[str, Any],
    match: str,
    expected: str,
) -> None:
    error = refused_by_both(cluster, namespace, _worker(resources=resources), match, dry_run=True)
    assert "spec.services[worker].resources" in error
    assert expected in error


def test_an_env_with_value_and_value_from_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    env = {"name": "POD", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    error = refused_by_both(cluster, namespace, _worker(envs=[env]), "not both", dry_run=True)
    assert ENV_VALUE_AND_VALUE_FROM_MESSAGE in error


# --- what stays admitted ---------------------------------------------------------------------------------


def test_upstream_names_and_names_at_their_limits_are_admitted(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    upstream = {
        name: {"replicas": 1} for name in ("Frontend", "VllmDecodeWorker", "VllmPrefillWorker", "decode")
    }
    _admitted(cluster, namespace, _graph("vllm-disagg", services=upstream))
    _admitted(cluster, namespace, _graph("g" * 63, services={}))
    _admitted(cluster, namespace, _graph("g" * 40, services={"W" * 16: {}}))
    _admitted(cluster, namespace, _checkpoint("c" * 52))


def test_resources_in_both_upstream_shapes_are_admitted_whole(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    services = {
        "dynamo": {"resources": {"limits": {"gpu": "1"}, "requests": {"cpu": "500m", "memory": "4Gi"}}},
        "kubernetes": {
            "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "2", "memory": "8Gi"}}
        },
        "unquoted": {"resources": {"limits": {"nvidia.com/gpu": 2, "rdma/ib": 1}}},
        "both": {"resources": {"limits": {"gpu": "2", "nvidia.com/gpu": "2", "ephemeral-storage": "10Gi"}}},
        "typed": {
            "resources": {"limits": {"gpu": "1", "gpuType": "amd.com/gpu", "custom": {"rdma/ib": "1"}}}
        },
    }
    stored = _admitted(cluster, namespace, _graph("shapes", services=services))
    dgd = DynamoGraphDeployment.model_validate(stored)
    got = {
        name: (svc.resources.container_resources() if svc.resources else {})
        for name, svc in (dgd.spec.services or {}).items()
    }
    assert got == {
        "dynamo": {"requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"nvidia.com/gpu": "1"}},
        "kubernetes": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": "1"}},
        "unquoted": {"limits": {"nvidia.com/gpu": "2", "rdma/ib": "1"}},
        "both": {"limits": {"nvidia.com/gpu": "2", "ephemeral-storage": "10Gi"}},
        "typed": {"limits": {"amd.com/gpu": "1", "rdma/ib": "1"}},
    }


def test_envs_kubernetes_accepts_are_admitted(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    envs = [
        {"name": "HF_HOME", "value": "/models"},
        {"name": "my.var-1", "value": ""},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ONLY_NAME"},
    ]
    _admitted(cluster, namespace, _graph(envs=envs, services={"worker": {"envs": envs}}))
