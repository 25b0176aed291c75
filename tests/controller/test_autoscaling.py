"""The autoscaler end to end: a real Prometheus scraping a fake vLLM exporter, the real controller (DGD
reconciler + autoscaler) against the real control plane, the agent's role played by the double.

Load rises -> the policy scales up -> restore pods exist within an evaluation interval of Prometheus
seeing the crossing; load falls -> nothing is removed before the scale-down window; Prometheus gone ->
replicas held and the policy says why; bad queries -> a Condition with Prometheus' reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import Obj
from dynamo_snapshot.kube.kinds import SCALING_POLICY
from dynamo_snapshot_dev.localcluster import LocalPrometheus
from tests.autoscale.exporter import FakeVllmExporter
from tests.controller.conftest import Harness, dgd_manifest, eventually
from tests.helpers.prometheus import local_prometheus

pytestmark = pytest.mark.cluster

WAITING = "vllm:num_requests_waiting"


@pytest.fixture
def nodes(gpu_node: Callable[..., dict[str, Any]]) -> None:
    for _ in range(2):
        gpu_node(product="NVIDIA-H200", gpus=8, driver_major=580)


@pytest.fixture
def exporter() -> Iterator[FakeVllmExporter]:
    made = FakeVllmExporter(["worker-0"])
    yield made
    made.stop()


@pytest.fixture
def prometheus(exporter: FakeVllmExporter, tmp_path: Any) -> Iterator[LocalPrometheus]:
    with local_prometheus([exporter.address], tmp_path / "prometheus") as server:
        yield server


def policy(name: str, url: str, *, query: str = f"sum({WAITING})", **spec: Any) -> Obj:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoScalingPolicy",
        "metadata": {"name": name},
        "spec": {
            "target": {"dgdName": "scaled", "serviceName": "VllmWorker"},
            "minReplicas": 1,
            "maxReplicas": 6,
            "metrics": [{"name": "waiting", "query": query, "targetPerReplica": 10}],
            "evaluationIntervalSeconds": 1,
            "scaleDown": {"stabilizationWindowSeconds": 6, "graceSeconds": 0, "maxStep": 6},
            "prometheusUrl": url,
            **spec,
        },
    }


async def _ready_checkpoint(h: Harness) -> None:
    async def ready() -> bool:
        items = await h.checkpoints()
        return bool(items) and all((c.get("status") or {}).get("phase") == "Ready" for c in items)

    await eventually(ready, within=60)


async def _replicas(h: Harness) -> int:
    return int((await h.dgd("scaled"))["spec"]["services"]["VllmWorker"]["replicas"])


def _condition(obj: Obj, type_: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


async def test_load_scales_up_by_restore_and_down_after_the_window(
    harness: Harness, nodes: None, exporter: FakeVllmExporter, prometheus: LocalPrometheus
) -> None:
    h = harness
    await h.apply_dgd(dgd_manifest("scaled", replicas=1))
    await _ready_checkpoint(h)
    exporter.set(WAITING, 0)
    await h.kube.create(SCALING_POLICY, policy("waiting", prometheus.url), h.namespace)

    # 40 waiting at 10 per replica: 4 replicas, the 3 new ones restored from the checkpoint.
    exporter.set(WAITING, 40)
    crossed = time.monotonic()

    async def four_pods() -> list[Obj]:
        pods = await h.pods("scaled")
        return pods if len(pods) >= 4 else []

    pods = await eventually(four_pods, within=20, interval=0.1)
    took = time.monotonic() - crossed
    # Prometheus scrapes every 1 s and the policy evaluates every 1 s: the pods exist within scrape +
    # one interval + a reconcile; the bound is loose because this 2-core machine runs the whole
    # control plane and Prometheus beside the test (benchmarks/autoscale_crossing.py measures it).
    assert took < 8, f"restore pods took {took:.1f}s after the metric crossed"
    modes = sorted(p["metadata"]["labels"].get(protocol.LABEL_START_MODE) for p in pods)
    assert modes.count(protocol.StartMode.RESTORE.value) >= 3, modes
    assert await _replicas(h) == 4

    async def status_says_4() -> bool:
        st = (await h.kube.get(SCALING_POLICY, "waiting", h.namespace)).get("status") or {}
        return st.get("desiredReplicas") == 4 and st.get("lastMetrics", {}).get("waiting") == 40

    await eventually(status_says_4, within=10)
    # The policy's own Event (the DGD reconciler records ScaledUp on the DGD for any scale-up too).
    ups = await h.events("ScaledUp")
    ours = [e for e in ups if e["involvedObject"]["kind"] == "DynamoScalingPolicy"]
    assert any("1 -> 4" in e["message"] for e in ours), [e["message"] for e in ups]

    # Load gone: nothing is removed before the 6 s window has passed...
    exporter.set(WAITING, 0)
    dropped = time.monotonic()
    while time.monotonic() - dropped < 4:
        assert await _replicas(h) == 4, "scaled down inside the stabilization window"
        await asyncio.sleep(0.5)

    # ...and then back to the minimum.
    async def back_to_one() -> bool:
        return await _replicas(h) == 1

    await eventually(back_to_one, within=20)
    # The window runs from the last evaluation that still saw the load, which can precede the drop
    # by up to one evaluation interval (1 s).
    assert time.monotonic() - dropped >= 6 - 1

    # Prometheus gone: the count is held and the policy says why.
    exporter.set(WAITING, 30)
    prometheus.stop()

    async def unavailable() -> dict[str, Any] | None:
        obj = await h.kube.get(SCALING_POLICY, "waiting", h.namespace)
        c = _condition(obj, "MetricsAvailable")
        return c if c and c["status"] == "False" else None

    c = await eventually(unavailable, within=15)
    assert c["reason"] == "PrometheusUnavailable", c
    assert "unreachable" in c["message"] or "refused" in c["message"], c
    await asyncio.sleep(3)
    assert await _replicas(h) == 1


@pytest.mark.parametrize(
    ("query", "reason", "words"),
    [
        (f"sum({WAITING}", "InvalidQuery", "parse error"),
        (WAITING, "InvalidQuery", "returned 2 series"),
    ],
    ids=["bad-promql", "several-series"],
)
async def test_bad_queries_are_reported_and_change_nothing(
    harness: Harness,
    nodes: None,
    exporter: FakeVllmExporter,
    prometheus: LocalPrometheus,
    query: str,
    reason: str,
    words: str,
) -> None:
    h = harness
    second = FakeVllmExporter(["worker-1"])
    try:
        exporter.set(WAITING, 5)
        second.set(WAITING, 5)
        prometheus.set_targets([*prometheus.targets, second.address])
        prometheus.wait_targets_up()
        await h.apply_dgd(dgd_manifest("scaled", replicas=2))
        await _ready_checkpoint(h)
        await h.kube.create(SCALING_POLICY, policy("bad", prometheus.url, query=query), h.namespace)

        async def reported() -> dict[str, Any] | None:
            obj = await h.kube.get(SCALING_POLICY, "bad", h.namespace)
            c = _condition(obj, "MetricsAvailable")
            return c if c and c["status"] == "False" else None

        c = await eventually(reported, within=15)
        assert c["reason"] == reason, c
        assert words in c["message"], c
        await asyncio.sleep(2)
        obj = await h.kube.get(SCALING_POLICY, "bad", h.namespace)
        assert await _replicas(h) == 2, obj.get("status")
    finally:
        second.stop()


async def test_missing_target_is_a_condition(harness: Harness, prometheus: LocalPrometheus) -> None:
    h = harness
    await h.kube.create(SCALING_POLICY, policy("orphan", prometheus.url), h.namespace)

    async def reported() -> dict[str, Any] | None:
        obj = await h.kube.get(SCALING_POLICY, "orphan", h.namespace)
        c = _condition(obj, "Ready")
        return c if c and c["reason"] == "TargetNotFound" else None

    c = await eventually(reported, within=10)
    assert "DynamoGraphDeployment scaled does not exist" in c["message"]
