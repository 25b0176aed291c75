"""checkpoint.enabled alone: the DGD's own checkpoint, with an identity derived from the service (Dynamo's
newest API deprecates identity and mode for DGD-managed checkpoints)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_snapshot.api.dgd_conversion import to_v1alpha1
from dynamo_snapshot.api.graphdeployment import (
    DGD_MANAGED_FRAMEWORK_MESSAGE,
    DynamoGraphDeployment,
    checkpoint_identity,
)
from dynamo_snapshot.api.identity import BackendFramework, compute_identity_hash
from tests.api.test_dgd_v1beta1 import FIXTURES, _load


def _dgd(main: dict[str, Any] | None, **spec: Any) -> dict[str, Any]:
    worker: dict[str, Any] = {"componentType": "worker", "replicas": 1, "checkpoint": {"enabled": True}}
    if main is not None:
        worker["extraPodSpec"] = {"mainContainer": main}
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g"},
        "spec": {"services": {"worker": worker}, **spec},
    }


VLLM = {
    "image": "vllm:1",
    "command": ["python3", "-m", "dynamo.vllm"],
    "args": ["--model", "Qwen/Qwen3-0.6B"],
}


def _hash(manifest: dict[str, Any]) -> str:
    dgd = DynamoGraphDeployment.model_validate(manifest)
    return compute_identity_hash(checkpoint_identity(dgd.spec, "worker"))


def test_the_identity_comes_from_the_main_container() -> None:
    dgd = DynamoGraphDeployment.model_validate(_dgd(VLLM))
    identity = checkpoint_identity(dgd.spec, "worker")
    assert identity.backend_framework is BackendFramework.VLLM
    assert identity.model == "Qwen/Qwen3-0.6B"
    assert set(identity.extra_parameters or {}) == {"workerSpecHash"}
    assert len((identity.extra_parameters or {})["workerSpecHash"]) == 16


@pytest.mark.parametrize(
    ("main", "model"),
    [
        ({"command": ["python3"], "args": ["-m", "dynamo.sglang", "--model-path=m/x"]}, "m/x"),
        ({"command": ["python", "-m", "dynamo.trtllm"]}, "worker"),  # no --model: the service's name
    ],
)
def test_framework_and_model_in_command_or_args(main: dict[str, Any], model: str) -> None:
    dgd = DynamoGraphDeployment.model_validate(_dgd(main))
    assert checkpoint_identity(dgd.spec, "worker").model == model


def test_the_graphs_backend_framework_comes_first() -> None:
    dgd = DynamoGraphDeployment.model_validate(_dgd(VLLM, backendFramework="sglang"))
    assert checkpoint_identity(dgd.spec, "worker").backend_framework is BackendFramework.SGLANG


def test_replicas_do_not_change_the_checkpoint_and_the_worker_spec_does() -> None:
    base = _dgd(VLLM)
    scaled = copy.deepcopy(base)
    scaled["spec"]["services"]["worker"]["replicas"] = 5
    assert _hash(scaled) == _hash(base)
    changed = copy.deepcopy(base)
    changed["spec"]["services"]["worker"]["extraPodSpec"]["mainContainer"]["args"].append(
        "--max-model-len=4096"
    )
    assert _hash(changed) != _hash(base)
    env = copy.deepcopy(base)
    env["spec"]["envs"] = [{"name": "NCCL_SOCKET_IFNAME", "value": "lo"}]
    assert _hash(env) != _hash(base)


def test_a_legacy_identity_is_used_as_given() -> None:
    manifest = _dgd(VLLM)
    legacy = {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"}
    manifest["spec"]["services"]["worker"]["checkpoint"]["identity"] = legacy
    dgd = DynamoGraphDeployment.model_validate(manifest)
    assert compute_identity_hash(checkpoint_identity(dgd.spec, "worker")) == "96429b2725761a09"


@pytest.mark.parametrize(
    "main", [None, {"command": ["python3", "-m", "dynamo.frontend"]}, {"command": ["sh", "-c", "run"]}]
)
def test_without_a_backend_the_dgd_is_refused_saying_what_to_set(main: dict[str, Any] | None) -> None:
    with pytest.raises(ValidationError) as exc:
        DynamoGraphDeployment.model_validate(_dgd(main))
    assert DGD_MANAGED_FRAMEWORK_MESSAGE in str(exc.value)
    assert "service worker" in str(exc.value)


def test_a_checkpoint_ref_needs_no_backend() -> None:
    manifest = _dgd(None)
    manifest["spec"]["services"]["worker"]["checkpoint"]["checkpointRef"] = "warm-1"
    assert DynamoGraphDeployment.model_validate(manifest).spec.services is not None


def test_dynamos_snapshot_example_is_a_dgd_managed_checkpoint() -> None:
    beta = _load(next(p for p in FIXTURES if p.stem == "vllm-agg-snapshot-tp8"))
    dgd = DynamoGraphDeployment.model_validate(to_v1alpha1(beta))
    identity = checkpoint_identity(dgd.spec, "VllmDecodeWorker")
    assert (identity.backend_framework, identity.model) == (BackendFramework.VLLM, "Qwen/Qwen3-0.6B")
