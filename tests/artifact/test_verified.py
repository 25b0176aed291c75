"""Files verified once are not hashed again while unchanged; any change to them is caught."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dynamo_snapshot.artifact import ArtifactError, ArtifactStore, VerifiedFiles
from tests.artifact.helpers import HASH, publish, sample_files


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


async def test_a_second_verify_hashes_nothing(store: ArtifactStore) -> None:
    await publish(store, sample_files(), chunk_bytes=1 << 20)
    artifact = store.open(HASH)
    cache = VerifiedFiles()
    first = artifact.verify(verified=cache)
    assert first.bytes > 4 << 20
    second = artifact.verify(verified=cache)
    assert second.bytes == 0
    assert artifact.verify().bytes == first.bytes  # without the cache everything is read


@pytest.mark.parametrize("keep_mtime", [False, True])
async def test_a_file_changed_after_its_check_is_hashed_again_and_refused(
    store: ArtifactStore, keep_mtime: bool
) -> None:
    await publish(store, sample_files(), chunk_bytes=1 << 20)
    artifact = store.open(HASH)
    cache = VerifiedFiles()
    artifact.verify(verified=cache)
    pages = artifact.path / "pages-1.img"
    before = pages.stat()
    pages.chmod(0o644)
    with pages.open("r+b") as f:  # same size, one byte different
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        # Setting the modification time back does not help: the kernel moved the status-change time.
        os.utime(pages, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ArtifactError, match=r"checksum mismatch: pages-1\.img"):
        artifact.verify(verified=cache)


async def test_a_failed_check_remembers_nothing(store: ArtifactStore) -> None:
    await publish(store, sample_files(), chunk_bytes=1 << 20)
    artifact = store.open(HASH)
    target = artifact.path / "cuda/gpu-0.bin"
    target.chmod(0o644)
    data = bytearray(target.read_bytes())
    data[0] ^= 0x01
    target.write_bytes(bytes(data))
    cache = VerifiedFiles()
    with pytest.raises(ArtifactError):
        artifact.verify(verified=cache)
    assert not any(cache.known(artifact.path, f) for f in artifact.manifest.files)


async def test_entries_expire(store: ArtifactStore) -> None:
    await publish(store, sample_files(), chunk_bytes=1 << 20)
    artifact = store.open(HASH)
    cache = VerifiedFiles(ttl_s=0.2)
    artifact.verify(verified=cache)
    await asyncio.sleep(0.3)
    assert artifact.verify(verified=cache).bytes > 4 << 20
