"""The generated CRDs on a real kube-apiserver: Dynamo manifests apply unchanged and come back whole,
and bad input is refused by the apiserver itself with a message naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.api.checkpoint import IDENTITY_IMMUTABLE_MESSAGE
from dynamo_snapshot.api.graphdeployment import (
    DGD_MANAGED_FRAMEWORK_MESSAGE,
    MANUAL_NEEDS_REF_MESSAGE,
    DynamoGraphDeployment,
)
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.api.examples import MANIFEST_DIR, MANIFEST_FILES, load_manifest
from tests.api.helpers import MODELS, lost
from tests.integration.apply import refused, refused_by_both

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def crds(crds: list[str], v1alpha1_served: None) -> list[str]:
    """The CRDs with v1alpha1 DGDs served too (the chart's arrangement): this module applies v1alpha1
    manifests. crds/ alone serves v1beta1 only (test_crds_as_shipped.py)."""
    return crds


async def _read(api: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    plural = MODELS[manifest["kind"]].resource.plural
    stored: dict[str, Any] = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        API_GROUP, API_VERSION, namespace, plural, manifest["metadata"]["name"]
    )
    return stored


def _checkpoint(name: str, **identity: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": name},
        "spec": {
            "identity": {"model": "Qwen/Qwen3-0.6B", "backendFramework": "vllm", **identity},
            "job": {"podTemplateSpec": {"spec": {"containers": [{"name": "main", "image": "worker:1"}]}}},
        },
    }


def _graph(name: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {
            "services": {"worker": {"componentType": "worker", "replicas": 1, "checkpoint": checkpoint}}
        },
    }


# --- real manifests ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=[path.stem for path in MANIFEST_FILES])
async def test_example_applies_unchanged_and_reads_back_whole(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str, path: Path
) -> None:
    manifest = load_manifest(path)
    # The file itself, not a re-serialisation of it.
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))

    stored = await _read(api, namespace, manifest)
    assert lost(manifest["spec"], stored["spec"]) == []
    for key in ("labels", "annotations"):
        assert lost(manifest["metadata"].get(key, {}), stored["metadata"].get(key, {})) == []

    model = MODELS[manifest["kind"]].model_validate(stored)
    assert model.to_dict() == stored
    assert lost(manifest["spec"], model.to_dict()["spec"]) == []


async def test_server_defaults_do_not_change_the_identity_hash(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str
) -> None:
    manifest = _checkpoint("defaults")
    cluster.apply(manifest, namespace)
    stored = await _read(api, namespace, manifest)
    identity = stored["spec"]["identity"]
    assert (identity["tensorParallelSize"], identity["pipelineParallelSize"]) == (1, 1)
    assert compute_identity_hash(identity) == compute_identity_hash(manifest["spec"]["identity"])
    job = stored["spec"]["job"]
    assert (job["activeDeadlineSeconds"], job["backoffLimit"], job["ttlSecondsAfterFinished"]) == (
        3600,
        3,
        300,
    )


# --- refusals ------------------------------------------------------------------------------------


def test_unknown_backend_framework_is_refused(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = _checkpoint("bad-backend", backendFramework="tensorflow")
    error = refused_by_both(cluster, namespace, manifest, "backendFramework")
    assert "spec.identity.backendFramework" in error
    assert "tensorflow" in error


def test_unknown_backend_framework_in_a_service_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    manifest = _graph(
        "bad-backend", {"enabled": True, "identity": {"model": "m", "backendFramework": "onnx"}}
    )
    error = refused_by_both(cluster, namespace, manifest, "backendFramework")
    assert "checkpoint.identity.backendFramework" in error
    assert "onnx" in error


@pytest.mark.parametrize("size", [-1, -2])
def test_negative_tensor_parallel_size_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str, size: int
) -> None:
    manifest = _checkpoint(f"tp{size}".replace("-", "minus"), tensorParallelSize=size)
    error = refused_by_both(cluster, namespace, manifest, "tensorParallelSize")
    assert "spec.identity.tensorParallelSize" in error
    assert "greater than or equal to 0" in error


async def test_identity_is_immutable(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str
) -> None:
    manifest = _checkpoint("immutable", dtype="bfloat16")
    cluster.apply(manifest, namespace)

    changed = copy.deepcopy(manifest)
    changed["spec"]["identity"]["model"] = "Qwen/Qwen3-8B"
    error = refused(cluster, namespace, changed)
    assert "spec.identity" in error
    assert IDENTITY_IMMUTABLE_MESSAGE in error

    added = copy.deepcopy(manifest)
    added["spec"]["identity"]["maxModelLen"] = 4096
    assert IDENTITY_IMMUTABLE_MESSAGE in refused(cluster, namespace, added)

    stored = await _read(api, namespace, manifest)
    assert stored["spec"]["identity"]["model"] == "Qwen/Qwen3-0.6B"

    # Only the identity is frozen: the Job settings may still change.
    retimed = copy.deepcopy(manifest)
    retimed["spec"]["job"]["activeDeadlineSeconds"] = 7200
    cluster.apply(retimed, namespace)
    assert (await _read(api, namespace, manifest))["spec"]["job"]["activeDeadlineSeconds"] == 7200


async def test_enabled_checkpoint_alone_is_a_dgd_managed_checkpoint(
    cluster: LocalCluster, crds: list[str], api: client.ApiClient, namespace: str
) -> None:
    # Dynamo's newest API: enabled without checkpointRef or identity asks for the DGD's own checkpoint.
    manifest = _graph("dgd-managed", {"enabled": True})
    # Its backend must be known: stored at v1beta1, a v1alpha1 write goes through the conversion webhook,
    # which refuses what the model refuses, with the model's message.
    assert DGD_MANAGED_FRAMEWORK_MESSAGE in refused(cluster, namespace, manifest)
    manifest["spec"]["backendFramework"] = "vllm"
    cluster.apply(manifest, namespace)
    stored = await _read(api, namespace, manifest)
    assert stored["spec"]["services"]["worker"]["checkpoint"] == {"enabled": True, "mode": "Auto"}


def test_manual_checkpoint_without_ref_is_refused(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    manifest = _graph(
        "manual", {"enabled": True, "mode": "Manual", "identity": {"model": "m", "backendFramework": "vllm"}}
    )
    assert MANUAL_NEEDS_REF_MESSAGE in refused_by_both(cluster, namespace, manifest, "Manual")


def test_disabled_checkpoint_needs_nothing(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    manifest = _graph("disabled", {"enabled": False})
    DynamoGraphDeployment.model_validate(manifest)
    cluster.apply(manifest, namespace)


# --- kubectl get ---------------------------------------------------------------------------------


def test_kubectl_get_dckpt_columns(cluster: LocalCluster, crds: list[str], namespace: str) -> None:
    path = MANIFEST_DIR / "dckpt-qwen3-prewarm.yaml"
    manifest = load_manifest(path)
    name = manifest["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))
    identity_hash = compute_identity_hash(manifest["spec"]["identity"])
    status = {"status": {"phase": "Ready", "identityHash": identity_hash}}
    cluster.kubectl(
        "patch",
        "dckpt",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )

    header, *rows = cluster.kubectl("get", "dckpt", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "MODEL", "BACKEND", "PHASE", "HASH", "AGE"]
    [row] = rows
    assert row.split()[:5] == [name, "Qwen/Qwen3-0.6B", "vllm", "Ready", identity_hash]
