"""Shared fixtures: a real local control plane (session), namespaces and fake GPU nodes (per test).

Nothing here fakes Kubernetes: every fixture talks to the etcd, kube-apiserver, kube-scheduler,
kube-controller-manager and kwok built by scripts/test-env.sh, and the object store is SeaweedFS.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes_asyncio import client, config

from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot_dev.localcluster import LocalCluster, LocalClusterError
from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError, cache_dir
from dynamo_snapshot_dev.localcluster.link import shaped_link
from dynamo_snapshot_dev.localcluster.realnode import RealNode, RealNodeError
from dynamo_snapshot_dev.localcluster.s3server import LocalS3

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the real node run last: once started, it stays in the session's cluster, and tests that
    count the cluster's nodes (failover's share of lost nodes) must not see it."""
    items.sort(key=lambda item: item.get_closest_marker("kubelet") is not None)


def _fail(msg: str) -> None:
    # One clear line instead of a traceback: the fix is almost always "run scripts/test-env.sh".
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3]:
    """A real S3-compatible server (SeaweedFS) for the session; each test takes buckets of its own."""
    try:
        server = LocalS3()
    except ComponentsMissingError as e:
        _fail(str(e))
    with server:
        yield server


@pytest.fixture
async def s3_location(s3_server: LocalS3) -> S3Location:
    """A bucket of this test's own on ``s3_server``, prefix ``s/``."""
    return S3Location(endpoint=s3_server.endpoint, bucket=await s3_server.new_bucket(), prefix="s/")


SlowS3 = Callable[[S3Location, float], contextlib.AbstractAsyncContextManager[S3Location]]


@pytest.fixture
def slow_s3(s3_server: LocalS3) -> SlowS3:
    """``slow_s3(location, bytes_per_s)``: ``location`` reached through a link of that bandwidth."""

    @contextlib.asynccontextmanager
    async def link(location: S3Location, bytes_per_s: float) -> AsyncIterator[S3Location]:
        upstream = urlsplit(s3_server.endpoint)
        assert upstream.hostname is not None
        assert upstream.port is not None
        async with shaped_link(upstream.hostname, upstream.port, bytes_per_s=bytes_per_s) as hostport:
            yield location.model_copy(update={"endpoint": f"http://{hostport}"})

    return link


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("cluster")
    lc = LocalCluster(workdir)
    try:
        lc.start()
    except (LocalClusterError, ComponentsMissingError) as e:
        _fail(f"local control plane: {e}")
    yield lc
    lc.stop()


@pytest.fixture
def real_node(cluster: LocalCluster) -> RealNode:
    """The real kubelet + containerd node in the session's cluster, started (again) for tests that ask
    for it (mark them `kubelet`); it stays up for the next one. It is tainted: its pods use
    `real_node.pod_overrides()`."""
    if os.geteuid() != 0:
        _fail("the real node needs root: re-run the test command with sudo")
    try:
        return cluster.start_real_node()
    except (RealNodeError, ComponentsMissingError, LocalClusterError) as e:
        _fail(f"real node: {e}")
        raise


@pytest.fixture
def no_real_node(cluster: LocalCluster) -> None:
    """One real node per machine: tests that start their own (the demo, in a subprocess) stop the
    session's first."""
    cluster.stop_real_node()


@pytest.fixture(scope="session")
def crds(cluster: LocalCluster) -> list[str]:
    """Install every CRD (the generated ones, which crds/ holds: tests/api/test_crd_drift.py) and wait
    until the apiserver serves them."""
    return cluster.install_crds()


@pytest.fixture(scope="module")
def v1alpha1_served(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """For a module's tests: DynamoGraphDeployments served at v1alpha1 too, converted by a webhook of this
    process, as the chart serves them (crds/ serves v1beta1 alone); crds/ as installed again after. (It
    installs the CRDs itself: a module that wants it overrides ``crds`` with it.)"""
    from tests.helpers.dgd_conversion import every_version_served_sync

    cluster.install_crds()
    with every_version_served_sync(cluster, tmp_path_factory.mktemp("dgd-conversion")):
        yield


@pytest.fixture
async def api(cluster: LocalCluster) -> AsyncIterator[client.ApiClient]:
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    async with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture
def gpu_node(cluster: LocalCluster) -> Iterator[Callable[..., dict[str, Any]]]:
    """Factory: gpu_node(product=..., gpus=..., driver_major=...) -> the Node manifest it created."""
    made: list[str] = []

    def make(name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        node_name = name or f"gpu-{uuid.uuid4().hex[:8]}"
        made.append(node_name)
        return cluster.add_gpu_node(node_name, **kwargs)

    yield make
    if made:
        cluster.kubectl("delete", "node", *made, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="session")
def criu_bin() -> Path:
    """The CRIU >= 4 binary; tests that use it run for real, as root."""
    if os.geteuid() != 0:
        _fail("CRIU tests must run as root: re-run the test command with sudo")
    path = cache_dir() / "bin" / "criu"
    if not os.access(path, os.X_OK):
        found = shutil.which("criu")
        if not found:
            _fail(f"criu is missing in {path.parent}: run scripts/test-env.sh")
        path = Path(found)
    return path
