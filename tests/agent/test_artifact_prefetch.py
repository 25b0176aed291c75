"""When a node fetches a checkpoint it lacks from the object store (a real SeaweedFS server), by the prefetch
policy: ``scheduled`` as soon as a restore pod of it is bound to the node (the check begun ahead of the
restore), ``none`` only when the restore starts, ``all`` on every node once the PodSnapshot is Ready (through
the real apiserver); concurrent wants of one artifact share one fetch, and what is not granted is not
fetched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.artifact_prefetch import ArtifactPrefetch
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.api.views import PodSnapshotView
from dynamo_snapshot.artifact import ArtifactStore, Binding, artifact_key
from dynamo_snapshot.artifact.s3 import S3Artifacts, S3Credentials, S3Location
from dynamo_snapshot.kube import MODIFIED, Kube
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, POD_SNAPSHOT_CONTENT
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.agent.local_node import local_executor
from tests.artifact.helpers import BINDING, KEY, publish, sample_files
from tests.helpers.ready_snapshot import ready_snapshot

FETCHES = "dynsnap_agent_object_store_transfers_total"


def fetches() -> float:
    return REGISTRY.get_sample_value(FETCHES, {"op": "fetch", "result": "done"}) or 0.0


@pytest.fixture
async def kube(api: client.ApiClient) -> Kube:
    return Kube(api, field_manager="prefetch-test")


@pytest.fixture
async def location(s3_server: LocalS3) -> S3Location:
    bucket = await s3_server.new_bucket()
    return S3Location(endpoint=s3_server.endpoint, bucket=bucket)


async def _in_store(tmp: Path, s3_server: LocalS3, location: S3Location, binding: Binding = BINDING) -> str:
    """A sealed artifact of ``binding`` written to the object store; its manifest digest."""
    store = ArtifactStore(tmp / "source")
    await publish(store, sample_files(), binding=binding)
    artifact = store.open(binding.key)
    async with S3Artifacts(location, S3Credentials(s3_server.access_key, s3_server.secret_key)) as s3:
        await s3.upload(artifact)
    assert artifact.manifest.digest is not None
    return artifact.manifest.digest


def _node(tmp: Path, criu_bin: Path, s3_server: LocalS3, location: S3Location, prefetch: str) -> Executor:
    creds = s3_server.write_credentials(tmp / "credentials")
    executor, _ = local_executor(
        tmp,
        criu_bin,
        objects=ObjectStore(location, creds),
        s3_prefetch=prefetch,
        kind=Executor,
        runtime_kind=ProcessRuntime,
    )
    return executor


async def _settled(executor: Executor) -> None:
    await asyncio.gather(*executor.checks_ahead, return_exceptions=True)


async def test_scheduled_fetches_once_the_pod_is_bound_and_shares_one_fetch(
    tmp_path: Path, criu_bin: Path, s3_server: LocalS3, location: S3Location
) -> None:
    digest = await _in_store(tmp_path, s3_server, location)
    node = _node(tmp_path / "node", criu_bin, s3_server, location, "scheduled")
    before = fetches()
    # Three restore pods of it bound at once, and a fetch ahead: one fetch.
    for _ in range(3):
        node.check_ahead(KEY, digest)
    node.fetch_ahead(KEY, digest)
    await _settled(node)
    assert node.store.list() == [KEY]
    assert node.store.open(KEY).manifest.digest == digest
    assert fetches() == before + 1


async def test_none_leaves_the_fetch_to_the_restore(
    tmp_path: Path, criu_bin: Path, s3_server: LocalS3, location: S3Location
) -> None:
    digest = await _in_store(tmp_path, s3_server, location)
    node = _node(tmp_path / "node", criu_bin, s3_server, location, "none")
    node.check_ahead(KEY, digest)
    await _settled(node)
    assert node.store.list() == []


async def test_a_failed_fetch_ahead_is_tried_again_by_the_next(
    tmp_path: Path, criu_bin: Path, s3_server: LocalS3, location: S3Location
) -> None:
    digest = await _in_store(tmp_path, s3_server, location)
    node = _node(tmp_path / "node", criu_bin, s3_server, location, "scheduled")
    node.check_ahead(KEY, "f" * 64)  # not the checkpoint's digest: refused, nothing kept
    await _settled(node)
    assert node.store.list() == []
    assert node.fetching == {}
    node.check_ahead(KEY, digest)
    await _settled(node)
    assert node.store.list() == [KEY]


@pytest.mark.cluster
async def test_all_fetches_a_snapshot_once_it_is_ready_and_nothing_ungranted(
    tmp_path: Path,
    criu_bin: Path,
    s3_server: LocalS3,
    location: S3Location,
    crds: list[str],
    namespace: str,
    kube: Kube,
) -> None:
    snap = await ready_snapshot(kube, namespace, "snap-a")
    meta = snap["metadata"]
    binding = Binding(
        namespace=namespace,
        checkpoint_name="snap-a",
        checkpoint_uid=meta["uid"],
        source_pod="worker-0",
        source_pod_uid="9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",
    )
    digest = await _in_store(tmp_path, s3_server, location, binding)
    node = _node(tmp_path / "node", criu_bin, s3_server, location, "all")
    prefetch = ArtifactPrefetch(kube, node)
    ready = await kube.get(POD_SNAPSHOT, "snap-a", namespace)
    # ready_snapshot's content records another digest than the store's manifest: nothing is kept.
    await prefetch.on_snapshot(MODIFIED, ready, None)
    await _settled(node)
    assert node.store.list() == []
    content = PodSnapshotView(ready).bound_content
    await kube.patch_status(POD_SNAPSHOT_CONTENT, content, {"artifact": {"digest": digest}})
    await prefetch.on_snapshot(MODIFIED, ready, None)
    await _settled(node)
    assert node.store.list() == [artifact_key(namespace, meta["uid"])]
    # Already Ready before this event: not fetched again.
    before = fetches()
    await prefetch.on_snapshot(MODIFIED, ready, ready)
    await _settled(node)
    assert fetches() == before
