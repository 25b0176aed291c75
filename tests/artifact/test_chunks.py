"""Chunked sealing: one huge file hashed by many threads, and per-chunk messages when it is damaged."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.artifact import (
    ArtifactError,
    ArtifactStore,
    ArtifactWriter,
    fetch,
    verify_files,
)
from dynamo_snapshot.fileio import HashJob, hash_files
from dynamo_snapshot.fileio import hashing as io_module

from .helpers import (
    HASH,
    as_format,
    flip_a_byte,
    publish,
    read_manifest,
    refuse_direct_reads,
    stage,
    write_manifest,
)

CHUNK = 4096 * 4
PAGES = "criu/pages-1.img"
PAGES_SIZE = 10 * CHUNK + 123  # 11 chunks, the last one ragged


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


def checkpoint_files() -> dict[str, bytes]:
    return {
        PAGES: os.urandom(PAGES_SIZE),
        "weights/model.dsw": os.urandom(3 * CHUNK),
        "criu/one-chunk.img": os.urandom(CHUNK),  # not larger than a chunk: whole-file sha256
        "criu/inventory.img": b"\x01inventory",
        "criu/empty.img": b"",
    }


def pieces(data: bytes) -> list[str]:
    return [hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]


async def test_round_trip_seals_large_files_in_chunks(store: ArtifactStore) -> None:
    files = checkpoint_files()
    result = await publish(store, files, chunk_bytes=CHUNK)
    artifact = store.open(HASH)
    entries = {f.path: f for f in artifact.manifest.files}
    for rel in (PAGES, "weights/model.dsw"):
        assert (entries[rel].sha256, entries[rel].chunk_bytes) == (None, CHUNK)
        assert entries[rel].chunks == pieces(files[rel])
    for rel in ("criu/one-chunk.img", "criu/inventory.img", "criu/empty.img"):
        assert entries[rel].chunks is None
        assert entries[rel].sha256 == hashlib.sha256(files[rel]).hexdigest()
    assert len(entries[PAGES].chunks or []) == 11
    assert result.io.files[PAGES].sha256 is None
    assert result.io.files["criu/inventory.img"].sha256 == entries["criu/inventory.img"].sha256

    stats = artifact.verify(expect_hash=HASH)
    assert stats.bytes == sum(len(d) for d in files.values())
    assert sorted(stats.files) == sorted(files)
    assert stats.files[PAGES].bytes == PAGES_SIZE
    assert (await artifact.averify(parallel=1)).bytes == stats.bytes
    raw = json.loads((artifact.path / "manifest.json").read_text())
    small = next(f for f in raw["files"] if f["path"] == "criu/inventory.img")
    assert set(small) == {"path", "size", "sha256"}, "a whole-file entry keeps the version-1 shape"


async def test_flipped_byte_names_file_and_chunk(store: ArtifactStore) -> None:
    await publish(store, checkpoint_files(), chunk_bytes=CHUNK)
    artifact = store.open(HASH)
    flip_a_byte(artifact.path / PAGES, 7 * CHUNK + 100)
    with pytest.raises(ArtifactError) as err:
        artifact.verify()
    assert err.value.problems == [f"checksum mismatch: {PAGES} (chunk 7 of 11 at offset {7 * CHUNK})"]
    flip_a_byte(artifact.path / PAGES, PAGES_SIZE - 1)  # the short last chunk
    flip_a_byte(artifact.path / PAGES, 0)
    with pytest.raises(ArtifactError) as err:
        artifact.verify()
    assert err.value.problems == [f"checksum mismatch: {PAGES} (chunk 0 of 11 at offset 0, and 2 more)"]
    artifact.verify(check_checksums=False)  # sizes alone cannot see it


async def test_truncated_chunked_file_is_reported_without_hashing_it(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await publish(store, checkpoint_files(), chunk_bytes=CHUNK)
    artifact = store.open(HASH)
    os.truncate(artifact.path / PAGES, 5 * CHUNK)
    hashed: list[Path] = []
    real = io_module._hash_range

    def record(job: HashJob, *args: Any, **kwargs: Any) -> object:
        hashed.append(job.src)
        return real(job, *args, **kwargs)

    monkeypatch.setattr(io_module, "_hash_range", record)
    with pytest.raises(ArtifactError) as err:
        artifact.verify()
    assert err.value.problems == [
        f"unexpected file size: {PAGES} (expected {PAGES_SIZE} bytes, got {5 * CHUNK})"
    ]
    assert hashed, "the other files are still checked"
    assert artifact.path / PAGES not in hashed


async def test_file_shrinking_while_hashed_is_a_size_problem(store: ArtifactStore) -> None:
    files = checkpoint_files()
    await publish(store, files, chunk_bytes=CHUNK)
    entry = next(f for f in store.open(HASH).manifest.files if f.path == PAGES)
    # What a truncate between the size check and the read looks like: fewer bytes than sealed.
    os.truncate(store.path_for(HASH) / PAGES, 4 * CHUNK + 5)
    results = hash_files([HashJob(store.path_for(HASH) / PAGES, entry.size, CHUNK)], parallel=4)
    assert results[0].stats.bytes == 4 * CHUNK + 5
    assert results[0].digests[:4] == tuple(pieces(files[PAGES])[:4])


async def test_filter_checks_only_the_chosen_files(store: ArtifactStore) -> None:
    await publish(store, checkpoint_files(), chunk_bytes=CHUNK)
    artifact = store.open(HASH)
    flip_a_byte(artifact.path / PAGES, 3 * CHUNK)
    os.truncate(artifact.path / "criu/inventory.img", 1)

    stats = artifact.verify(files=["weights/model.dsw", "criu/empty.img"])
    assert sorted(stats.files) == ["criu/empty.img", "weights/model.dsw"]
    assert stats.bytes == 3 * CHUNK
    assert (await artifact.averify(files={"weights/model.dsw"})).bytes == 3 * CHUNK

    with pytest.raises(ArtifactError) as err:
        artifact.verify(files=[PAGES, "weights/model.dsw"])
    assert err.value.problems == [f"checksum mismatch: {PAGES} (chunk 3 of 11 at offset {3 * CHUNK})"]
    with pytest.raises(ArtifactError) as err:
        artifact.verify(files=["weights/model.dsw", "weights/other.dsw"])
    assert err.value.problems == ["not a file of this artifact: weights/other.dsw"]
    assert artifact.verify(files=[]).bytes == 0


async def test_verify_files_helper(store: ArtifactStore) -> None:
    await publish(store, checkpoint_files(), chunk_bytes=CHUNK)
    artifact = store.open(HASH)
    weights = [f for f in artifact.manifest.files if f.path.startswith("weights/")]
    flip_a_byte(artifact.path / PAGES, 0)
    stats = verify_files(artifact.path, weights, parallel=3)
    assert list(stats.files) == ["weights/model.dsw"]
    flip_a_byte(artifact.path / "weights/model.dsw", 2 * CHUNK)
    with pytest.raises(
        ArtifactError, match=r"^checksum mismatch: weights/model\.dsw \(chunk 2 of 3 at offset"
    ):
        verify_files(artifact.path, weights)


async def test_chunks_of_one_file_are_hashed_in_parallel(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await publish(store, {PAGES: os.urandom(2 * CHUNK + 1)}, chunk_bytes=CHUNK)
    artifact = store.open(HASH)
    # Three pieces meet here only if three threads hash them at once; serial hashing times out.
    meeting = threading.Barrier(3, timeout=30)
    real = io_module._hash_range

    def together(job: HashJob, *args: Any, **kwargs: Any) -> object:
        meeting.wait()
        return real(job, *args, **kwargs)

    monkeypatch.setattr(io_module, "_hash_range", together)
    assert artifact.verify(parallel=3).bytes == 2 * CHUNK + 1


async def test_version_1_manifest_still_loads_and_verifies(store: ArtifactStore) -> None:
    await publish(store, {"pages-1.img": os.urandom(5 * CHUNK), "a.img": b"a"})  # default chunk: no chunks
    raw = read_manifest(store.path_for(HASH))
    assert all(set(f) == {"path", "size", "sha256"} for f in raw["files"])
    write_manifest(store.path_for(HASH), as_format(raw, 1))
    artifact = store.open(HASH)
    assert artifact.manifest.format_version == 1
    assert artifact.verify().bytes == 5 * CHUNK + 1


async def test_version_1_manifest_with_chunks_is_refused(store: ArtifactStore) -> None:
    await publish(store, checkpoint_files(), chunk_bytes=CHUNK)
    write_manifest(store.path_for(HASH), as_format(read_manifest(store.path_for(HASH)), 1))
    with pytest.raises(
        ArtifactError, match=r"format_version 1 has no chunked files, but these are chunked: "
    ):
        store.open(HASH)


async def test_fetch_chunked_artifact(tmp_path: Path, store: ArtifactStore) -> None:
    files = checkpoint_files()
    await publish(store, files, chunk_bytes=CHUNK)
    cache = ArtifactStore(tmp_path / "cache")
    result = await fetch(store.open(HASH), cache, parallel=4)
    assert result.won
    assert result.io.bytes == sum(len(d) for d in files.values())
    local = cache.open(HASH)
    assert local.manifest == store.open(HASH).manifest
    for rel, data in files.items():
        assert local.file_path(rel).read_bytes() == data
    local.verify(expect_hash=HASH)


async def test_fetch_refuses_corrupt_chunk(tmp_path: Path, store: ArtifactStore) -> None:
    await publish(store, checkpoint_files(), chunk_bytes=CHUNK)
    source = store.open(HASH)
    flip_a_byte(source.path / PAGES, 9 * CHUNK + 1)
    cache = ArtifactStore(tmp_path / "cache")
    with pytest.raises(ArtifactError) as err:
        await fetch(source, cache)
    assert err.value.problems == [f"checksum mismatch: {PAGES} (chunk 9 of 11 at offset {9 * CHUNK})"]
    assert os.listdir(cache.root) == []


async def test_fetch_refuses_truncated_source_before_copying(tmp_path: Path, store: ArtifactStore) -> None:
    await publish(store, checkpoint_files(), chunk_bytes=CHUNK)
    source = store.open(HASH)
    os.truncate(source.path / PAGES, CHUNK)
    cache = ArtifactStore(tmp_path / "cache")
    with pytest.raises(ArtifactError, match=rf"unexpected file size: {PAGES} \(expected {PAGES_SIZE} bytes"):
        await fetch(source, cache)
    assert not cache.root.exists() or os.listdir(cache.root) == []


async def test_invalid_chunk_size_is_refused(store: ArtifactStore) -> None:
    with ArtifactWriter(store, HASH) as w:
        stage(w.directory, {"a.img": b"a"})
        with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096"):
            await w.publish(criu_version="4.1.1", chunk_bytes=1000)


@pytest.mark.parametrize("size", [0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
@pytest.mark.parametrize("direct", [True, False])
def test_hash_files_at_chunk_boundaries(tmp_path: Path, size: int, direct: bool) -> None:
    data = os.urandom(size)
    (tmp_path / "src").write_bytes(data)
    jobs = [
        HashJob(tmp_path / "src", size, CHUNK, dst=tmp_path / "copy" / "chunked"),
        HashJob(tmp_path / "src", size, None, dst=tmp_path / "copy" / "whole"),
        HashJob(tmp_path / "src", size, CHUNK),
    ]
    chunked, whole, hashed = hash_files(jobs, parallel=5, block_size=4096, direct=direct, fsync=True)
    assert chunked.digests == hashed.digests == tuple(pieces(data))
    assert whole.digests == (hashlib.sha256(data).hexdigest(),)
    assert (whole.stats.sha256, chunked.stats.sha256) == (whole.digests[0], None)
    assert chunked.stats.bytes == whole.stats.bytes == size
    assert (tmp_path / "copy" / "chunked").read_bytes() == data
    assert (tmp_path / "copy" / "whole").read_bytes() == data


def test_hash_files_copy_falls_back_when_requests_refuse_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_direct_reads(monkeypatch)
    data = os.urandom(3 * CHUNK + 5)
    (tmp_path / "src").write_bytes(data)
    [got] = hash_files([HashJob(tmp_path / "src", len(data), CHUNK, tmp_path / "dst")], direct=True)
    assert got.digests == tuple(pieces(data))
    assert got.stats.direct is False
    assert (tmp_path / "dst").read_bytes() == data


def test_hash_files_raises_io_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        hash_files([HashJob(tmp_path / "missing", 10)])
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096"):
        hash_files([HashJob(tmp_path / "missing", 10, 1000)])
