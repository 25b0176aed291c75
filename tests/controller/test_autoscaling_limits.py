"""The autoscaler's limits end to end, against the real control plane and a real Prometheus: a policy on an
absurd total (vector(1e300)) with no scaleUp settings moves by the default step once per period and
never past the controller's cluster-wide ceiling, which the policy reports; totals that are NaN,
infinite or negative are refused (MetricsAvailable False) and move nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dynamo_snapshot.kube import Obj
from dynamo_snapshot.kube.kinds import SCALING_POLICY
from dynamo_snapshot_dev.localcluster import LocalPrometheus
from tests.autoscale.exporter import FakeVllmExporter
from tests.controller.conftest import Harness, dgd_manifest, eventually
from tests.helpers.prometheus import local_prometheus

pytestmark = pytest.mark.cluster

CEILING = 8
# The default scale-up limit: max(4 replicas, 300 %) per 15 s.
STEP, PERIOD_S = 4, 15.0


@pytest.fixture
def nodes(gpu_node: Callable[..., dict[str, Any]]) -> None:
    for _ in range(2):
        gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580)


@pytest.fixture
def prometheus(tmp_path: Any) -> Iterator[LocalPrometheus]:
    # The queries below are constants: the exporter is only a target for Prometheus to be up with.
    exporter = FakeVllmExporter(["worker-0"])
    try:
        with local_prometheus([exporter.address], tmp_path / "prometheus") as server:
            yield server
    finally:
        exporter.stop()


def policy(name: str, url: str, metrics: list[dict[str, Any]], **spec: Any) -> Obj:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoScalingPolicy",
        "metadata": {"name": name},
        "spec": {
            "target": {"dgdName": "scaled", "serviceName": "VllmWorker"},
            "metrics": metrics,
            "evaluationIntervalSeconds": 1,
            "prometheusUrl": url,
            **spec,
        },
    }


async def _replicas(h: Harness) -> int:
    return int((await h.dgd("scaled"))["spec"]["services"]["VllmWorker"]["replicas"])


async def _status(h: Harness, name: str) -> dict[str, Any]:
    status: dict[str, Any] = (await h.kube.get(SCALING_POLICY, name, h.namespace)).get("status") or {}
    return status


def _find(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    found = _find(status, type_)
    assert found is not None, f"no {type_} condition in {status.get('conditions')}"
    return found


@pytest.mark.parametrize("harness", [{"max_policy_replicas": CEILING}], indirect=True)
async def test_an_absurd_total_moves_by_the_default_step_per_period_and_stops_at_the_ceiling(
    harness: Harness, nodes: None, prometheus: LocalPrometheus
) -> None:
    h = harness
    await h.apply_dgd(dgd_manifest("scaled", replicas=1))
    absurd = [{"name": "absurd", "query": "vector(1e300)", "targetPerReplica": 1}]
    # No scaleUp settings: the defaults apply. maxReplicas is far above the controller's ceiling.
    await h.kube.create(
        SCALING_POLICY, policy("absurd", prometheus.url, absurd, maxReplicas=100), h.namespace
    )

    async def moved() -> int:
        n = await _replicas(h)
        return n if n > 1 else 0

    assert await eventually(moved, within=20, interval=0.1) == 1 + STEP
    first_step = time.monotonic()

    async def decided() -> dict[str, Any] | None:
        status = await _status(h, "absurd")
        return status if status.get("lastDecision") else None

    # The status is written after the replicas.
    status = await eventually(decided, within=10)
    assert status["lastMetrics"] == {"absurd": 1e300}
    up = await h.event("ScaledUp", "1 -> 5", "at most +4 per 15s from 1")
    assert up["involvedObject"]["kind"] == "DynamoScalingPolicy"

    # The policy says it is capped, in a condition and a Warning Event.
    capped = _condition(status, "MaxReplicasCapped")
    assert (capped["status"], capped["reason"]) == ("True", "AboveClusterCeiling"), capped
    assert (
        f"maxReplicas 100 is above the controller's cluster-wide ceiling (--max-policy-replicas) of {CEILING}"
        in (capped["message"])
    )
    warning = await h.event("MaxReplicasCapped", f"at most {CEILING} replicas")
    assert warning["type"] == "Warning"

    # Nothing more within the period, though every evaluation (each second) still wants 2**31 - 1.
    while (await _replicas(h)) == 1 + STEP:
        assert time.monotonic() - first_step < PERIOD_S + 10, "no second step within the next period"
        await asyncio.sleep(0.2)
    took = time.monotonic() - first_step
    # The second step comes a period after 1 was last seen (the first step's write is seen within ~1 s).
    assert took >= PERIOD_S - 1, f"a second step after {took:.1f}s, inside the {PERIOD_S:g}s period"
    # The period allows 5 + max(4, 300 % of 5) = 20; the ceiling holds it at 8.
    assert await _replicas(h) == CEILING
    await h.event("ScaledUp", f"5 -> {CEILING}", f"cluster ceiling {CEILING}")
    for _ in range(10):
        assert await _replicas(h) == CEILING
        await asyncio.sleep(0.3)
    status = await _status(h, "absurd")
    assert status["desiredReplicas"] == CEILING
    assert f"cluster ceiling {CEILING}" in status["lastDecision"]["reason"], status["lastDecision"]


async def test_unusable_totals_are_refused_and_move_nothing(
    harness: Harness, nodes: None, prometheus: LocalPrometheus
) -> None:
    h = harness
    await h.apply_dgd(dgd_manifest("scaled", replicas=2))
    metrics = [
        {"name": "nan", "query": "vector(0) / 0", "targetPerReplica": 1},
        {"name": "inf", "query": "vector(1) / 0", "targetPerReplica": 1},
        {"name": "negative", "query": "vector(-5)", "targetPerReplica": 1},
    ]
    await h.kube.create(SCALING_POLICY, policy("broken", prometheus.url, metrics, maxReplicas=6), h.namespace)

    async def reported() -> dict[str, Any] | None:
        status = await _status(h, "broken")
        c = _find(status, "MetricsAvailable")
        return status if c and c["status"] == "False" else None

    status = await eventually(reported, within=15)
    c = _condition(status, "MetricsAvailable")
    assert c["reason"] == "UnusableValue", c
    for name, shown in (("nan", "nan"), ("inf", "inf"), ("negative", "-5")):
        assert f"{name}: the query returned {shown}; a total must be a finite number >= 0" in c["message"]
    # Written as null (no usable value), which also keeps the status JSON valid for NaN and inf.
    assert status["lastMetrics"] == {"nan": None, "inf": None, "negative": None}
    active = _condition(status, "ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "Holding"), active
    assert active["message"] == (
        "hold 2: metrics missing: nan (unusable value nan), inf (unusable value inf), "
        "negative (unusable value -5.0)"
    )
    ready = _condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "MetricsUnavailable"), ready
    capped = _condition(status, "MaxReplicasCapped")
    assert (capped["status"], capped["reason"]) == ("False", "WithinCeiling"), capped
    await asyncio.sleep(3)
    assert await _replicas(h) == 2
