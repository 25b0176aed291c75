"""Honest DGD status, the pure parts: which services the controller runs and with what command, which
apiserver answers count as refusals, and how outcomes fold into the DGD's conditions."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment, ServiceSpec
from dynamo_snapshot.controller.dynamo.dgd_status import ServiceOutcome, dgd_status
from dynamo_snapshot.controller.dynamo.refusals import Refusal, refused
from dynamo_snapshot.controller.podspec import cold_start_pod, unsupported
from dynamo_snapshot.kube import ApiError, Obj
from tests.api.examples import MANIFEST_DIR, load_manifest


def _graph(services: dict[str, Any]) -> tuple[Obj, DynamoGraphDeployment]:
    obj: Obj = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "g", "namespace": "ns", "uid": "u-1"},
        "spec": {"services": services},
    }
    return obj, DynamoGraphDeployment.model_validate(obj)


def _main(services: dict[str, Any], name: str) -> Obj:
    obj, dgd = _graph(services)
    containers: list[Obj] = cold_start_pod(obj, dgd, name)["spec"]["containers"]
    return containers[0]


def test_a_frontend_without_a_command_gets_the_one_dynamos_operator_gives_it() -> None:
    manifest = load_manifest(MANIFEST_DIR / "dgd-vllm-agg.yaml")
    main = _main(manifest["spec"]["services"], "Frontend")
    assert (main["command"], main["args"]) == (["python3"], ["-m", "dynamo.frontend"])
    # Its own args are kept: only the interpreter is supplied.
    main = _main(
        {"Frontend": {"componentType": "frontend", "extraPodSpec": {"mainContainer": {"args": ["x"]}}}},
        "Frontend",
    )
    assert (main["command"], main["args"]) == (["python3"], ["x"])


def test_args_without_a_command_run_in_a_shell_as_dynamo_runs_them() -> None:
    manifest = load_manifest(MANIFEST_DIR / "dgd-vllm-disagg-probes.yaml")
    for name in ("Frontend", "VllmDecodeWorker"):  # componentType main and worker, args a shell pipeline
        main = _main(manifest["spec"]["services"], name)
        assert main["command"] == ["/bin/sh", "-c"]
        assert len(main["args"]) == 1
        assert main["args"][0].startswith("python3 -m dynamo.")


def test_a_given_command_is_kept_and_a_bare_image_keeps_its_entrypoint() -> None:
    manifest = load_manifest(MANIFEST_DIR / "dgd-vllm-agg.yaml")
    main = _main(manifest["spec"]["services"], "VllmWorker")
    assert main["command"] == ["python3", "-m", "dynamo.vllm"]
    assert main["args"] == ["--model", "Qwen/Qwen3-0.6B"]
    main = _main({"W": {"componentType": "worker", "extraPodSpec": {"mainContainer": {"image": "i"}}}}, "W")
    assert "command" not in main
    assert "args" not in main


@pytest.mark.parametrize(
    ("multinode", "why"),
    [
        (None, None),
        ({"nodeCount": 1}, None),
        ({"nodeCount": 2}, "multinode.nodeCount is 2"),
        ({}, "multinode.nodeCount is 2"),  # Dynamo's default node count
        ({"nodeCount": "4"}, "multinode.nodeCount is '4'"),
    ],
)
def test_only_multinode_services_are_not_run(multinode: dict[str, Any] | None, why: str | None) -> None:
    spec: dict[str, Any] = {"componentType": "worker"}
    if multinode is not None:
        spec["multinode"] = multinode
    got = unsupported(ServiceSpec.model_validate(spec))
    if why is None:
        assert got is None
    else:
        assert got is not None
        assert got.startswith(why)
        assert "one pod per replica" in got


def test_the_trtllm_example_has_exactly_one_service_not_run() -> None:
    manifest = load_manifest(MANIFEST_DIR / "dgd-trtllm-unmodeled-fields.yaml")
    dgd = DynamoGraphDeployment.model_validate(manifest)
    services = dgd.spec.services or {}
    assert {n for n, s in services.items() if unsupported(s)} == {"TrtllmWorker"}


@pytest.mark.parametrize(
    ("status", "reason", "is_refusal"),
    [
        (403, "Forbidden", True),  # admission, quota, RBAC
        (422, "Invalid", True),  # a field the CRD schema could not check
        (400, "BadRequest", True),
        (404, "NotFound", True),  # the namespace is gone
        (409, "AlreadyExists", False),
        (409, "Conflict", False),
        (429, "TooManyRequests", False),
        (408, "Timeout", False),
        (401, "Unauthorized", False),
        (500, "InternalError", False),
        (503, "ServiceUnavailable", False),
    ],
)
def test_which_answers_are_refusals(status: int, reason: str, is_refusal: bool) -> None:
    assert refused(ApiError(status, reason, "m")) is is_refusal


def test_a_connection_error_is_not_a_refusal() -> None:
    assert not refused(ConnectionResetError())


def _fold(outcomes: dict[str, ServiceOutcome]) -> dict[str, Any]:
    return dgd_status({}, outcomes, 3)


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in status["conditions"] if c["type"] == type_)
    return found


def test_ready_only_when_every_service_has_its_ready_replicas() -> None:
    status = _fold({"Frontend": ServiceOutcome(replicas=1, ready=1, desired=1, cold=1)})
    assert _cond(status, "Ready")["status"] == "True"
    assert status["state"] == "successful"
    status = _fold(
        {
            "Frontend": ServiceOutcome(replicas=1, ready=1, desired=1, cold=1),
            "VllmWorker": ServiceOutcome(replicas=1, ready=0, desired=1, cold=1),
        }
    )
    ready = _cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasNotReady")
    assert "VllmWorker: 0/1 ready" in ready["message"]
    assert status["state"] == "pending"
    assert _cond(status, "Degraded")["status"] == "False"


def test_a_refusal_is_degraded_with_its_reason_and_the_apiservers_words() -> None:
    refusal = Refusal(
        cond.POD_CREATE_REJECTED,
        "service W: pod refused (403 Forbidden: exceeded quota: q); retried with backoff",
        3,
        1,
        time.monotonic() + 1,
    )
    status = _fold({"W": ServiceOutcome(desired=2, refusal=refusal)})
    degraded = _cond(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PodCreateRejected")
    assert "exceeded quota: q" in degraded["message"]
    assert _cond(status, "Ready")["status"] == "False"
    assert status["state"] == "failed"
    assert status["services"]["W"]["replicas"] == 0


def test_a_service_not_run_keeps_the_graph_from_ready_and_says_why() -> None:
    status = _fold(
        {
            "Frontend": ServiceOutcome(replicas=1, ready=1, desired=1, cold=1),
            "Big": ServiceOutcome(desired=1, not_handled="service Big is not run: multinode"),
        }
    )
    ready = _cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ServiceNotHandled")
    assert "service Big is not run: multinode" in ready["message"]
    assert _cond(status, "Degraded")["reason"] == "ServiceNotHandled"
    assert set(status["services"]) == {"Frontend", "Big"}  # every service of the graph is reported
