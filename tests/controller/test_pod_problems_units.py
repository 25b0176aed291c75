"""What the kubelet says is wrong with a worker pod, the pure part: its container statuses read into a kind
of problem with the kubelet's own words, grouped per service, and folded into the DGD's Degraded
condition (`no problem detected` only when there is none)."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.controller.dynamo.dgd_status import ServiceOutcome, dgd_status
from dynamo_snapshot.controller.dynamo.pod_problems import (
    CONFIG_ERROR,
    CONTAINER_START_FAILED,
    CRASH_LOOP,
    IMAGE_PULL_FAILED,
    OOM_KILLED,
    pod_problem,
    service_problems,
)
from dynamo_snapshot.kube import Obj


def _pod(
    name: str = "w-1",
    *,
    state: dict[str, Any] | None = None,
    last: dict[str, Any] | None = None,
    restarts: int = 0,
    ready: bool = False,
    init: bool = False,
) -> Obj:
    status: dict[str, Any] = {
        "name": "main",
        "ready": ready,
        "restartCount": restarts,
        "state": state or {"waiting": {"reason": "ContainerCreating"}},
    }
    if last is not None:
        status["lastState"] = last
    key = "initContainerStatuses" if init else "containerStatuses"
    return {
        "metadata": {"name": name, "namespace": "ns"},
        "status": {
            "phase": "Running" if ready else "Pending",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            key: [status],
        },
    }


def _waiting(reason: str, message: str) -> dict[str, Any]:
    return {"waiting": {"reason": reason, "message": message}}


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("ErrImagePull", IMAGE_PULL_FAILED),
        ("ImagePullBackOff", IMAGE_PULL_FAILED),
        ("InvalidImageName", IMAGE_PULL_FAILED),
        ("ErrImageNeverPull", IMAGE_PULL_FAILED),
        ("CreateContainerConfigError", CONFIG_ERROR),
        ("CreateContainerError", CONTAINER_START_FAILED),
        ("RunContainerError", CONTAINER_START_FAILED),
        ("CrashLoopBackOff", CRASH_LOOP),
    ],
)
def test_a_waiting_reason_is_a_kind_of_problem_in_the_kubelets_words(reason: str, kind: str) -> None:
    problem = pod_problem(_pod(state=_waiting(reason, 'the kubelet says "why"')))
    assert problem is not None
    assert problem.reason == kind
    assert problem.detail == f'container main: {reason}: the kubelet says "why"'


def test_a_crash_loop_names_the_last_exit() -> None:
    last = {"terminated": {"reason": "Error", "exitCode": 3, "message": "Traceback: boom"}}
    pod = _pod(state=_waiting("CrashLoopBackOff", "back-off 40s"), last=last, restarts=4)
    problem = pod_problem(pod)
    assert problem is not None
    assert problem.reason == CRASH_LOOP
    assert "last exit: Error, exit code 3: Traceback: boom; restarted 4 time(s)" in problem.detail


def test_a_worker_that_exited_and_runs_again_is_crashing_until_it_is_ready() -> None:
    last = {"terminated": {"reason": "Error", "exitCode": 1}}
    running = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    problem = pod_problem(_pod(state=running, last=last, restarts=1))
    assert problem is not None
    assert problem.reason == CRASH_LOOP
    # Ready again: whatever happened before, nothing is wrong now.
    assert pod_problem(_pod(state=running, last=last, restarts=1, ready=True)) is None


def test_out_of_memory_is_said_as_such() -> None:
    last = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    problem = pod_problem(_pod(state={"running": {}}, last=last, restarts=2))
    assert problem is not None
    assert problem.reason == OOM_KILLED
    assert "OOMKilled, exit code 137" in problem.detail


@pytest.mark.parametrize(
    "pod",
    [
        _pod(),  # ContainerCreating
        _pod(state=_waiting("PodInitializing", "")),
        {"metadata": {"name": "w"}, "status": {"phase": "Pending"}},  # not scheduled yet
        _pod(state={"running": {}}, last={"terminated": {"reason": "Completed", "exitCode": 0}}, restarts=1),
    ],
)
def test_a_pod_that_is_only_starting_has_no_problem(pod: Obj) -> None:
    assert pod_problem(pod) is None


def test_an_init_container_that_cannot_pull_is_a_problem_of_the_pod() -> None:
    problem = pod_problem(_pod(state=_waiting("ImagePullBackOff", "Back-off pulling"), init=True))
    assert problem is not None
    assert problem.reason == IMAGE_PULL_FAILED


def test_pods_with_the_same_problem_are_one_line_naming_them() -> None:
    pods = [
        _pod(f"w-{i}", state=_waiting("ImagePullBackOff", f'Back-off pulling image "nope:{i}"'))
        for i in range(5)
    ]
    pods.append(_pod("w-ok", state={"running": {}}, ready=True))
    lines, reason = service_problems("VllmWorker", pods)
    assert reason == IMAGE_PULL_FAILED
    assert lines == [
        "service VllmWorker: ImagePullFailed: pod w-0, w-1, w-2 and 2 more: its image cannot be pulled "
        '(container main: ImagePullBackOff: Back-off pulling image "nope:0")'
    ]
    assert service_problems("VllmWorker", pods[-1:]) == ([], None)


def test_a_long_kubelet_message_is_cut() -> None:
    problem = pod_problem(_pod(state=_waiting("ErrImagePull", "x" * 5000)))
    assert problem is not None
    assert len(problem.detail) < 400


def _degraded(outcomes: dict[str, ServiceOutcome]) -> dict[str, Any]:
    status = dgd_status({}, outcomes, 1)
    return next(c for c in status["conditions"] if c["type"] == cond.DEGRADED)


def test_the_degraded_condition_says_the_kind_of_problem_and_where() -> None:
    pods = [_pod("g-w-abcde", state=_waiting("ErrImageNeverPull", 'image "nope" is not present'))]
    lines, reason = service_problems("W", pods)
    degraded = _degraded({"W": ServiceOutcome(replicas=1, desired=1, degraded=lines, degraded_reason=reason)})
    assert (degraded["status"], degraded["reason"]) == ("True", IMAGE_PULL_FAILED)
    assert "pod g-w-abcde" in degraded["message"]
    assert 'image "nope" is not present' in degraded["message"]
    healthy = _degraded({"W": ServiceOutcome(replicas=1, ready=1, desired=1)})
    assert (healthy["status"], healthy["reason"], healthy["message"]) == (
        "False",
        "Healthy",
        "no problem detected",
    )
