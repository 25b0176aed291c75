"""The agent's local launch mode (kwok nodes, `dynamo-snapshot-demo`) runs commands, not images: a managed
pod whose main container has none (a service relying on its image's entrypoint, which the controller now
runs like any other) is said once and left alone, beside pods it does launch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.agent.watcher import workload_key
from dynamo_snapshot.kube import POD, Kube, Obj
from tests.agent.test_agent import _plain_pod, agents  # noqa: F401  (agents: the fixture)
from tests.controller.conftest import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.criu]


async def test_a_pod_without_a_command_is_not_launched_and_said_once(
    api: client.ApiClient,
    namespace: str,
    gpu_node: Callable[..., Obj],
    agents: Callable[..., Any],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = Kube(api)
    node = gpu_node()["metadata"]["name"]
    a = await agents(node)
    bare = _plain_pod("image-only", node)
    del bare["spec"]["containers"][0]["command"]
    await kube.create(POD, bare, namespace)
    await kube.create(POD, _plain_pod("commanded", node), namespace)

    async def launched(name: str) -> Any:
        return await a.runtime.find(workload_key(await kube.get(POD, name, namespace)))

    # Positive control: the same agent launches the pod that has a command.
    await eventually(lambda: launched("commanded"), within=30)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage() == "pod not launched"]

    await eventually(lambda: asyncio.sleep(0, result=said()), within=15)
    await asyncio.sleep(3.0)  # the agent's first retries come after 1 s and 2 s: none may follow
    assert said() == ["pod not launched"]
    assert await launched("image-only") is None
    assert not [r for r in caplog.records if r.exc_info], "a traceback for a pod that cannot be launched"
