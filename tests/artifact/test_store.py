"""Writing, publishing, reading and verifying artifacts; dead writers; races between writers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot import __version__
from dynamo_snapshot.artifact import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Artifact,
    ArtifactError,
    ArtifactNotFoundError,
    ArtifactStore,
    ArtifactWriter,
    fetch,
)
from dynamo_snapshot.artifact import manifest as manifest_module
from dynamo_snapshot.artifact.manifest import canonical_digest
from dynamo_snapshot.fileio import HashJob
from dynamo_snapshot.fileio import hashing as io_module

from .helpers import (
    BINDING,
    CHECKPOINT_UID,
    H200,
    HASH,
    IDENTITY,
    KEY,
    NAMESPACE,
    as_format,
    publish,
    read_manifest,
    sample_files,
    stage,
    write_manifest,
)

OTHER = "00000000000000ff"
OTHER_UID = "0f0e0d0c-0b0a-4908-8706-050403020100"


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
    assert (m.format_version, m.binding, artifact.key) == (FORMAT_VERSION, None, HASH)
    assert m.digest == canonical_digest(read_manifest(artifact.path))
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
writer = ArtifactWriter(ArtifactStore(Path(sys.argv[1])), sys.argv[2], key=sys.argv[3])
(writer.directory / "pages-1.img").write_bytes(b"x" * 100000)
print(writer.directory, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("key", "flat"), [(HASH, HASH), (KEY, f"{NAMESPACE}_{CHECKPOINT_UID}")])
async def test_killed_writer_leaves_only_staging_that_gc_removes(
    store: ArtifactStore, key: str, flat: str
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_WRITER, str(store.root), HASH, key, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        staging = Path((await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip())
        # Directly under the root, even for a key with a "/": gc finds it, and it is no namespace.
        assert staging.parent == store.root
        assert staging.name.startswith(f".partial-{flat}-")
        # While its writer lives, the staging directory is not garbage, even to another process.
        assert store.gc_partial() == []
        assert await asyncio.to_thread(staging.is_dir)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert store.list() == []
    assert not store.exists(key)
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


# ------------------------------------------------------------------ keys, bindings and the seal


async def test_bound_artifact_lives_under_its_namespace_and_uid(store: ArtifactStore) -> None:
    result = await publish(store, sample_files(), binding=BINDING)
    assert result.won
    assert result.path == store.root / NAMESPACE / CHECKPOINT_UID == store.path_for(KEY)
    assert result.artifact.key == KEY
    assert entries(store) == [NAMESPACE], "no staging or lock file may remain"
    artifact = store.open(KEY)
    assert artifact.key == KEY
    m = artifact.manifest
    assert (m.format_version, m.binding, m.identity_hash, m.identity) == (
        FORMAT_VERSION,
        BINDING,
        HASH,
        IDENTITY,
    )
    assert m.digest == canonical_digest(read_manifest(artifact.path))
    assert m == result.artifact.manifest
    artifact.verify()
    assert store.exists(KEY)
    assert not store.exists(HASH), "a bound artifact is not also published under its identity hash"


async def test_list_returns_both_key_forms(store: ArtifactStore) -> None:
    tenant_b = BINDING.model_copy(update={"namespace": "tenant-b"})
    second = BINDING.model_copy(update={"checkpoint_uid": OTHER_UID})
    for binding in (BINDING, tenant_b, second):
        await publish(store, {"a.img": b"a"}, binding=binding)
    await publish(store, {"a.img": b"a"})
    await publish(store, {"a.img": b"a"}, OTHER)
    # Nothing else counts: an empty checkpoint directory, a stray file, a directory that is no UID.
    (store.root / "tenant-c" / OTHER_UID).mkdir(parents=True)
    (store.root / "stray.txt").write_text("x")
    (store.root / NAMESPACE / "not-a-uid").mkdir()
    (store.root / NAMESPACE / "not-a-uid" / MANIFEST_NAME).write_text("{}")
    keys = [OTHER, HASH, f"{NAMESPACE}/{OTHER_UID}", KEY, f"tenant-b/{CHECKPOINT_UID}"]
    assert store.list() == sorted(keys)
    assert [store.open(key).key for key in store.list()] == sorted(keys)


@pytest.mark.parametrize("bound", [True, False])
async def test_one_byte_edit_of_a_published_manifest_is_refused(store: ArtifactStore, bound: bool) -> None:
    result = await publish(
        store, sample_files(), binding=BINDING if bound else None, extra={"control_dir": "/snapshot/control"}
    )
    key = result.artifact.key
    manifest = store.path_for(key) / MANIFEST_NAME
    data = manifest.read_bytes()
    edited = data.replace(b'"/snapshot/control"', b'"/snapshot/contro1"')
    assert len(edited) == len(data)
    assert edited != data
    manifest.write_bytes(edited)
    message = (
        rf"^{re.escape(str(manifest))} was changed after it was sealed: it records digest [0-9a-f]{{64}}"
    )
    with pytest.raises(ArtifactError, match=message):
        store.open(key)


@pytest.mark.parametrize(
    ("changes", "bound_to"),
    [
        ({"namespace": "tenant-b"}, f"tenant-b/{CHECKPOINT_UID}"),
        ({"checkpoint_uid": OTHER_UID}, f"{NAMESPACE}/{OTHER_UID}"),
    ],
)
async def test_artifact_bound_to_another_checkpoint_is_refused(
    store: ArtifactStore, changes: dict[str, str], bound_to: str
) -> None:
    await publish(store, sample_files(), binding=BINDING)
    raw = read_manifest(store.path_for(KEY))
    raw["binding"].update(changes)
    # Resealed, so the seal holds and only the binding can give it away.
    write_manifest(store.path_for(KEY), raw, reseal=True)
    with pytest.raises(ArtifactError) as err:
        store.open(KEY)
    assert str(err.value) == (
        f"binding mismatch: directory {KEY} holds an artifact bound to {bound_to} "
        f"(checkpoint {BINDING.checkpoint_name})"
    )


async def test_artifact_copied_into_another_namespace_is_refused(store: ArtifactStore) -> None:
    await publish(store, sample_files(), binding=BINDING)
    planted = store.root / "tenant-b" / CHECKPOINT_UID
    planted.parent.mkdir()
    shutil.copytree(store.path_for(KEY), planted)
    with pytest.raises(
        ArtifactError, match=f"directory tenant-b/{CHECKPOINT_UID} holds an artifact bound to {KEY}"
    ):
        store.open(f"tenant-b/{CHECKPOINT_UID}")


async def test_unbound_artifact_under_a_namespaced_key_is_refused(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    store.path_for(KEY).parent.mkdir(parents=True)
    os.rename(store.path_for(HASH), store.path_for(KEY))
    with pytest.raises(
        ArtifactError, match=f"binding mismatch: directory {KEY} holds an artifact bound to no checkpoint"
    ):
        store.open(KEY)
    # An unbound format-3 manifest resealed under the key fares no better.
    raw = read_manifest(store.path_for(KEY))
    write_manifest(store.path_for(KEY), raw, reseal=True)
    with pytest.raises(ArtifactError, match="bound to no checkpoint"):
        store.open(KEY)


async def test_bound_artifact_under_a_hash_is_refused(store: ArtifactStore) -> None:
    await publish(store, sample_files(), binding=BINDING)
    os.rename(store.path_for(KEY), store.path_for(HASH))
    with pytest.raises(
        ArtifactError, match=f"binding mismatch: directory {HASH} holds an artifact bound to {KEY}"
    ):
        store.open(HASH)


async def test_writer_key_and_binding_must_agree(store: ArtifactStore) -> None:
    with ArtifactWriter(store, HASH, key=KEY) as w:
        stage(w.directory, {"a.img": b"a"})
        with pytest.raises(ArtifactError, match=f"binding mismatch: artifact {KEY} needs a binding"):
            await w.publish(criu_version="4.1.1")
        elsewhere = BINDING.model_copy(update={"namespace": "tenant-b"})
        with pytest.raises(
            ArtifactError,
            match=f"binding mismatch: writer is for {KEY}, the binding is to tenant-b/{CHECKPOINT_UID}",
        ):
            await w.publish(criu_version="4.1.1", binding=elsewhere)
    with ArtifactWriter(store, HASH) as w:
        stage(w.directory, {"a.img": b"a"})
        with pytest.raises(
            ArtifactError,
            match=f"an artifact bound to {KEY} is published under that key, not under the identity hash",
        ):
            await w.publish(criu_version="4.1.1", binding=BINDING)
    assert entries(store) == []
    with pytest.raises(ValueError, match=f"a hash key names its identity: key {OTHER}, identity hash {HASH}"):
        ArtifactWriter(store, HASH, key=OTHER)
    with pytest.raises(ValueError, match=r"invalid artifact key '\.\./x'"):
        ArtifactWriter(store, HASH, key="../x")
    with pytest.raises(ValueError, match=r"invalid identity hash '\.\./x'"):
        ArtifactWriter(store, "../x", key=KEY)
    assert entries(store) == []


async def test_publish_from_another_pod_under_a_taken_key_is_refused(store: ArtifactStore) -> None:
    await publish(store, {"a.img": b"first"}, binding=BINDING)
    other_pod = BINDING.model_copy(update={"source_pod": "intruder", "source_pod_uid": "42"})
    with ArtifactWriter(store, HASH, key=KEY) as w:
        stage(w.directory, {"a.img": b"second"})
        message = (
            f"artifact {KEY} was already published from pod {BINDING.source_pod} "
            f"({BINDING.source_pod_uid}), not from intruder (42)"
        )
        with pytest.raises(ArtifactError, match=re.escape(message)):
            await w.publish(criu_version="4.1.1", binding=other_pod)
    assert store.open(KEY).manifest.binding == BINDING
    assert store.open(KEY).file_path("a.img").read_bytes() == b"first"
    # The same pod publishing again (a retried checkpoint) is told its artifact is there.
    again = await publish(store, {"a.img": b"third"}, binding=BINDING)
    assert not again.won
    assert again.artifact.manifest == store.open(KEY).manifest
    assert entries(store) == [NAMESPACE]


async def test_concurrent_publish_of_a_bound_key_exactly_one_wins(store: ArtifactStore) -> None:
    writers = [ArtifactWriter(store, HASH, key=KEY) for _ in range(4)]
    for i, w in enumerate(writers):
        stage(w.directory, {"pages-1.img": f"writer {i}".encode() * 1000})
    results = await asyncio.gather(
        *(
            w.publish(criu_version="4.1.1", binding=BINDING, extra={"writer": i})
            for i, w in enumerate(writers)
        )
    )
    assert sum(r.won for r in results) == 1
    published = store.open(KEY)
    published.verify()
    assert all(r.artifact.manifest == published.manifest for r in results)
    assert entries(store) == [NAMESPACE]


async def test_delete_bound_artifacts_and_their_namespace_directory(store: ArtifactStore) -> None:
    second = BINDING.model_copy(update={"checkpoint_uid": OTHER_UID})
    await publish(store, sample_files(), binding=BINDING)
    await publish(store, {"a.img": b"a"}, binding=second)
    assert store.delete(KEY) is True
    assert store.list() == [f"{NAMESPACE}/{OTHER_UID}"]
    assert store.delete(f"{NAMESPACE}/{OTHER_UID}") is True
    assert entries(store) == [], "the emptied namespace directory goes too"
    assert store.delete(KEY) is False
    assert (await publish(store, {"a.img": b"a"}, binding=BINDING)).won
    assert store.list() == [KEY]


async def test_interrupted_delete_of_a_bound_artifact_is_collected(store: ArtifactStore) -> None:
    await publish(store, sample_files(), binding=BINDING)
    doomed = store.hide(KEY)
    assert doomed is not None
    assert doomed.parent == store.root
    assert doomed.name.startswith(f".deleting-{NAMESPACE}_{CHECKPOINT_UID}-")
    assert store.list() == []
    with pytest.raises(ArtifactNotFoundError, match=f"no artifact {KEY} in {store.root}"):
        store.open(KEY)
    assert store.gc_partial() == [doomed]
    assert entries(store) == []


async def test_publish_survives_its_namespace_directory_removed_meanwhile(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ArtifactStore._parent_for
    calls = 0

    def delete_lands_in_between(self: ArtifactStore, key: str) -> Path:
        nonlocal calls
        calls += 1
        parent = real(self, key)
        if calls == 1:
            parent.rmdir()  # the last artifact of the namespace was deleted just now
        return parent

    monkeypatch.setattr(ArtifactStore, "_parent_for", delete_lands_in_between)
    result = await publish(store, sample_files(), binding=BINDING)
    assert result.won
    assert calls == 2
    assert store.list() == [KEY]
    store.open(KEY).verify()


async def test_namespace_named_like_a_hash_never_mixes_with_that_artifact(store: ArtifactStore) -> None:
    await publish(store, {"a.img": b"a"})
    binding = BINDING.model_copy(update={"namespace": HASH})
    message = (
        f"cannot publish {HASH}/{CHECKPOINT_UID}: {store.root / HASH} is an artifact, not the namespace's"
    )
    with pytest.raises(ArtifactError, match=re.escape(message)):
        await publish(store, {"b.img": b"b"}, binding=binding)
    assert entries(store) == [HASH]
    assert store.list() == [HASH]
    store.open(HASH).verify()


async def test_the_current_format_refused_by_a_reader_of_the_previous_one(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await publish(store, sample_files(), binding=BINDING)
    older = FORMAT_VERSION - 1
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", older)
    message = rf"^manifest format_version {FORMAT_VERSION} is newer than supported {older}$"
    with pytest.raises(ArtifactError, match=message):
        store.open(KEY)


async def test_format_2_artifact_of_an_older_agent_still_opens(store: ArtifactStore) -> None:
    await publish(store, sample_files())
    write_manifest(store.path_for(HASH), as_format(read_manifest(store.path_for(HASH)), 2))
    artifact = store.open(HASH)
    assert (artifact.manifest.format_version, artifact.manifest.digest, artifact.key) == (2, None, HASH)
    artifact.verify(expect_hash=HASH)


async def test_fetch_keeps_the_key_and_the_manifest_bytes(tmp_path: Path, store: ArtifactStore) -> None:
    await publish(store, sample_files(), binding=BINDING)
    # Written by another implementation: the identity's defaults left out, keys in another order, other
    # spacing. Its seal is of that content, which the parsed model would not write back the same.
    raw = read_manifest(store.path_for(KEY))
    raw["identity"] = IDENTITY.to_dict()
    write_manifest(store.path_for(KEY), dict(reversed(list(raw.items()))), reseal=True)
    source = store.open(KEY)
    assert source.manifest.to_json() != (source.path / MANIFEST_NAME).read_bytes()
    cache = ArtifactStore(tmp_path / "cache")
    result = await fetch(source, cache)
    assert result.won
    assert result.artifact.key == KEY
    assert result.path == cache.root / NAMESPACE / CHECKPOINT_UID
    assert (result.path / MANIFEST_NAME).read_bytes() == (source.path / MANIFEST_NAME).read_bytes()
    assert cache.open(KEY).manifest == source.manifest
    assert cache.list() == [KEY]
    cache.open(KEY).verify()
