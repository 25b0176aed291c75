"""What the real kubelet says about workers it cannot start reaches the DGD: a worker image the node does
not have (and may not pull) and an environment that names a missing Secret make the DGD Degraded, each
service's line in the kubelet's own words, the reason the first one's kind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.kube import Kube, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot_dev.demo.scenario import kubelet_worker_spec, worker_graph
from dynamo_snapshot_dev.localcluster.realnode import RealNode
from tests.helpers.kubelet_stack import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]
GRAPH = "unstartable"


@pytest.fixture
async def kube(api: client.ApiClient, namespace: str, crds: list[str]) -> AsyncIterator[Kube]:
    """The controller in-process; nothing else runs the workers but the kubelet."""
    kube = Kube(api, field_manager="tests")
    config = ControllerConfig(
        namespace=namespace,
        leader_elect=False,
        resync_seconds=5,
        metrics_port=0,
        drain_timeout=5,
        autoscale=False,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(build_controller(kube, config).run_until(stop))
    try:
        yield kube
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


def _graph(node: RealNode) -> Obj:
    missing_image = kubelet_worker_spec(node, {}, port=8000)
    missing_image["mainContainer"]["image"] = "dynamo-snapshot-test/no-such-image:never"
    missing_secret = kubelet_worker_spec(node, {}, port=8000)
    missing_secret["mainContainer"]["env"].append(
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "no-such-secret", "key": "token"}}}
    )
    graph = worker_graph(GRAPH, "NoImage", missing_image)
    services: dict[str, Any] = graph["spec"]["services"]
    services["NoSecret"] = worker_graph(GRAPH, "NoSecret", missing_secret)["spec"]["services"]["NoSecret"]
    for spec in services.values():
        del spec["checkpoint"]  # only the kubelet's verdict matters here
    return graph


async def test_workers_the_kubelet_cannot_start_make_the_dgd_degraded_in_its_words(
    kube: Kube, namespace: str, real_node: RealNode
) -> None:
    await DgdClient(kube).create(_graph(real_node), namespace)

    async def degraded() -> dict[str, Any] | None:
        status = (await DgdClient(kube).get(GRAPH, namespace)).get("status") or {}
        found: dict[str, Any] = next(
            (c for c in status.get("conditions") or [] if c["type"] == "Degraded"), {}
        )
        message = str(found.get("message") or "")
        both = "service NoImage: ImagePullFailed" in message and "service NoSecret: ConfigError" in message
        return dict(found) if found.get("status") == "True" and both else None

    said = await eventually(degraded, 90, "the kubelet's reasons in the DGD's Degraded condition")
    assert said["reason"] == "ImagePullFailed"
    message = said["message"]
    assert "ErrImageNeverPull" in message
    assert "dynamo-snapshot-test/no-such-image:never" in message
    assert "CreateContainerConfigError" in message
    assert 'secret "no-such-secret" not found' in message
