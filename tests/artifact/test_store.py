"""Writing, publishing, reading and verifying artifacts; dead writers; races between writers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot import __version__
from dynamo_snapshot.artifact import (
    FORMAT_VERSION,
    Artifact,
    ArtifactError,
    ArtifactNotFoundError,
    ArtifactStore,
    ArtifactWriter,
    fetch,
)
from dynamo_snapshot.artifact import io as io_module
from dynamo_snapshot.artifact.io import HashJob

from .helpers import H200, HASH, IDENTITY, publish, sample_files, stage

OTHER = "00000000000000ff"


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


def entries(store: ArtifactStore) -> list[str]:
    return sorted(os.listdir(store.root))


async def test_round_trip(store: ArtifactStore) -> None:
    files = sample_files()
    result = await publish(store, files)
    assert result.won
    assert result.path == store.path_for(HASH)
    assert result.total_bytes == sum(len(d) for d in files.values())
    assert entries(store) == [HASH], "no staging or lock file may remain"

    artifact = store.open(HASH)
    m = artifact.manifest
    assert (m.identity, m.identity_hash, m.gpus, m.source_node) == (IDENTITY, HASH, H200, "node-a")
    assert (m.criu_version, m.agent_version, m.extra) == ("4.1.1", __version__, {"runtime": "process"})
    assert m.timings["dump"] == 1.5
    assert "hash" in m.timings
    assert {f.path: (f.size, f.sha256) for f in m.files} == {
        rel: (len(d), hashlib.sha256(d).hexdigest()) for rel, d in files.items()
    }
    stats = artifact.verify(expect_hash=HASH)
    assert stats.bytes == result.total_bytes
    assert (await artifact.averify()).bytes == stats.bytes
    for rel, data in files.items():
        assert artifact.file_path(rel).read_bytes() == data
    assert store.exists(HASH)
    assert store.list() == [HASH]


async def test_flipped_byte_is_a_checksum_mismatch(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    artifact = store.open(HASH)
    page = artifact.path / "pages-1.img"
    data = bytearray(page.read_bytes())
    data[len(data) // 2] ^= 0x01
    page.write_bytes(bytes(data))
    entry = next(f for f in artifact.manifest.files if f.path == "pages-1.img")
    with pytest.raises(ArtifactError) as err:
        artifact.verify()
    expected = (
        f"checksum mismatch: pages-1.img (expected {entry.sha256}, got {hashlib.sha256(data).hexdigest()})"
    )
    assert str(err.value) == expected
    artifact.verify(check_checksums=False)  # sizes alone cannot see it


async def test_truncated_and_missing_files(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    artifact = store.open(HASH)
    os.truncate(artifact.path / "pages-1.img", 1000)
    (artifact.path / "cuda" / "gpu-0.bin").unlink()
    for check in (True, False):
        with pytest.raises(ArtifactError) as err:
            artifact.verify(check_checksums=check)
        assert err.value.problems == [
            "missing file: cuda/gpu-0.bin",
            f"unexpected file size: pages-1.img (expected {3 << 20} bytes, got 1000)",
        ]


async def test_expect_hash_mismatch(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    with pytest.raises(ArtifactError, match=f"identity hash mismatch: expected {OTHER}, artifact has {HASH}"):
        store.open(HASH).verify(expect_hash=OTHER)
    with pytest.raises(ValueError, match="invalid identity hash"):
        store.open(HASH).verify(expect_hash="../x")


async def test_manifest_under_the_wrong_directory(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    os.rename(store.path_for(HASH), store.path_for(OTHER))
    with pytest.raises(ArtifactError, match=f"directory {OTHER} holds a manifest for {HASH}"):
        store.open(OTHER)


async def test_newer_format_refused_on_open(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    manifest = store.path_for(HASH) / "manifest.json"
    raw = json.loads(manifest.read_text())
    newer = FORMAT_VERSION + 1
    manifest.write_text(json.dumps({**raw, "format_version": newer}))
    message = f"^manifest format_version {newer} is newer than supported {FORMAT_VERSION}$"
    with pytest.raises(ArtifactError, match=message):
        store.open(HASH)


def test_missing_artifact(store: ArtifactStore) -> None:
    assert not store.exists(HASH)
    assert store.list() == []
    with pytest.raises(ArtifactNotFoundError, match=f"no artifact {HASH}"):
        store.open(HASH)
    assert store.delete(HASH) is False
    assert store.gc_partial() == []


async def test_delete(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    await publish(store, {"a.img": b"a"}, OTHER)
    assert store.list() == [OTHER, HASH]
    assert store.delete(HASH) is True
    assert store.list() == [OTHER]
    assert entries(store) == [OTHER]


async def test_exception_mid_write_publishes_nothing(store: ArtifactStore) -> None:
    def dump_dies() -> None:
        with ArtifactWriter(store, HASH) as writer:
            stage(writer.directory, sample_files())
            raise RuntimeError("dump died")

    with pytest.raises(RuntimeError, match="dump died"):
        dump_dies()
    assert not store.exists(HASH)
    assert entries(store) == []


async def test_failure_while_hashing_publishes_nothing(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0

    def flaky(job: HashJob, *args: Any, **kwargs: Any) -> object:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(5, "Input/output error", str(job.src))
        return real(job, *args, **kwargs)

    real = io_module._hash_range
    monkeypatch.setattr(io_module, "_hash_range", flaky)
    with pytest.raises(OSError, match="Input/output error"):
        await publish(store, sample_files())
    assert entries(store) == []


async def test_symlink_is_refused(store: ArtifactStore) -> None:
    with ArtifactWriter(store, HASH) as w:
        (w.directory / "link.img").symlink_to("/etc/passwd")
        with pytest.raises(ArtifactError, match=r"link\.img is not a regular file"):
            await w.publish(criu_version="4.1.1")
    assert entries(store) == []


async def test_writer_for_wrong_identity(store: ArtifactStore) -> None:
    with (
        pytest.raises(ArtifactError, match="identity hash mismatch: writer is for"),
        ArtifactWriter(store, OTHER) as w,
    ):
        await w.publish(criu_version="4.1.1", identity=IDENTITY)


async def test_writer_used_twice(store: ArtifactStore) -> None:
    with ArtifactWriter(store, HASH) as w:
        stage(w.directory, {"a.img": b"a"})
        await w.publish(criu_version="4.1.1")
        with pytest.raises(ArtifactError, match="already published or discarded"):
            await w.publish(criu_version="4.1.1")
    assert store.exists(HASH), "leaving the block after publish keeps the artifact"


KILLED_WRITER = r"""
import sys, time
from pathlib import Path
from dynamo_snapshot.artifact import ArtifactStore, ArtifactWriter
writer = ArtifactWriter(ArtifactStore(Path(sys.argv[1])), sys.argv[2])
(writer.directory / "pages-1.img").write_bytes(b"x" * 100000)
print(writer.directory, flush=True)
time.sleep(600)
"""


async def test_killed_writer_leaves_only_staging_that_gc_removes(store: ArtifactStore) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_WRITER, str(store.root), HASH, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        staging = Path((await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip())
        assert staging.parent == store.root
        # While its writer lives, the staging directory is not garbage, even to another process.
        assert store.gc_partial() == []
        assert await asyncio.to_thread(staging.is_dir)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert store.list() == []
    assert not store.exists(HASH)
    assert store.gc_partial() == [staging]
    assert entries(store) == []


async def test_gc_keeps_live_writer_in_this_process(store: ArtifactStore) -> None:
    with ArtifactWriter(store, HASH) as writer:
        stage(writer.directory, {"a.img": b"a"})
        assert store.gc_partial() == []
        result = await writer.publish(criu_version="4.1.1")
    assert result.won
    assert entries(store) == [HASH]


def test_gc_removes_interrupted_delete_and_orphans(store: ArtifactStore) -> None:
    store.root.mkdir()
    (store.root / f".deleting-{HASH}-abc").mkdir()
    (store.root / f".deleting-{HASH}-abc" / "pages-1.img").write_bytes(b"x")
    (store.root / f".partial-{HASH}-1-abc").mkdir()  # its lock file is gone
    (store.root / f".partial-{HASH}-2-def.lock").touch()  # lock without staging
    removed = store.gc_partial()
    assert sorted(p.name for p in removed) == [f".deleting-{HASH}-abc", f".partial-{HASH}-1-abc"]
    assert entries(store) == []


async def test_concurrent_publish_exactly_one_wins(store: ArtifactStore) -> None:
    writers = [ArtifactWriter(store, HASH) for _ in range(6)]
    for i, w in enumerate(writers):
        stage(w.directory, {"pages-1.img": f"writer {i}".encode() * 1000})
    results = await asyncio.gather(
        *(w.publish(criu_version="4.1.1", extra={"writer": i}) for i, w in enumerate(writers))
    )
    winners = [i for i, r in enumerate(results) if r.won]
    assert len(winners) == 1
    published = store.open(HASH)
    assert published.manifest.extra == {"writer": winners[0]}
    published.verify()
    # Losers are told who won: every result names the one published artifact.
    assert all(r.artifact.manifest == published.manifest for r in results)
    assert entries(store) == [HASH]


async def test_fetch_into_local_cache(tmp_path: Path, store: ArtifactStore) -> None:
    files = sample_files()
    await publish(store, files)
    cache = ArtifactStore(tmp_path / "cache")
    result = await fetch(store.open(HASH), cache)
    assert result.won
    assert result.io.bytes == sum(len(d) for d in files.values())
    local = cache.open(HASH)
    assert local.manifest == store.open(HASH).manifest
    local.verify(expect_hash=HASH)
    again = await fetch(store.open(HASH), cache)
    assert not again.won
    assert again.io.bytes == 0
    assert os.listdir(cache.root) == [HASH]


async def test_fetch_refuses_damaged_source(tmp_path: Path, store: ArtifactStore) -> None:
    await publish(store, sample_files())
    source = store.open(HASH)
    with (source.path / "pagemap-1.img").open("r+b") as f:
        f.write(b"\0")
    cache = ArtifactStore(tmp_path / "cache")
    with pytest.raises(ArtifactError, match=r"checksum mismatch: pagemap-1\.img"):
        await fetch(source, cache)
    assert os.listdir(cache.root) == []


def test_artifact_load_outside_store(tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotFoundError, match=r"manifest\.json is missing"):
        Artifact.load(tmp_path)
