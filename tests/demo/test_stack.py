"""The demo's node agents are built the way `dynamo-snapshot agent` builds its own: from an AgentConfig,
through agent_cmd.build, so the demo runs the agent's real configuration path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client

from dynamo_snapshot.agent.runtime import RuncRuntime
from dynamo_snapshot.agent.runtime.containerd import ContainerdRuntime
from dynamo_snapshot.cli import agent_cmd
from dynamo_snapshot.criu.runner import ENV_CRIU
from dynamo_snapshot.kube import Kube
from dynamo_snapshot_dev.demo.stack import REPO, Stack
from dynamo_snapshot_dev.localcluster.realnode import RUNC_ROOT


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    # Nothing is sent: the agent only needs a client to exist until it runs.
    async with client.ApiClient(client.Configuration()) as api:
        yield Kube(api)


async def test_demo_agents_come_from_an_agent_config(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")  # build() resolves CRIU; none runs here
    stack = Stack(tmp_path / "work", kubelet=False)
    config = stack.agent_config("gpu-node-1")
    # What the demo sets is what a config file could say: it survives the file's round trip.
    assert agent_cmd.AgentConfig.model_validate(config.model_dump(by_alias=True, mode="json")) == config
    agent = agent_cmd.build(config, kube)
    assert (agent.node_name, agent.launch_workloads) == ("gpu-node-1", True)
    assert agent.executor.store.root == stack.artifacts.root, "one artifact store for all nodes"
    assert str(REPO) in config.containers.host_binds, "the workers run this checkout"
    # Where the workers register: the one directory their containers may write.
    assert isinstance(agent.runtime, RuncRuntime)
    assert agent.runtime.writable_binds == [str(stack.endpoint_dir.resolve())]
    assert stack.agent_config("gpu-node-2").node.control_root != config.node.control_root


def test_writable_binds_is_a_setting_of_the_shipped_config() -> None:
    shipped = yaml.safe_load((REPO / "agent" / "config.yaml").read_text())
    assert shipped["containers"]["writableBinds"] == []
    assert agent_cmd.AgentConfig.model_validate({**shipped, "nodeName": "n"}).containers.writable_binds == []


async def test_the_kubelet_nodes_agent_uses_the_shipped_defaults(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")
    stack = Stack(tmp_path / "work")
    config = stack.agent_config("real-node")
    assert agent_cmd.AgentConfig.model_validate(config.model_dump(by_alias=True, mode="json")) == config
    containers = config.containers
    assert (containers.runtime, containers.launch_workloads, containers.runc_root) == (
        "containerd",
        False,
        RUNC_ROOT,
    )
    agent = agent_cmd.build(config, kube)
    assert isinstance(agent.runtime, ContainerdRuntime)
    assert agent.containers is agent.runtime, "the agent finds the kubelet's containers, it launches none"
    assert agent.executor.store.root == stack.artifacts.root
