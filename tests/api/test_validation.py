"""What Kubernetes would refuse in the pods made from a graph or a checkpoint, the models refuse first,
with a message saying why; the CRD schema refuses the same at admission
(tests/integration/test_admission_rejects.py).  Dynamo's resource shapes -- its own (gpu: "1") and the
Kubernetes spelling its docs also use (nvidia.com/gpu: "1") -- become the container's resources."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_snapshot.api.checkpoint import (
    CHECKPOINT_NAME_MAX_LENGTH,
    CHECKPOINT_NAME_MESSAGE,
    DynamoCheckpoint,
)
from dynamo_snapshot.api.container import (
    ENV_NAME_MESSAGE,
    ENV_NAME_REQUIRED_MESSAGE,
    ENV_VALUE_AND_VALUE_FROM_MESSAGE,
    EXTENDED_RESOURCE_MESSAGE,
    GIVEN_TWICE_MESSAGE,
    GPU_COUNT_MESSAGE,
    NOT_A_RESOURCE_MESSAGE,
    REQUEST_ABOVE_LIMIT_MESSAGE,
    REQUEST_NOT_LIMIT_MESSAGE,
    Resources,
)
from dynamo_snapshot.api.graphdeployment import (
    GRAPH_AND_SERVICE_MAX_LENGTH,
    GRAPH_AND_SERVICE_MESSAGE,
    GRAPH_NAME_MAX_LENGTH,
    GRAPH_NAME_MESSAGE,
    SERVICE_NAME_LENGTH_MESSAGE,
    SERVICE_NAME_MESSAGE,
    DynamoGraphDeployment,
)
from dynamo_snapshot.api.kube import QUANTITY_MESSAGE, RESOURCE_NAME_MESSAGE, parse_quantity


def _graph(name: str = "g", services: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"services": {"worker": {}} if services is None else services, **spec},
    }


def _checkpoint(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoCheckpoint",
        "metadata": {"name": name},
        "spec": {
            "identity": {"model": "m", "backendFramework": "vllm"},
            "job": {"podTemplateSpec": {"spec": {"containers": []}}},
        },
    }


def _refused(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, message) of every error, the manifest being refused."""
    model = DynamoCheckpoint if manifest["kind"] == "DynamoCheckpoint" else DynamoGraphDeployment
    with pytest.raises(ValidationError) as exc:
        model.model_validate(manifest)
    return [(".".join(str(part) for part in error["loc"]), error["msg"]) for error in exc.value.errors()]


def _resources(resources: dict[str, Any]) -> dict[str, dict[str, str]]:
    return Resources.model_validate(resources).container_resources()


def _resources_refused(resources: dict[str, Any]) -> tuple[str, str]:
    [(where, message)] = _refused(_graph(services={"worker": {"resources": resources}}))
    prefix = "spec.services.worker.resources"
    assert where.startswith(prefix), where
    return where.removeprefix(prefix).lstrip("."), message


# --- names ---------------------------------------------------------------------------------------------


def test_a_graph_name_longer_than_a_label_value_is_refused() -> None:
    [(where, message)] = _refused(_graph("a" * 70, services={}))
    assert where == "metadata"
    assert GRAPH_NAME_MESSAGE in message
    assert "snapshot.nvidia.com/graph" in message


def test_graph_and_service_names_together_leave_room_for_the_pod_suffix() -> None:
    assert (GRAPH_NAME_MAX_LENGTH, GRAPH_AND_SERVICE_MAX_LENGTH) == (63, 56)
    DynamoGraphDeployment.model_validate(_graph("g" * 63, services={}))
    DynamoGraphDeployment.model_validate(_graph("g" * 40, services={"w" * 16: {}, "Frontend": {}}))

    [(where, message)] = _refused(_graph("g" * 40, services={"w" * 17: {}, "Frontend": {}}))
    assert where == ""
    assert GRAPH_AND_SERVICE_MESSAGE in message
    assert repr("w" * 17) in message
    assert "Frontend" not in message


def test_a_service_name_longer_than_a_label_value_is_refused() -> None:
    [(where, message)] = _refused(_graph(services={"w" * 70: {}}))
    assert where == f"spec.services.{'w' * 70}.[key]"
    assert SERVICE_NAME_LENGTH_MESSAGE in message
    # Short of the label limit, the pod name is what it does not fit.
    [(_, message)] = _refused(_graph(services={"w" * 60: {}}))
    assert GRAPH_AND_SERVICE_MESSAGE in message


@pytest.mark.parametrize(
    "service", ["my_worker", "my.worker", "-worker", "worker-", "my worker", "wörker", ""]
)
def test_a_service_name_no_pod_can_be_named_after_is_refused(service: str) -> None:
    [(where, message)] = _refused(_graph(services={"Frontend": {}, service: {}}))
    assert where == f"spec.services.{service}.[key]"
    assert SERVICE_NAME_MESSAGE in message
    assert repr(service) in message


def test_upstream_service_names_are_accepted() -> None:
    names = ["Frontend", "VllmDecodeWorker", "VllmPrefillWorker", "TRTLLMWorker", "decode", "worker-2", "P"]
    dgd = DynamoGraphDeployment.model_validate(_graph("vllm-disagg", services={n: {} for n in names}))
    assert list(dgd.spec.services or {}) == names


def test_a_checkpoint_name_leaves_room_for_the_job_suffix() -> None:
    assert CHECKPOINT_NAME_MAX_LENGTH == 52
    DynamoCheckpoint.model_validate(_checkpoint("c" * 52))
    for name in ("c" * 53, "c" * 70):
        [(where, message)] = _refused(_checkpoint(name))
        assert where == "metadata"
        assert CHECKPOINT_NAME_MESSAGE in message
        assert "<metadata.name>-checkpoint" in message


def test_a_checkpoint_ref_no_checkpoint_can_have_is_refused() -> None:
    checkpoint = {"enabled": True, "checkpointRef": "c" * 53}
    [(where, _)] = _refused(_graph(services={"worker": {"checkpoint": checkpoint}}))
    assert where == "spec.services.worker.checkpoint.checkpointRef"


# --- environment variables -------------------------------------------------------------------------------


@pytest.mark.parametrize("env", [{"value": "x"}, {"name": "", "value": "x"}, {"name": None}])
def test_an_env_without_a_name_is_refused(env: dict[str, Any]) -> None:
    [(where, message)] = _refused(_graph(envs=[{"name": "A", "value": "1"}, env]))
    assert where == "spec.envs.1"
    assert ENV_NAME_REQUIRED_MESSAGE in message

    [(where, message)] = _refused(_graph(services={"worker": {"envs": [env]}}))
    assert where == "spec.services.worker.envs.0"
    assert ENV_NAME_REQUIRED_MESSAGE in message


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"name": "A=B", "value": "1"}, ENV_NAME_MESSAGE),
        ({"name": "TAB\t", "value": "1"}, ENV_NAME_MESSAGE),
        ({"name": 7, "value": "1"}, ENV_NAME_MESSAGE),
        ({"name": "A", "value": 1}, "value must be a string"),
        ({"name": "A", "valueFrom": "x"}, "valueFrom must be an object"),
        ({"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, "not both"),
    ],
)
def test_an_env_a_pod_would_refuse_is_refused(env: dict[str, Any], expected: str) -> None:
    [(where, message)] = _refused(_graph(services={"worker": {"envs": [env]}}))
    assert where == "spec.services.worker.envs.0"
    assert expected in message
    assert ENV_VALUE_AND_VALUE_FROM_MESSAGE.endswith("not both")


def test_envs_kubernetes_accepts_round_trip_unchanged() -> None:
    envs = [
        {"name": "HF_HOME", "value": "/models"},
        {"name": "my.var-1", "value": ""},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": "EMPTY_VALUE_AND_REF",
            "value": "",
            "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
        },
        {"name": "ONLY_NAME"},
    ]
    manifest = _graph(envs=envs, services={"worker": {"envs": envs}})
    assert DynamoGraphDeployment.model_validate(manifest).to_dict() == manifest


# --- GPU counts and quantities -------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", ["0.5", "1.0", "-1", "one", "", "1e3"])
@pytest.mark.parametrize("kind", ["limits", "requests"])
def test_a_gpu_count_that_is_not_a_whole_number_is_refused(gpu: str, kind: str) -> None:
    where, message = _resources_refused({kind: {"gpu": gpu}})
    assert where == f"{kind}.gpu"
    assert GPU_COUNT_MESSAGE in message


@pytest.mark.parametrize("gpu", ["0.5", "-1", 0.5, -1, True])
def test_a_kubernetes_style_gpu_count_that_is_not_a_whole_number_is_refused(gpu: Any) -> None:
    where, message = _resources_refused({"limits": {"nvidia.com/gpu": gpu}})
    assert where == "limits.nvidia.com/gpu"
    assert GPU_COUNT_MESSAGE in message


@pytest.mark.parametrize(
    ("item", "where"),
    [
        ({"cpu": "two"}, "limits.cpu"),
        ({"memory": "8GB"}, "limits.memory"),
        ({"memory": "-1Gi"}, "limits.memory"),
    ],
)
def test_a_cpu_or_memory_that_is_no_quantity_is_refused(item: dict[str, str], where: str) -> None:
    assert _resources_refused({"limits": item}) == (
        where,
        f"Value error, {item[where[7:]]!r} {QUANTITY_MESSAGE}",
    )


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ({"limits": {"amd.com/gpu": "0.5"}}, EXTENDED_RESOURCE_MESSAGE),
        ({"requests": {"custom": {"rdma/ib": "500m"}}}, EXTENDED_RESOURCE_MESSAGE),
        ({"limits": {"ephemeral-storage": "ten"}}, QUANTITY_MESSAGE),
        ({"limits": {"gpus": "1"}}, NOT_A_RESOURCE_MESSAGE),
        ({"limits": {"nvidia_com/gpu": "1"}}, NOT_A_RESOURCE_MESSAGE),
        ({"limits": {"requests.nvidia.com/gpu": "1"}}, NOT_A_RESOURCE_MESSAGE),
        ({"limits": {"custom": {"bad key": "1"}}}, RESOURCE_NAME_MESSAGE),
        ({"limits": {"rdma/ib": [1]}}, QUANTITY_MESSAGE),
    ],
)
def test_a_resource_kubernetes_would_refuse_is_refused(resources: dict[str, Any], expected: str) -> None:
    _, message = _resources_refused(resources)
    assert expected in message


def test_quantities_are_read_as_kubernetes_reads_them() -> None:
    assert parse_quantity("1") == parse_quantity("1000m") == parse_quantity("+1") == parse_quantity("1.")
    assert parse_quantity("8Gi") == 8 * 2**30
    assert parse_quantity("1e3") == parse_quantity("1k") == 1000
    assert parse_quantity("250u") == Decimal("0.00025")
    assert parse_quantity("9" * 60) == int("9" * 60)
    for bad in ("-1", "1K", "1GB", "1e3.5", "", "1 Gi", "0x10"):
        with pytest.raises(ValueError, match="Kubernetes quantity"):
            parse_quantity(bad)
    for huge in ("1e999999999", "1e-999999999"):
        with pytest.raises(ValueError, match="exponent is out of range"):
            parse_quantity(huge)


# --- resource shapes -----------------------------------------------------------------------------------


def test_dynamo_shape_asks_for_gpus_of_its_gpu_type() -> None:
    assert _resources({"limits": {"gpu": "1"}}) == {"limits": {"nvidia.com/gpu": "1"}}
    assert _resources({"limits": {"gpu": "2", "gpuType": "gpu.intel.com/xe"}}) == {
        "limits": {"gpu.intel.com/xe": "2"}
    }


def test_kubernetes_shape_from_dynamos_docs_is_honoured() -> None:
    resources = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "2", "memory": "8Gi"}}
    assert _resources(resources) == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    # Unquoted, as pod manifests often write it; the round trip keeps the integer.
    manifest = _graph(services={"worker": {"resources": {"limits": {"nvidia.com/gpu": 2, "rdma/ib": 1}}}})
    dgd = DynamoGraphDeployment.model_validate(manifest)
    assert dgd.to_dict() == manifest
    worker = (dgd.spec.services or {})["worker"]
    assert worker.resources is not None
    assert worker.resources.container_resources() == {"limits": {"nvidia.com/gpu": "2", "rdma/ib": "1"}}


def test_gpu_given_twice_must_agree() -> None:
    assert _resources({"limits": {"gpu": "1", "nvidia.com/gpu": "1"}}) == {"limits": {"nvidia.com/gpu": "1"}}
    assert _resources({"limits": {"gpu": "2", "custom": {"nvidia.com/gpu": "2"}}}) == {
        "limits": {"nvidia.com/gpu": "2"}
    }
    for item in (
        {"gpu": "1", "nvidia.com/gpu": "2"},
        {"gpu": "1", "nvidia.com/gpu": 2},
        {"gpu": "1", "custom": {"nvidia.com/gpu": "2"}},
        {"nvidia.com/gpu": "1", "custom": {"nvidia.com/gpu": "4"}},
        {"gpu": "1", "gpuType": "amd.com/gpu", "amd.com/gpu": "3"},
    ):
        where, message = _resources_refused({"limits": item})
        assert where == "limits"
        assert GIVEN_TWICE_MESSAGE in message
    # A GPU count of another type is another resource.
    assert _resources({"limits": {"gpu": "1", "gpuType": "amd.com/gpu", "nvidia.com/gpu": "2"}}) == {
        "limits": {"amd.com/gpu": "1", "nvidia.com/gpu": "2"}
    }


def test_resources_kubernetes_will_not_overcommit_get_their_request_as_limit() -> None:
    resources = {
        "requests": {
            "cpu": "4",
            "gpu": "2",
            "custom": {"rdma/ib": "1", "hugepages-2Mi": "1Gi"},
            "example.com/fpga": "1",
        }
    }
    assert _resources(resources) == {
        "requests": {
            "cpu": "4",
            "nvidia.com/gpu": "2",
            "example.com/fpga": "1",
            "rdma/ib": "1",
            "hugepages-2Mi": "1Gi",
        },
        "limits": {"nvidia.com/gpu": "2", "example.com/fpga": "1", "rdma/ib": "1", "hugepages-2Mi": "1Gi"},
    }


def test_requests_must_fit_their_limits() -> None:
    assert _resources({"requests": {"cpu": "500m"}, "limits": {"cpu": "1"}}) == {
        "requests": {"cpu": "500m"},
        "limits": {"cpu": "1"},
    }
    where, message = _resources_refused({"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}})
    assert (where, REQUEST_ABOVE_LIMIT_MESSAGE in message) == ("", True)
    where, message = _resources_refused({"requests": {"memory": "9Gi"}, "limits": {"memory": "8Gi"}})
    assert REQUEST_ABOVE_LIMIT_MESSAGE in message
    for resources in (
        {"requests": {"gpu": "2"}, "limits": {"gpu": "1"}},
        {"requests": {"gpu": "1"}, "limits": {"nvidia.com/gpu": "2"}},
    ):
        where, message = _resources_refused(resources)
        assert where == ""
        assert REQUEST_NOT_LIMIT_MESSAGE in message
        assert "requests.nvidia.com/gpu" in message
