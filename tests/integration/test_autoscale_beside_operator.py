"""The autoscaler in mode dynamo-operator, on the real apiserver with NVIDIA's Dynamo operator's DGD CRD
serving v1beta1: a DynamoScalingPolicy over a real Prometheus (scraping a fake vLLM exporter) scales its
component through the component's DynamoGraphDeploymentScalingAdapter's scale subresource where the DGDSA
CRD is installed (the operator's part played by tests/helpers/dgdsa.OperatorStandIn), else by writing the
v1beta1 component's replicas; a component that does not exist is a condition and an Event. The controller
creates no pod for the operator's DGD."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.autoscale.targets import Found, OperatorDgds, ScaleFailed
from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.controller.config import CONTROLLER_NAME, ControllerConfig, InstallMode
from dynamo_snapshot.kube import EVENT, POD, Kube, Obj
from dynamo_snapshot.kube.kinds import SCALING_POLICY
from dynamo_snapshot_dev.localcluster import LocalCluster, LocalPrometheus
from tests.autoscale.exporter import FakeVllmExporter
from tests.controller.conftest import eventually
from tests.helpers import dgd_crd, dgdsa
from tests.helpers.dgdsa import ADAPTER, DGD_V1BETA1, STAND_IN_MANAGER, adapter_name, operator_stand_in
from tests.helpers.prometheus import local_prometheus

pytestmark = pytest.mark.cluster

WAITING = "vllm:num_requests_waiting"
WORKER = "VllmWorker"


@pytest.fixture(scope="module")
def exporter() -> Iterator[FakeVllmExporter]:
    made = FakeVllmExporter(["worker-0"])
    yield made
    made.stop()


@pytest.fixture(scope="module")
def prometheus(
    exporter: FakeVllmExporter, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPrometheus]:
    with local_prometheus([exporter.address], tmp_path_factory.mktemp("prometheus")) as server:
        yield server


@pytest.fixture
def operator_crd(cluster: LocalCluster, crds: list[str], namespace: str) -> Iterator[None]:
    with dgd_crd.dgd_crd_as(cluster, dgd_crd.operators_v1beta1()):
        yield


@pytest.fixture
async def tests_kube(api: client.ApiClient) -> Kube:
    return Kube(api, field_manager="tests")


@contextlib.asynccontextmanager
async def controller(api: client.ApiClient, namespace: str) -> AsyncIterator[None]:
    """The controller in mode dynamo-operator, writing as the controller's own field manager."""
    kube = Kube(api, field_manager=CONTROLLER_NAME)
    config = ControllerConfig(
        mode=InstallMode.DYNAMO_OPERATOR,
        namespace=namespace,
        leader_elect=False,
        metrics_port=0,
        drain_timeout=5,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(build_controller(kube, config).run_until(stop))
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30)


def dgd_v1beta1(name: str) -> Obj:
    """The worker second in spec.components: its index is not 0."""
    main = {"name": "main", "image": "nvcr.io/nvidia/ai-dynamo/vllm-runtime:1.3.1"}
    return {
        "metadata": {"name": name},
        "spec": {
            "backendFramework": "vllm",
            "components": [
                {"name": "Frontend", "type": "frontend", "replicas": 1},
                {
                    "name": WORKER,
                    "type": "worker",
                    "replicas": 1,
                    "podTemplate": {"spec": {"containers": [main]}},
                },
            ],
        },
    }


def policy(name: str, url: str, service: str = WORKER) -> Obj:
    return {
        "metadata": {"name": name},
        "spec": {
            "target": {"dgdName": "scaled", "serviceName": service},
            "minReplicas": 1,
            "maxReplicas": 6,
            "metrics": [{"name": "waiting", "query": f"sum({WAITING})", "targetPerReplica": 10}],
            "evaluationIntervalSeconds": 1,
            "prometheusUrl": url,
        },
    }


def component_replicas(dgd: Obj, component: str) -> int | None:
    entry = next(c for c in dgd["spec"]["components"] if c["name"] == component)
    return entry.get("replicas")


def managers(obj: Obj) -> set[tuple[str, str]]:
    """(manager, subresource) of every managedFields entry."""
    return {
        (m.get("manager", ""), m.get("subresource", "")) for m in obj["metadata"].get("managedFields") or []
    }


async def no_pods(kube: Kube, namespace: str) -> None:
    pods, _ = await kube.list_all(POD, namespace)
    assert pods == [], [p["metadata"]["name"] for p in pods]


async def events_of(kube: Kube, namespace: str, reason: str) -> list[Obj]:
    items, _ = await kube.list_all(EVENT, namespace)
    return [e for e in items if e.get("reason") == reason]


async def test_scales_through_the_adapters_scale_subresource(
    cluster: LocalCluster,
    operator_crd: None,
    api: client.ApiClient,
    tests_kube: Kube,
    namespace: str,
    exporter: FakeVllmExporter,
    prometheus: LocalPrometheus,
) -> None:
    kube = tests_kube
    exporter.set(WAITING, 0)
    with dgdsa.dgdsa_crd_installed(cluster):
        await kube.create(DGD_V1BETA1, dgd_v1beta1("scaled"), namespace)
        async with operator_stand_in(kube, namespace), controller(api, namespace):
            name = adapter_name("scaled", WORKER)

            async def adapter() -> Obj:
                return await kube.get(ADAPTER, name, namespace)

            await eventually(adapter, within=15)
            await kube.create(SCALING_POLICY, policy("waiting", prometheus.url), namespace)
            # 40 waiting at 10 per replica: 4 replicas, asked of the adapter.
            exporter.set(WAITING, 40)

            async def adapter_at_4() -> Obj | None:
                a = await adapter()
                return a if a["spec"]["replicas"] == 4 else None

            scaled = await eventually(adapter_at_4, within=30)
            assert (CONTROLLER_NAME, "scale") in managers(scaled), managers(scaled)

            # The operator (its stand-in) carries it to the DGD's component; the controller wrote no DGD.
            async def dgd_at_4() -> Obj | None:
                dgd = await kube.get(DGD_V1BETA1, "scaled", namespace)
                return dgd if component_replicas(dgd, WORKER) == 4 else None

            dgd = await eventually(dgd_at_4, within=15)
            assert component_replicas(dgd, "Frontend") == 1
            dgd_managers = {m for m, _ in managers(dgd)}
            assert CONTROLLER_NAME not in dgd_managers, dgd_managers
            assert STAND_IN_MANAGER in dgd_managers, dgd_managers

            async def status_says_4() -> Obj | None:
                st = (await kube.get(SCALING_POLICY, "waiting", namespace)).get("status") or {}
                return st if st.get("desiredReplicas") == 4 and st.get("currentReplicas") == 4 else None

            await eventually(status_says_4, within=10)
            ups = [e for e in await events_of(kube, namespace, "ScaledUp") if "1 -> 4" in e["message"]]
            assert any(f"through DynamoGraphDeploymentScalingAdapter {name}" in e["message"] for e in ups), (
                ups
            )
            await no_pods(kube, namespace)


async def test_writes_the_v1beta1_component_without_adapters(
    operator_crd: None,
    api: client.ApiClient,
    tests_kube: Kube,
    namespace: str,
    exporter: FakeVllmExporter,
    prometheus: LocalPrometheus,
) -> None:
    kube = tests_kube
    exporter.set(WAITING, 0)
    await kube.create(DGD_V1BETA1, dgd_v1beta1("scaled"), namespace)
    async with controller(api, namespace):
        await kube.create(SCALING_POLICY, policy("waiting", prometheus.url), namespace)
        await kube.create(SCALING_POLICY, policy("nowhere", prometheus.url, service="Nope"), namespace)
        # 40, as the previous test left Prometheus: a sample still scraped from then asks the same.
        exporter.set(WAITING, 40)

        async def dgd_at_4() -> Obj | None:
            dgd = await kube.get(DGD_V1BETA1, "scaled", namespace)
            return dgd if component_replicas(dgd, WORKER) == 4 else None

        dgd = await eventually(dgd_at_4, within=30)
        assert component_replicas(dgd, "Frontend") == 1
        assert CONTROLLER_NAME in {m for m, _ in managers(dgd)}

        async def not_found() -> dict[str, Any] | None:
            obj = await kube.get(SCALING_POLICY, "nowhere", namespace)
            ready = next(
                (c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == "Ready"), None
            )
            return ready if ready and ready["reason"] == "TargetNotFound" else None

        ready = await eventually(not_found, within=15)
        assert ready["status"] == "False"
        assert ready["message"] == "component Nope of scaled does not exist", ready
        events = await eventually(lambda: events_of(kube, namespace, "TargetNotFound"), within=15)
        assert [(e["type"], e["involvedObject"]["name"]) for e in events] == [("Warning", "nowhere")], events
        await no_pods(kube, namespace)


async def test_a_reordered_component_is_not_scaled_in_its_place(
    operator_crd: None, api: client.ApiClient, tests_kube: Kube, namespace: str
) -> None:
    kube = tests_kube
    await kube.create(DGD_V1BETA1, dgd_v1beta1("scaled"), namespace)
    targets = OperatorDgds(Kube(api, field_manager=CONTROLLER_NAME), namespace)
    await targets.open()
    try:

        async def found() -> Found | None:
            f = targets.find(namespace, "scaled", WORKER)
            return f if isinstance(f, Found) else None

        worker = await eventually(found, within=10)
        assert (worker.index, worker.adapter, worker.replicas) == (1, None, 1)
        # Someone reorders the components after the read: index 1 is the Frontend now.
        dgd = await kube.get(DGD_V1BETA1, "scaled", namespace)
        dgd["spec"]["components"].reverse()
        await kube.replace(DGD_V1BETA1, dgd)
        with pytest.raises(ScaleFailed) as failed:
            await targets.scale(worker, 5)
        assert failed.value.reason == "ScaleConflict", failed.value.message
        after = await kube.get(DGD_V1BETA1, "scaled", namespace)
        assert [c.get("replicas") for c in after["spec"]["components"]] == [1, 1]
        assert targets.find(namespace, "scaled", "Nope") == "component Nope of scaled"
    finally:
        await targets.close()
