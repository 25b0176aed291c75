"""The resource models: Dynamo manifests round-trip unchanged, bad input fails naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_snapshot.api.checkpoint import (
    CheckpointPhase,
    DynamoCheckpoint,
    DynamoCheckpointStatus,
)
from dynamo_snapshot.api.graphdeployment import (
    MANUAL_NEEDS_REF_MESSAGE,
    CheckpointMode,
    DynamoGraphDeployment,
    ServiceCheckpointConfig,
)
from dynamo_snapshot.api.identity import BackendFramework, CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.api.kube import CustomResource
from dynamo_snapshot.api.protocol import LABEL_CHECKPOINT_HASH
from tests.api.examples import MANIFEST_DIR, load_manifest
from tests.api.helpers import MODELS


def _validate(manifest: dict[str, Any]) -> CustomResource:
    return MODELS[manifest["kind"]].model_validate(manifest)


def _errors(exc: pytest.ExceptionInfo[ValidationError]) -> list[tuple[str, str]]:
    return [(".".join(str(part) for part in error["loc"]), error["msg"]) for error in exc.value.errors()]


# --- round trips ---------------------------------------------------------------------------------


def test_manifest_round_trips_unchanged(manifest: dict[str, Any]) -> None:
    original = copy.deepcopy(manifest)
    model = _validate(manifest)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == original
    assert model.to_dict() == original


def test_round_trip_is_stable_through_json(manifest: dict[str, Any]) -> None:
    model = _validate(manifest)
    again = type(model).model_validate_json(model.model_dump_json(by_alias=True, exclude_unset=True))
    assert again.to_dict() == manifest


def test_snapshot_quick_start_is_modelled() -> None:
    dgd = DynamoGraphDeployment.model_validate(load_manifest(MANIFEST_DIR / "dgd-vllm-snapshot-auto.yaml"))
    assert dgd.spec.services is not None
    worker = dgd.spec.services["VllmDecodeWorker"]
    assert worker.checkpoint is not None
    assert worker.checkpoint.enabled
    assert worker.checkpoint.mode is CheckpointMode.AUTO
    assert worker.checkpoint.identity is not None
    assert worker.checkpoint.identity.backend_framework is BackendFramework.VLLM
    assert worker.checkpoint.identity.extra_parameters == {
        "enableChunkedPrefill": "true",
        "quantization": "awq",
    }
    assert worker.resources is not None
    assert worker.resources.limits is not None
    assert worker.resources.limits.gpu == "1"
    assert worker.extra_pod_spec is not None
    assert worker.extra_pod_spec.main_container is not None
    assert worker.extra_pod_spec.main_container["image"].endswith("vllm-placeholder:0.7.0")


def test_prewarmed_checkpoint_label_is_its_identity_hash() -> None:
    checkpoint = DynamoCheckpoint.model_validate(load_manifest(MANIFEST_DIR / "dckpt-qwen3-prewarm.yaml"))
    assert checkpoint.metadata.labels is not None
    assert checkpoint.metadata.labels[LABEL_CHECKPOINT_HASH] == checkpoint.spec.identity.compute_hash()


def test_status_round_trips() -> None:
    dgd_status = {
        "observedGeneration": 3,
        "state": "successful",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllServicesReady",
                "message": "",
                "lastTransitionTime": "2026-01-29T10:05:00Z",
                "observedGeneration": 3,
            }
        ],
        "services": {
            "worker": {"replicas": 2, "readyReplicas": 2, "restoredReplicas": 1, "coldStartedReplicas": 1}
        },
        "checkpoints": {
            "worker": {"checkpointName": "abc", "identityHash": "96429b2725761a09", "ready": True}
        },
        "componentKind": "Deployment",
    }
    dgd = DynamoGraphDeployment.model_validate({"spec": {}, "status": dgd_status})
    assert dgd.status is not None
    assert dgd.status.services is not None
    assert dgd.status.services["worker"].restored_replicas == 1
    assert dgd.to_dict()["status"] == dgd_status

    checkpoint_status = {
        "phase": "Ready",
        "identityHash": "96429b2725761a09",
        "location": "/checkpoints/96429b2725761a09",
        "storageType": "pvc",
        "jobName": "checkpoint-qwen3",
        "createdAt": "2026-01-29T10:05:00Z",
        "message": "checkpoint ready",
        "conditions": [
            {
                "type": "JobCompleted",
                "status": "True",
                "reason": "JobSucceeded",
                "message": "",
                "lastTransitionTime": "2026-01-29T10:05:00Z",
            }
        ],
    }
    status = DynamoCheckpointStatus.model_validate(checkpoint_status)
    assert status.phase is CheckpointPhase.READY
    assert status.to_dict() == checkpoint_status


def test_models_accept_snake_case_names() -> None:
    config = ServiceCheckpointConfig(
        enabled=True,
        identity=CheckpointIdentity(model="Qwen/Qwen3-0.6B", backend_framework=BackendFramework.SGLANG),
    )
    assert config.to_dict() == {
        "enabled": True,
        "identity": {"model": "Qwen/Qwen3-0.6B", "backendFramework": "sglang"},
    }


def test_defaults_follow_dynamo() -> None:
    config = ServiceCheckpointConfig.model_validate({})
    assert config.enabled is False
    assert config.mode is CheckpointMode.AUTO
    identity = CheckpointIdentity.model_validate({"model": "m", "backendFramework": "vllm"})
    assert (identity.tensor_parallel_size, identity.pipeline_parallel_size) == (1, 1)
    checkpoint = DynamoCheckpoint.model_validate(
        {"spec": {"identity": {"model": "m", "backendFramework": "vllm"}, "job": {"podTemplateSpec": {}}}}
    )
    job = checkpoint.spec.job
    assert (job.active_deadline_seconds, job.backoff_limit, job.ttl_seconds_after_finished) == (3600, 3, 300)
    assert checkpoint.api_version == "nvidia.com/v1alpha1"
    assert checkpoint.kind == "DynamoCheckpoint"


# --- validation errors ----------------------------------------------------------------------------


def _checkpoint(identity: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": "c"},
        "spec": {"identity": identity, "job": {"podTemplateSpec": {"spec": {"containers": []}}}},
    }


def _dgd_with_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g"},
        "spec": {"services": {"worker": {"componentType": "worker", "checkpoint": checkpoint}}},
    }


def test_unknown_backend_framework_is_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        DynamoCheckpoint.model_validate(_checkpoint({"model": "m", "backendFramework": "tensorflow"}))
    [(where, message)] = _errors(exc)
    assert where == "spec.identity.backendFramework"
    assert "'vllm', 'sglang' or 'trtllm'" in message


def test_unknown_backend_framework_in_a_service_identity_is_rejected() -> None:
    manifest = _dgd_with_checkpoint({"enabled": True, "identity": {"model": "m", "backendFramework": "onnx"}})
    with pytest.raises(ValidationError) as exc:
        DynamoGraphDeployment.model_validate(manifest)
    assert [where for where, _ in _errors(exc)] == [
        "spec.services.worker.checkpoint.identity.backendFramework"
    ]


@pytest.mark.parametrize("key", ["tensorParallelSize", "pipelineParallelSize"])
@pytest.mark.parametrize("value", [-1, -(2**31)])
def test_negative_parallel_size_is_rejected(key: str, value: int) -> None:
    with pytest.raises(ValidationError) as exc:
        DynamoCheckpoint.model_validate(_checkpoint({"model": "m", "backendFramework": "vllm", key: value}))
    [(where, message)] = _errors(exc)
    assert where == f"spec.identity.{key}"
    assert "greater than or equal to 0" in message


@pytest.mark.parametrize(
    ("identity", "field"),
    [
        ({"backendFramework": "vllm"}, "model"),
        ({"model": "", "backendFramework": "vllm"}, "model"),
        ({"model": "m"}, "backendFramework"),
        ({"model": "m", "backendFramework": "vllm", "maxModelLen": -1}, "maxModelLen"),
        ({"model": "m", "backendFramework": "vllm", "tensorParallelSize": "2"}, "tensorParallelSize"),
        ({"model": "m", "backendFramework": "vllm", "tensorParallelSize": 2**31}, "tensorParallelSize"),
        ({"model": "m", "backendFramework": "vllm", "extraParameters": {"a": 1}}, "extraParameters.a"),
        # An unknown key would be ignored by the hash, so it is refused instead of kept.
        ({"model": "m", "backendFramework": "vllm", "framework": "vllm"}, "framework"),
    ],
)
def test_invalid_identity_names_the_field(identity: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        DynamoCheckpoint.model_validate(_checkpoint(identity))
    assert [where for where, _ in _errors(exc)] == [f"spec.identity.{field}"]


def test_manual_mode_requires_checkpoint_ref() -> None:
    identity = {"model": "m", "backendFramework": "vllm"}
    with pytest.raises(ValidationError) as exc:
        DynamoGraphDeployment.model_validate(
            _dgd_with_checkpoint({"enabled": True, "mode": "Manual", "identity": identity})
        )
    [(where, message)] = _errors(exc)
    assert where == "spec.services.worker.checkpoint"
    assert MANUAL_NEEDS_REF_MESSAGE in message


@pytest.mark.parametrize(
    "checkpoint",
    [
        {"enabled": True, "checkpointRef": "prewarmed"},
        {"enabled": True, "mode": "Manual", "checkpointRef": "prewarmed.v2"},
        {"enabled": True, "identity": {"model": "m", "backendFramework": "trtllm"}},
        {"enabled": False},
        {"enabled": False, "mode": "Manual"},
        {},
    ],
)
def test_valid_checkpoint_configs(checkpoint: dict[str, Any]) -> None:
    dgd = DynamoGraphDeployment.model_validate(_dgd_with_checkpoint(checkpoint))
    assert dgd.to_dict()["spec"]["services"]["worker"]["checkpoint"] == checkpoint


@pytest.mark.parametrize("ref", ["Upper", "under_score", "-leading", "trailing-", "", "a" * 254])
def test_checkpoint_ref_must_be_a_resource_name(ref: str) -> None:
    with pytest.raises(ValidationError) as exc:
        DynamoGraphDeployment.model_validate(_dgd_with_checkpoint({"enabled": True, "checkpointRef": ref}))
    assert [where for where, _ in _errors(exc)] == ["spec.services.worker.checkpoint.checkpointRef"]


@pytest.mark.parametrize(
    ("service", "field"),
    [
        ({"replicas": -1}, "replicas"),
        ({"replicas": "2"}, "replicas"),
        ({"resources": {"limits": {"gpu": 1}}}, "resources.limits.gpu"),
        ({"checkpoint": {"enabled": "yes"}}, "checkpoint.enabled"),
        ({"checkpoint": {"mode": "Sometimes"}}, "checkpoint.mode"),
    ],
)
def test_invalid_service_fields_are_named(service: dict[str, Any], field: str) -> None:
    manifest = {"spec": {"services": {"worker": service}}}
    with pytest.raises(ValidationError) as exc:
        DynamoGraphDeployment.model_validate(manifest)
    assert [where for where, _ in _errors(exc)] == [f"spec.services.worker.{field}"]


def test_wrong_kind_is_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        DynamoGraphDeployment.model_validate({"kind": "DynamoCheckpoint", "spec": {}})
    assert [where for where, _ in _errors(exc)] == ["kind"]


def test_identity_hash_of_a_service_identity() -> None:
    config = ServiceCheckpointConfig.model_validate(
        {"enabled": True, "identity": {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"}}
    )
    assert config.identity is not None
    assert config.identity.compute_hash() == "96429b2725761a09"
    assert compute_identity_hash(config.identity) == "96429b2725761a09"
