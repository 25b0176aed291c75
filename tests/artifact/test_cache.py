"""The node-local artifact cache, on real directories: filled only with checked copies, served only
while the shared store publishes the same manifest, kept under its size by least-recently-used
eviction that never touches a copy in use."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dynamo_snapshot.artifact import ArtifactError, ArtifactStore
from dynamo_snapshot.artifact.cache import ArtifactCache, artifact_bytes
from tests.artifact.helpers import BINDING, KEY, NAMESPACE, publish

A, B, C = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"
MiB = 1 << 20


def files(n_mib: int) -> dict[str, bytes]:
    return {"inventory.img": b"\x01inventory", "pages-1.img": os.urandom(n_mib * MiB)}


@pytest.fixture
def shared(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "shared")


def used_at(cache: ArtifactCache, identity_hash: str, when: float) -> None:
    path = cache.store.path_for(identity_hash)
    os.utime(path, (when, when))


async def cached_copy(tmp_path: Path, shared: ArtifactStore) -> ArtifactCache:
    """Checkpoint A published in the shared store and copied into a 10 MiB cache."""
    await publish(shared, files(1), A)
    cache = ArtifactCache(tmp_path / "cache", 10 * MiB)
    assert await cache.fill(shared.open(A)) is not None
    return cache


async def retake(shared: ArtifactStore) -> None:
    """Checkpoint A taken anew: same identity, other bytes."""
    shared.delete(A)
    await publish(shared, files(1), A)


async def test_fill_then_lookup_serves_a_checked_copy(tmp_path: Path, shared: ArtifactStore) -> None:
    await publish(shared, files(1), A)
    cache = ArtifactCache(tmp_path / "cache", 10 * MiB)
    source = shared.open(A)
    assert cache.lookup(source) is None
    copy = await cache.fill(source)
    assert copy is not None
    assert copy.path == cache.root / A
    hit = cache.lookup(source)
    assert hit is not None
    assert hit.path == cache.root / A
    hit.verify(expect_hash=A)
    assert cache.used_bytes() == artifact_bytes(source.manifest)
    # A second fill of the same checkpoint copies nothing.
    (cache.root / A / "this-copy").touch()  # not in the manifest: marks this copy
    again = await cache.fill(source)
    assert again is not None
    assert (again.path / "this-copy").exists()


async def test_least_recently_used_copy_makes_room(tmp_path: Path, shared: ArtifactStore) -> None:
    for h in (A, B, C):
        await publish(shared, files(2), h)
    cache = ArtifactCache(tmp_path / "cache", 5 * MiB)  # two 2 MiB artifacts fit, not three
    evicted: list[str] = []
    cache.on_evicted = evicted.extend
    assert await cache.fill(shared.open(A)) is not None
    assert await cache.fill(shared.open(B)) is not None
    now = time.time()
    used_at(cache, A, now - 100)
    used_at(cache, B, now - 50)
    assert cache.lookup(shared.open(A)) is not None  # A restored again: now B is the older
    assert await cache.fill(shared.open(C)) is not None
    assert cache.store.list() == [A, C]
    assert evicted == [B]
    assert cache.used_bytes() <= cache.max_bytes


async def test_pinned_copies_are_never_evicted(tmp_path: Path, shared: ArtifactStore) -> None:
    for h in (A, B, C):
        await publish(shared, files(2), h)
    cache = ArtifactCache(tmp_path / "cache", 5 * MiB)
    await cache.fill(shared.open(A))
    await cache.fill(shared.open(B))
    with cache.pinned(A), cache.pinned(B):
        assert await cache.fill(shared.open(C)) is None
        assert cache.store.list() == [A, B]
        assert not cache.discard(A)
    with cache.pinned(A):
        assert await cache.fill(shared.open(C)) is not None
    assert cache.store.list() == [A, C]


async def test_larger_than_the_cache_is_not_cached(tmp_path: Path, shared: ArtifactStore) -> None:
    await publish(shared, files(3), A)
    await publish(shared, files(1), B)
    cache = ArtifactCache(tmp_path / "cache", 2 * MiB)
    await cache.fill(shared.open(B))
    assert await cache.fill(shared.open(A)) is None
    assert cache.store.list() == [B]  # nothing evicted for a copy that could never fit


async def test_free_space_floor(tmp_path: Path, shared: ArtifactStore) -> None:
    await publish(shared, files(1), A)
    st = os.statvfs(tmp_path)
    cache = ArtifactCache(tmp_path / "cache", 10 * MiB, min_free_bytes=st.f_bavail * st.f_frsize)
    assert await cache.fill(shared.open(A)) is None
    assert cache.store.list() == []


async def test_a_checkpoint_taken_anew_is_not_served_from_the_old_copy(
    tmp_path: Path, shared: ArtifactStore
) -> None:
    cache = await cached_copy(tmp_path, shared)
    await retake(shared)
    assert cache.lookup(shared.open(A)) is None
    copy = await cache.fill(shared.open(A))  # the old copy makes way
    assert copy is not None
    assert copy.manifest == shared.open(A).manifest
    assert cache.lookup(shared.open(A)) is not None
    assert os.listdir(cache.root) == [A]


async def test_stale_copy_in_use_stays_until_released(tmp_path: Path, shared: ArtifactStore) -> None:
    cache = await cached_copy(tmp_path, shared)
    old = cache.store.open(A).manifest
    await retake(shared)
    with cache.pinned(A):
        assert await cache.fill(shared.open(A)) is None
        assert cache.store.open(A).manifest == old
    copy = await cache.fill(shared.open(A))
    assert copy is not None
    assert copy.manifest != old


async def test_a_refused_copy_is_never_served_and_replaced_once_free(
    tmp_path: Path, shared: ArtifactStore
) -> None:
    cache = await cached_copy(tmp_path, shared)
    (cache.root / A / "old-copy").touch()  # not in the manifest: marks this copy
    with cache.pinned(A):  # another restore reads it
        assert not cache.refuse(A)
        assert cache.lookup(shared.open(A)) is None
        assert await cache.fill(shared.open(A)) is None  # cannot replace it yet
        assert cache.store.list() == [A]
    copy = await cache.fill(shared.open(A))
    assert copy is not None
    assert not (copy.path / "old-copy").exists()
    assert cache.lookup(shared.open(A)) is not None
    # Unpinned: gone at once.
    assert cache.refuse(A)
    assert cache.store.list() == []


async def test_damaged_source_caches_nothing(tmp_path: Path, shared: ArtifactStore) -> None:
    await publish(shared, files(1), A)
    source = shared.open(A)
    with (source.path / "pages-1.img").open("r+b") as f:
        f.write(b"\0\0\0\0")
    cache = ArtifactCache(tmp_path / "cache", 10 * MiB)
    with pytest.raises(ArtifactError, match=r"checksum mismatch: pages-1\.img"):
        await cache.fill(source)
    assert os.listdir(cache.root) == []


async def test_unreadable_copy_is_replaced(tmp_path: Path, shared: ArtifactStore) -> None:
    cache = await cached_copy(tmp_path, shared)
    (cache.root / A / "manifest.json").write_text("{not json")
    assert cache.lookup(shared.open(A)) is None
    copy = await cache.fill(shared.open(A))
    assert copy is not None
    copy.verify(expect_hash=A)


@pytest.mark.parametrize(
    ("size", "floor", "message"),
    [(0, 0, "cache size must be positive"), (MiB, -1, "free space to keep must not be negative")],
)
def test_bad_limits(tmp_path: Path, size: int, floor: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArtifactCache(tmp_path, size, min_free_bytes=floor)


async def test_copies_are_keyed_like_the_store(tmp_path: Path, shared: ArtifactStore) -> None:
    tenant_b = BINDING.model_copy(update={"namespace": "tenant-b"})
    await publish(shared, files(2), binding=BINDING)
    await publish(shared, files(2), binding=tenant_b)
    await publish(shared, files(2), A)
    cache = ArtifactCache(tmp_path / "cache", 5 * MiB)  # two of the three fit
    copy = await cache.fill(shared.open(KEY))
    assert copy is not None
    assert copy.key == KEY
    assert copy.path == cache.root / NAMESPACE / BINDING.checkpoint_uid
    assert copy.manifest == shared.open(KEY).manifest
    hit = cache.lookup(shared.open(KEY))
    assert hit is not None
    assert hit.key == KEY
    # The other namespace's artifact of the same identity is another copy, never this one.
    assert cache.lookup(shared.open(tenant_b.key)) is None
    used_at(cache, KEY, time.time() - 100)
    assert await cache.fill(shared.open(tenant_b.key)) is not None
    assert [c.key for c in cache.copies()] == [KEY, tenant_b.key]
    assert await cache.fill(shared.open(A)) is not None  # the least recently used, KEY, makes room
    assert cache.store.list() == [A, tenant_b.key]
    assert not (cache.root / NAMESPACE).exists()
    with cache.pinned(tenant_b.key):
        assert not cache.discard(tenant_b.key)
    assert cache.discard(tenant_b.key)
    assert sorted(os.listdir(cache.root)) == [A]
