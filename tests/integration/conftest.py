"""Fixtures of the integration tests: the controller and a node agent on the real kubelet node."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.criu import Criu
from dynamo_snapshot.kube import Kube
from dynamo_snapshot_dev.localcluster.realnode import RealNode
from tests.helpers.kubelet_stack import Stack


@pytest.fixture
async def stack(
    api: client.ApiClient,
    namespace: str,
    crds: list[str],
    real_node: RealNode,
    criu_bin: Path,
    tmp_path: Path,
) -> AsyncIterator[Stack]:
    s = Stack(
        Kube(api, field_manager="kubelet-e2e"),
        namespace,
        real_node,
        Criu(criu_bin),
        tmp_path / "state",
        tmp_path / "artifacts",
    )
    s.start_controller()
    try:
        yield s
    finally:
        await s.close()
