"""The standalone controller runs DGDs stored at v1beta1 with ``crds/`` as installed and no conversion
webhook anywhere: Dynamo's upstream example, applied unchanged, gets its pods, owned at v1beta1 (so the
garbage collector deletes them with the DGD); its status is written in v1beta1's fields; a scale written
at v1beta1 is followed. With the chart's arrangement (v1alpha1 served too, converted by the webhook) a
v1alpha1 manifest runs the same way, the controller still reading v1beta1."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dynamo_snapshot.api import protocol
from dynamo_snapshot.kube import POD, Obj
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.controller.conftest import Harness, dgd_manifest, eventually
from tests.helpers.dgd_conversion import every_version_served, kubectl

FIXTURES = Path(__file__).resolve().parents[1] / "api" / "fixtures" / "dgd_v1beta1"
EXAMPLE = yaml.safe_load((FIXTURES / "vllm-agg.yaml").read_text(encoding="utf-8"))
GRAPH = EXAMPLE["metadata"]["name"]


async def _components(h: Harness, graph: str, *wanted: str) -> list[Obj]:
    pods = await h.pods(graph)
    found = {p["metadata"]["labels"].get(protocol.LABEL_SERVICE, "") for p in pods}
    return pods if found >= set(wanted) else []


async def _get(cluster: LocalCluster, *args: str) -> str:
    proc = await kubectl(cluster, "get", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


async def test_an_upstream_v1beta1_dgd_runs_with_crds_alone(cluster: LocalCluster, harness: Harness) -> None:
    h, ns = harness, harness.namespace
    proc = await kubectl(cluster, "apply", "-n", ns, "-f", "-", body=EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    pods = await eventually(lambda: _components(h, GRAPH, "Frontend", "VllmDecodeWorker"), within=60)
    uid = json.loads(await _get(cluster, "dgd", GRAPH, "-n", ns, "-o", "json"))["metadata"]["uid"]
    for pod in pods:
        [owner] = pod["metadata"]["ownerReferences"]
        assert (owner["apiVersion"], owner["kind"], owner["uid"]) == (
            "nvidia.com/v1beta1",
            "DynamoGraphDeployment",
            uid,
        )

    async def status_in_v1beta1_fields() -> Obj | None:
        status = json.loads(await _get(cluster, "dgd", GRAPH, "-n", ns, "-o", "json")).get("status") or {}
        components = status.get("components") or {}
        return status if {"Frontend", "VllmDecodeWorker"} <= set(components) else None

    status = await eventually(status_in_v1beta1_fields, within=30)
    assert "services" not in status
    assert {c["type"] for c in status["conditions"]} >= {"Ready", "Degraded", "Progressing"}
    # `kubectl get dgd` reads the stored version: its columns come from the v1beta1 object.
    table = await _get(cluster, "dgd", "-n", ns)
    assert table.split()[:3] == ["NAME", "READY", "BACKEND"]
    assert GRAPH in table

    # A scale written at v1beta1 (the component's replicas) is followed.
    index = [c["name"] for c in EXAMPLE["spec"]["components"]].index("VllmDecodeWorker")
    patch = [{"op": "replace", "path": f"/spec/components/{index}/replicas", "value": 2}]
    proc = await kubectl(cluster, "patch", "dgd", GRAPH, "-n", ns, "--type=json", "-p", json.dumps(patch))
    assert proc.returncode == 0, proc.stderr

    async def two_workers() -> bool:
        pods = await h.pods(GRAPH)
        return sum(p["metadata"]["labels"][protocol.LABEL_SERVICE] == "VllmDecodeWorker" for p in pods) == 2

    assert await eventually(two_workers, within=30)

    # Deleted, its pods go with it: the garbage collector follows their v1beta1 owner.
    await h.kill_controller()
    proc = await kubectl(cluster, "delete", "dgd", GRAPH, "-n", ns, "--wait=true", "--timeout=60s")
    assert proc.returncode == 0, proc.stderr

    async def pods_gone() -> bool:
        items, _ = await h.kube.list_all(POD, ns, label_selector=f"{protocol.LABEL_GRAPH}={GRAPH}")
        return not [p for p in items if not p["metadata"].get("deletionTimestamp")]

    assert await eventually(pods_gone, within=60)


async def test_with_v1alpha1_served_through_the_webhook_a_v1alpha1_dgd_runs_too(
    cluster: LocalCluster, harness: Harness, tmp_path: Path
) -> None:
    h, ns = harness, harness.namespace
    async with every_version_served(cluster, h.kube, ns, tmp_path) as server:
        manifest = {**dgd_manifest("alpha", replicas=2), "metadata": {"name": "alpha", "namespace": ns}}
        del manifest["spec"]["services"]["VllmWorker"]["checkpoint"]  # cold workers: no checkpoint needed
        proc = await kubectl(cluster, "create", "-f", "-", body=manifest)
        assert proc.returncode == 0, proc.stderr
        pods = await eventually(lambda: _components(h, "alpha", "VllmWorker"), within=60)
        assert {o["apiVersion"] for p in pods for o in p["metadata"]["ownerReferences"]} == {
            "nvidia.com/v1beta1"
        }

        # Read back at v1alpha1 through the webhook, the status the controller wrote at v1beta1.
        async def alpha_status() -> Obj | None:
            got = json.loads(
                await _get(
                    cluster, "dynamographdeployments.v1alpha1.nvidia.com", "alpha", "-n", ns, "-o", "json"
                )
            )
            return got if "VllmWorker" in ((got.get("status") or {}).get("services") or {}) else None

        assert await eventually(alpha_status, within=30)
        assert server.readiness() is None
