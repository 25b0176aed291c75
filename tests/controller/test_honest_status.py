"""Honest DGD status against the real control plane: every service of the upstream examples runs or is
reported as not run, Ready only when every service is, and what the apiserver refuses (a quota, admission,
a pod field the CRD schema cannot check) becomes a condition and one Event, retried with backoff, with no
traceback in the controller's log."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.dynamo.dgd_reconciler import DGDReconciler
from dynamo_snapshot.kube import POD, Obj, ResourceKind
from dynamo_snapshot.kube.kinds import DGD
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.nodes import gpu_node_manifest
from tests.api.examples import MANIFEST_DIR, load_manifest

from .conftest import Harness, eventually

pytestmark = pytest.mark.cluster
NodeFactory = Callable[..., dict[str, Any]]
SERVICE_ACCOUNT = ResourceKind("", "v1", "serviceaccounts", "ServiceAccount")
RESOURCE_QUOTA = ResourceKind("", "v1", "resourcequotas", "ResourceQuota")


def _example(file: str) -> Obj:
    return load_manifest(MANIFEST_DIR / file)


def _condition(dgd: Obj, type_: str) -> dict[str, Any]:
    for c in (dgd.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def _ready(pod: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


async def _by_service(h: Harness, graph: str) -> dict[str, list[Obj]]:
    out: dict[str, list[Obj]] = {}
    for pod in await h.pods(graph):
        out.setdefault(pod["metadata"]["labels"][protocol.LABEL_SERVICE], []).append(pod)
    return out


async def _counts(h: Harness, graph: str) -> dict[str, int]:
    return {svc: len(pods) for svc, pods in (await _by_service(h, graph)).items()}


async def _namespace_ready(h: Harness) -> None:
    # A namespace's "default" ServiceAccount comes a moment after the namespace; until then the apiserver
    # refuses every pod, which these tests would count as a refusal of their own.
    await eventually(lambda: h.kube.get(SERVICE_ACCOUNT, "default", h.namespace))


async def _dgd_ready(h: Harness, graph: str) -> Obj | None:
    dgd = await h.dgd(graph)
    return dgd if _condition(dgd, "Ready").get("status") == "True" else None


def _main(pod: Obj) -> Obj:
    container: Obj = pod["spec"]["containers"][0]
    assert container["name"] == "main"
    return container


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    failed = [r for r in caplog.records if r.exc_info or r.getMessage() == "reconcile failed"]
    assert not failed, [f"{r.name}: {r.getMessage()}" for r in failed]


@pytest.fixture
def storage_node(cluster: LocalCluster) -> Iterator[Callable[[], str]]:
    """Factory: a kwok GPU node that, unlike the `gpu_node` ones, has ephemeral storage to offer."""
    made: list[str] = []

    def make() -> str:
        manifest = gpu_node_manifest(f"gpu-eph-{uuid.uuid4().hex[:8]}")
        for key in ("capacity", "allocatable"):
            manifest["status"][key]["ephemeral-storage"] = "1Ti"
        cluster.apply(manifest)
        made.append(manifest["metadata"]["name"])
        return str(manifest["metadata"]["name"])

    yield make
    if made:
        cluster.kubectl("delete", "node", *made, "--wait=false", "--ignore-not-found", check=False)


async def test_vllm_disagg_runs_every_service_scales_and_replaces_a_lost_frontend(
    harness: Harness, gpu_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    gpu_node(gpus=8)
    await _namespace_ready(h)
    await h.apply_dgd(_example("dgd-vllm-disagg.yaml"))
    want = {"Frontend": 1, "VllmDecodeWorker": 2, "VllmPrefillWorker": 1}

    async def all_running() -> dict[str, list[Obj]] | None:
        pods = await _by_service(h, "vllm-disagg")
        counts = {svc: len(p) for svc, p in pods.items()}
        return pods if counts == want and all(_ready(p) for ps in pods.values() for p in ps) else None

    pods = await eventually(all_running, within=60)
    for svc, service_pods in pods.items():
        for pod in service_pods:
            labels = pod["metadata"]["labels"]
            assert labels[protocol.LABEL_MANAGED_BY] == protocol.MANAGED_BY_VALUE
            assert labels[protocol.LABEL_GRAPH] == "vllm-disagg"
            assert labels[protocol.LABEL_START_MODE] == protocol.StartMode.COLD.value
            assert protocol.CONTROL_VOLUME_NAME not in {v["name"] for v in pod["spec"].get("volumes") or []}
            if svc != "Frontend":
                assert _main(pod)["command"] == ["python3", "-m", "dynamo.vllm"]
    frontend = _main(pods["Frontend"][0])
    assert (frontend["command"], frontend["args"]) == (["python3"], ["-m", "dynamo.frontend"])

    dgd = await eventually(lambda: _dgd_ready(h, "vllm-disagg"))
    assert dgd["status"]["state"] == "successful"
    assert {s: v["readyReplicas"] for s, v in dgd["status"]["services"].items()} == want
    assert _condition(dgd, "Degraded")["status"] == "False"

    # Scaled like any service: down to one decode worker.
    await h.scale("vllm-disagg", 1, service="VllmDecodeWorker")
    await eventually(lambda: _only(h, "vllm-disagg", {**want, "VllmDecodeWorker": 1}))

    # Failed over like any cold-start service: a Frontend deleted by someone else is replaced.
    lost = pods["Frontend"][0]["metadata"]["name"]
    await h.kube.delete(POD, lost, h.namespace)
    await h.event("WorkerLost", lost)

    async def replaced() -> bool:
        frontends = (await _by_service(h, "vllm-disagg")).get("Frontend") or []
        return len(frontends) == 1 and frontends[0]["metadata"]["name"] != lost and _ready(frontends[0])

    await eventually(replaced, within=30)
    await eventually(lambda: _dgd_ready(h, "vllm-disagg"), within=30)
    _no_traceback(caplog)


async def _only(h: Harness, graph: str, want: dict[str, int]) -> bool:
    return await _counts(h, graph) == want


async def test_vllm_agg_is_not_ready_while_its_worker_cannot_be_placed(
    harness: Harness, gpu_node: NodeFactory, storage_node: Callable[[], str]
) -> None:
    h = harness
    # The worker asks for 2Gi of ephemeral storage, which no `gpu_node` offers: it stays Pending.
    gpu_node(gpus=8)
    await _namespace_ready(h)
    await h.apply_dgd(_example("dgd-vllm-agg.yaml"))

    async def frontend_up_worker_pending() -> dict[str, list[Obj]] | None:
        pods = await _by_service(h, "vllm-agg")
        frontend, worker = pods.get("Frontend") or [], pods.get("VllmWorker") or []
        up = len(frontend) == 1 and _ready(frontend[0])
        return pods if up and len(worker) == 1 and not worker[0]["spec"].get("nodeName") else None

    await eventually(frontend_up_worker_pending, within=60)

    async def honest() -> Obj | None:
        dgd = await h.dgd("vllm-agg")
        services = (dgd.get("status") or {}).get("services") or {}
        return dgd if (services.get("Frontend") or {}).get("readyReplicas") == 1 else None

    dgd = await eventually(honest)
    ready = _condition(dgd, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasNotReady")
    assert "VllmWorker: 0/1 ready" in ready["message"]
    assert dgd["status"]["services"]["VllmWorker"]["readyReplicas"] == 0
    assert dgd["status"]["state"] == "pending"
    await asyncio.sleep(2.0)
    assert _condition(await h.dgd("vllm-agg"), "Ready")["status"] == "False"

    # Room for it: the worker starts, and only now is the graph Ready.
    storage_node()
    dgd = await eventually(lambda: _dgd_ready(h, "vllm-agg"), within=60)
    assert dgd["status"]["services"]["VllmWorker"]["readyReplicas"] == 1
    worker = (await _by_service(h, "vllm-agg"))["VllmWorker"][0]
    assert _ready(worker)


async def test_sglang_frontend_runs_while_its_checkpoint_ref_workers_wait(
    harness: Harness, gpu_node: NodeFactory
) -> None:
    h = harness
    gpu_node(gpus=8)
    await _namespace_ready(h)
    await h.apply_dgd(_example("dgd-sglang-checkpoint-ref.yaml"))

    async def frontend_ready() -> Obj | None:
        dgd = await h.dgd("sglang-prewarmed")
        services = (dgd.get("status") or {}).get("services") or {}
        return dgd if (services.get("Frontend") or {}).get("readyReplicas") == 1 else None

    dgd = await eventually(frontend_ready, within=60)
    ready = _condition(dgd, "Ready")
    assert ready["status"] == "False"
    assert "decode: 0/3 ready" in ready["message"]
    assert "prefill: 0/1 ready" in ready["message"]
    checkpoint = _condition(dgd, "CheckpointReady")
    assert checkpoint["status"] == "False"
    assert "qwen3-06b-sglang-prewarm" in checkpoint["message"]
    assert await _counts(h, "sglang-prewarmed") == {"Frontend": 1}


async def test_trtllm_runs_what_it_can_and_says_what_it_cannot(
    harness: Harness, gpu_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    gpu_node(gpus=8)
    await _namespace_ready(h)
    await h.apply_dgd(_example("dgd-trtllm-unmodeled-fields.yaml"))
    graph = "trtllm-everything"

    # The multinode worker is not run, and says so.
    not_run = await h.event("ServiceNotHandled", "TrtllmWorker", "multinode.nodeCount is 2")
    assert not_run["type"] == "Warning"
    # The Frontend names a ServiceAccount that does not exist: admission refuses its pods.
    refused = await h.event("PodCreateRejected", "Frontend", "dynamo-frontend")
    assert refused["type"] == "Warning"

    async def degraded() -> Obj | None:
        dgd = await h.dgd(graph)
        return dgd if _condition(dgd, "Degraded").get("reason") == "PodCreateRejected" else None

    dgd = await eventually(degraded)
    assert "dynamo-frontend" in _condition(dgd, "Degraded")["message"]
    ready = _condition(dgd, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ServiceNotHandled")
    assert "service TrtllmWorker is not run" in ready["message"]
    await eventually(lambda: _only(h, graph, {"Planner": 1}))

    # The missing ServiceAccount appears: the Frontend's pods follow at the next retry.
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "dynamo-frontend"}}
    await h.kube.create(SERVICE_ACCOUNT, account, h.namespace)
    await eventually(lambda: _only(h, graph, {"Planner": 1, "Frontend": 2}), within=30)

    async def only_the_worker_left() -> Obj | None:
        dgd = await h.dgd(graph)
        return dgd if _condition(dgd, "Degraded").get("reason") == "ServiceNotHandled" else None

    dgd = await eventually(only_the_worker_left, within=30)
    assert _condition(dgd, "Ready")["status"] == "False"
    assert dgd["status"]["services"]["TrtllmWorker"]["replicas"] == 0
    assert len(await h.events("ServiceNotHandled")) == 1
    _no_traceback(caplog)


async def test_a_quota_that_refuses_the_workers_is_a_condition_and_one_event_until_lifted(
    harness: Harness, gpu_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    gpu_node(gpus=8)
    await _namespace_ready(h)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-gpus"},
        "spec": {"hard": {"requests.nvidia.com/gpu": "0"}},
    }
    await h.kube.create(RESOURCE_QUOTA, quota, h.namespace)

    async def quota_counted() -> bool:
        got = await h.kube.get(RESOURCE_QUOTA, "no-gpus", h.namespace)
        return "requests.nvidia.com/gpu" in ((got.get("status") or {}).get("used") or {})

    await eventually(quota_counted)  # until then the apiserver refuses with "status unknown" instead
    await h.apply_dgd(_example("dgd-vllm-disagg.yaml"))

    async def refused() -> Obj | None:
        dgd = await h.dgd("vllm-disagg")
        return dgd if _condition(dgd, "Degraded").get("reason") == "PodCreateRejected" else None

    dgd = await eventually(refused)
    degraded = _condition(dgd, "Degraded")
    assert degraded["status"] == "True"
    assert "exceeded quota: no-gpus" in degraded["message"]
    assert "VllmDecodeWorker" in degraded["message"]
    assert _condition(dgd, "Ready")["status"] == "False"
    for worker in ("VllmDecodeWorker", "VllmPrefillWorker"):
        await h.event("PodCreateRejected", f"service {worker}:", "exceeded quota: no-gpus")
    # The Frontend asks for no GPU: it runs meanwhile.
    await eventually(lambda: _only(h, "vllm-disagg", {"Frontend": 1}))

    # Retried with backoff (1 s, 2 s, 4 s, ...), with one Event per service, not one per attempt.
    reconciler = cast(DGDReconciler, h.controller().reconcilers[DGD.kind])
    owner = (f"{h.namespace}/vllm-disagg", "VllmDecodeWorker")
    await eventually(lambda: _attempts(reconciler.refusals.current, owner, 3), within=20)
    events = await h.events("PodCreateRejected")
    assert sorted(e["message"].split(":")[0] for e in events) == [
        "service VllmDecodeWorker",
        "service VllmPrefillWorker",
    ]
    assert [e.get("count") for e in events] == [1, 1]
    _no_traceback(caplog)

    # The quota is lifted: the next retry creates the workers and the graph becomes Ready.
    await h.kube.delete(RESOURCE_QUOTA, "no-gpus", h.namespace)
    # The next retry comes within the backoff's cap (60 s), however far the backoff had gone.
    dgd = await eventually(lambda: _dgd_ready(h, "vllm-disagg"), within=90)
    assert _condition(dgd, "Degraded")["status"] == "False"
    assert await _counts(h, "vllm-disagg") == {"Frontend": 1, "VllmDecodeWorker": 2, "VllmPrefillWorker": 1}
    assert not reconciler.refusals.current
    _no_traceback(caplog)


async def _attempts(refusals: dict[tuple[str, str], Any], owner: tuple[str, str], at_least: int) -> bool:
    refusal = refusals.get(owner)
    return refusal is not None and refusal.attempts >= at_least


def _plain_service(**main: Any) -> Obj:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "odd"},
        "spec": {
            "services": {
                "Worker": {
                    "componentType": "worker",
                    "replicas": 1,
                    "extraPodSpec": {"mainContainer": {"image": "worker:test", "command": ["w"], **main}},
                }
            }
        },
    }


@pytest.mark.parametrize(
    ("bad", "fix", "words"),
    [
        ({"imagePullPolicy": "Sometimes"}, {"imagePullPolicy": "IfNotPresent"}, ["imagePullPolicy"]),
        (
            {"env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nothing"}}}]},
            {"env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]},
            ["fieldPath", "spec.nothing"],
        ),
    ],
    ids=["image-pull-policy", "env-value-from"],
)
async def test_a_pod_field_only_the_apiserver_can_check_is_a_condition_until_fixed(
    harness: Harness,
    gpu_node: NodeFactory,
    caplog: pytest.LogCaptureFixture,
    bad: Obj,
    fix: Obj,
    words: list[str],
) -> None:
    h = harness
    gpu_node(gpus=8)
    await _namespace_ready(h)
    manifest = _plain_service(**bad)
    await h.apply_dgd(manifest)  # the CRD schema admits it: mainContainer is any Container

    async def refused() -> Obj | None:
        dgd = await h.dgd("odd")
        return dgd if _condition(dgd, "Degraded").get("reason") == "PodCreateRejected" else None

    degraded = _condition(await eventually(refused), "Degraded")
    assert "422 Invalid" in degraded["message"]
    assert all(w in degraded["message"] for w in words), degraded["message"]
    event = await h.event("PodCreateRejected", "service Worker:", *words)
    assert event["type"] == "Warning"
    assert await h.pods("odd") == []

    # A fixed spec is a new generation: tried again at once, whatever the backoff had reached.
    fixed = copy.deepcopy(manifest["spec"]["services"]["Worker"]["extraPodSpec"]["mainContainer"])
    fixed.update(fix)
    patch = {"spec": {"services": {"Worker": {"extraPodSpec": {"mainContainer": fixed}}}}}
    await h.dgds.merge_patch("odd", h.namespace, patch)
    dgd = await eventually(lambda: _dgd_ready(h, "odd"), within=30)
    assert _condition(dgd, "Degraded")["status"] == "False"
    assert len(await h.events("PodCreateRejected")) == 1
    _no_traceback(caplog)
