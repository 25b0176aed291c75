"""The node cache in front of an S3-compatible object store (a real SeaweedFS server), with the agent's
Executor and real CRIU: a node fetches a checkpoint it lacks into its cache, not its store, and restores it
from there again without the network; the cache keeps under its cap by removing the least recently
restored copy, never one a restore reads (then the restore fails by name and nothing is kept), and a
copy that fails its check is removed so the next restore fetches it anew."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.errors import AgentError, ArtifactRefused
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.artifact import ArtifactStore
from dynamo_snapshot.artifact.cache import artifact_bytes
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot_dev.localcluster.s3server import LocalS3
from tests.agent.local_node import checkpoint_worker_outcome, local_executor, node_with_cache, restore_intact
from tests.artifact.helpers import flip_a_byte

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
FIRST, SECOND = "0123456789abcdef", "fedcba9876543210"


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def fetches() -> float:
    return sample("dynsnap_agent_object_store_transfers_total", {"op": "fetch", "result": "done"})


def restores_from(source: str) -> float:
    return sample("dynsnap_agent_cache_restores_total", {"source": source})


@pytest.fixture
async def objects(s3_server: LocalS3, tmp_path: Path) -> ObjectStore:
    location = S3Location(endpoint=s3_server.endpoint, bucket=await s3_server.new_bucket(), prefix="c/")
    return ObjectStore(location, s3_server.write_credentials(tmp_path / "credentials"))


async def _checkpointed(tmp_path: Path, criu_bin: Path, objects: ObjectStore, *keys: str) -> dict[str, str]:
    """``keys`` checkpointed on node a and written to the store: their manifest digests."""
    a, runtime = local_executor(
        tmp_path / "a",
        criu_bin,
        compress_pages=False,
        objects=objects,
        kind=Executor,
        runtime_kind=ProcessRuntime,
    )
    digests = {}
    for i, key in enumerate(keys):
        _, outcome = await checkpoint_worker_outcome(
            a, runtime, WORKER, key, {"WORKER_STATE_MIB": "8"}, key=f"source-{i}"
        )
        digests[key] = outcome.manifest_digest
    return digests


async def test_a_fetched_checkpoint_goes_into_the_node_cache_and_is_read_there_again(
    criu_bin: Path, tmp_path: Path, objects: ObjectStore
) -> None:
    digests = await _checkpointed(tmp_path, criu_bin, objects, FIRST)
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, objects, 1 << 30)
    fetched, from_store, from_cache = fetches(), restores_from("store"), restores_from("cache")

    assert await restore_intact(node, runtime, FIRST, digests[FIRST]) == "object-store"
    assert node.store.list() == [], "a fetched artifact goes into the cache, not the node's store"
    assert cache.store.list() == [FIRST]
    assert fetches() == fetched + 1
    assert restores_from("store") == from_store + 1
    assert sample("dynsnap_agent_cache_bytes") == cache.used_bytes() > 0

    assert await restore_intact(node, runtime, FIRST, digests[FIRST]) == "cache"
    assert fetches() == fetched + 1, "the second restore fetched again"
    assert restores_from("cache") == from_cache + 1


async def test_the_least_recently_restored_copy_makes_way_never_one_in_use(
    criu_bin: Path, tmp_path: Path, objects: ObjectStore
) -> None:
    digests = await _checkpointed(tmp_path, criu_bin, objects, FIRST, SECOND)
    source = ArtifactStore(tmp_path / "a" / "store")
    sizes = {key: artifact_bytes(source.open(key).manifest) for key in digests}
    # Room for either, not both.
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, objects, sum(sizes.values()) - 1)
    evicted = sample("dynsnap_agent_cache_evictions_total")

    await restore_intact(node, runtime, FIRST, digests[FIRST])
    await restore_intact(node, runtime, SECOND, digests[SECOND])
    assert cache.store.list() == [SECOND]
    assert sample("dynsnap_agent_cache_evictions_total") == evicted + 1

    # While a restore reads the only copy, the other cannot come in: refused by name, nothing kept.
    no_room = rf"artifact {FIRST} not fetched: no room for .* node cache"
    with cache.pinned(SECOND), pytest.raises(AgentError, match=no_room):
        await node.restore("r", FIRST, manifest_digest=digests[FIRST])
    assert cache.store.list() == [SECOND]
    assert sorted(os.listdir(cache.root)) == [SECOND], "a partial copy was left"

    small, _, _ = node_with_cache(tmp_path / "small", criu_bin, objects, min(sizes.values()) // 2)
    with pytest.raises(AgentError, match=rf"artifact {FIRST} .* is larger than the node cache"):
        await small.restore("r", FIRST, manifest_digest=digests[FIRST])


async def test_a_damaged_copy_in_the_node_cache_is_removed_and_fetched_again(
    criu_bin: Path, tmp_path: Path, objects: ObjectStore
) -> None:
    digests = await _checkpointed(tmp_path, criu_bin, objects, FIRST)
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, objects, 1 << 30)
    await restore_intact(node, runtime, FIRST, digests[FIRST])
    copy = cache.store.open(FIRST)
    pages = max((f for f in copy.manifest.files if f.path.endswith(".img")), key=lambda f: f.size)
    flip_a_byte(copy.path / pages.path, pages.size // 2)
    refused, fetched = restores_from("refused"), fetches()

    with pytest.raises(ArtifactRefused, match=pages.path):
        await node.restore("r", FIRST, manifest_digest=digests[FIRST])
    assert cache.store.list() == [], "the damaged copy stayed"
    assert restores_from("refused") == refused + 1

    assert await restore_intact(node, runtime, FIRST, digests[FIRST]) == "object-store"
    assert fetches() == fetched + 1


async def test_a_refused_copy_another_restore_still_reads_is_checked_again_not_trusted(
    criu_bin: Path, tmp_path: Path, objects: ObjectStore
) -> None:
    digests = await _checkpointed(tmp_path, criu_bin, objects, FIRST)
    node, runtime, cache = node_with_cache(tmp_path, criu_bin, objects)
    assert await restore_intact(node, runtime, FIRST, digests[FIRST]) == "object-store"
    copy = cache.store.open(FIRST)
    pages = max((f for f in copy.manifest.files if f.path.endswith(".img")), key=lambda f: f.size)
    flip_a_byte(copy.path / pages.path, pages.size // 2)
    # Another restore reads the copy: refused, it stays until that one ends, and the fetch of the next
    # restore finds it on the node; its files were not brought by that fetch, so they are hashed again.
    with cache.pinned(FIRST):
        assert not cache.refuse(FIRST)
        with pytest.raises(ArtifactRefused, match=pages.path):
            await node.restore("r", FIRST, manifest_digest=digests[FIRST])
