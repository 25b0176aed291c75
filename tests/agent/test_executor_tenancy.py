"""Artifacts that belong to one namespace and one checkpoint, through the agent's Executor with real CRIU:
a checkpoint with a binding is published under ``<namespace>/<checkpoint uid>`` with a sealed manifest;
a restore given the digest the checkpoint recorded uses only that artifact, from the store or the node
cache; an edited manifest, an artifact bound elsewhere or another digest is refused before anything runs;
an artifact is deleted from the store and the node cache, never while a restore on the node reads it."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.agent.executor import ArtifactRefused, Executor
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.artifact import MANIFEST_NAME, ArtifactCache, Binding
from tests.agent.local_node import RestoreCalls, checkpoint_worker_outcome, local_executor, restore_intact

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "0123456789abcdef"
UID = "5b0e4c1a-2f3d-4e5f-8a9b-0c1d2e3f4a5b"
BINDING = Binding(
    namespace="tenant-a",
    checkpoint_name="worker",
    checkpoint_uid=UID,
    source_pod="worker-checkpoint-abcde",
    source_pod_uid="c0ffee00-1111-4222-8333-444455556666",
)
KEY = f"tenant-a/{UID}"
ENV = {"WORKER_STATE_MIB": "16"}


async def _checkpoint(executor: Executor, runtime: ProcessRuntime, key: str = "source") -> tuple[str, str]:
    """Checkpoint the CPU worker bound to ``BINDING``; the key and manifest digest it reported."""
    _, outcome = await checkpoint_worker_outcome(
        executor, runtime, WORKER, HASH, ENV, key=key, binding=BINDING
    )
    return outcome.key, outcome.manifest_digest


async def _restore_intact(executor: Executor, runtime: ProcessRuntime, digest: str) -> str:
    return await restore_intact(executor, runtime, KEY, digest)


async def _refused(
    executor: Executor, runtime: ProcessRuntime, calls: RestoreCalls, key: str, **kw: Any
) -> str:
    """The message of a restore refused before anything ran."""
    before = len(calls.images)
    with pytest.raises(ArtifactRefused) as err:
        await executor.restore("refused", key, **kw)
    assert len(calls.images) == before, "CRIU ran for a refused artifact"
    assert await runtime.find("refused") is None
    return str(err.value)


async def test_bound_artifact_restores_only_as_recorded(criu_bin: Path, tmp_path: Path) -> None:
    executor, runtime = local_executor(tmp_path, criu_bin)
    calls = RestoreCalls(runtime)
    key, digest = await _checkpoint(executor, runtime)
    assert key == KEY
    artifact = executor.published(KEY)
    assert artifact is not None
    assert artifact.path == tmp_path / "store" / "tenant-a" / UID
    assert artifact.manifest.binding == BINDING
    assert artifact.manifest.digest == digest
    assert len(digest) == 64
    assert executor.published(HASH) is None, "not also published under the identity hash"
    assert executor.store.list() == [KEY]

    wrong = "0" * 64
    assert await _refused(executor, runtime, calls, KEY, manifest_digest=wrong) == (
        f"artifact {KEY} is not the one checkpoint recorded (manifest digest {digest}, expected {wrong})"
    )
    assert await _restore_intact(executor, runtime, digest) == "store"

    # Copied into another namespace's place: bound to tenant-a, so refused as tenant-b's.
    planted = tmp_path / "store" / "tenant-b" / UID
    planted.parent.mkdir()
    shutil.copytree(artifact.path, planted)
    message = await _refused(executor, runtime, calls, f"tenant-b/{UID}")
    assert message == (
        f"artifact tenant-b/{UID} refused: binding mismatch: directory tenant-b/{UID} holds an artifact "
        f"bound to {KEY} (checkpoint {BINDING.checkpoint_name})"
    )

    # One byte of extra.control_dir changed: the seal breaks, with or without a digest to compare.
    manifest = artifact.path / MANIFEST_NAME
    data = manifest.read_bytes()
    control_dir = f'"control_dir": "{tmp_path / "node-a" / "source"}'.encode()
    assert control_dir in data
    manifest.write_bytes(data.replace(control_dir, control_dir[:-1] + b"X"))
    for kw in ({}, {"manifest_digest": digest}):
        message = await _refused(executor, runtime, calls, KEY, **kw)
        assert message.startswith(f"artifact {KEY} refused: {manifest} was changed after it was sealed: ")
    assert executor.published(KEY) is None


async def test_recorded_digest_holds_for_the_node_cache(criu_bin: Path, tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", 1 << 30)
    executor, runtime = local_executor(tmp_path, criu_bin, compress_pages=False, cache=cache)
    calls = RestoreCalls(runtime)
    _, first = await _checkpoint(executor, runtime)
    assert await _restore_intact(executor, runtime, first) == "store"
    await executor.wait_cache_fills()
    assert cache.store.list() == [KEY]
    assert cache.store.open(KEY).manifest.digest == first
    assert await _restore_intact(executor, runtime, first) == "cache"
    await _refused(executor, runtime, calls, KEY, manifest_digest="1" * 64)

    # Taken anew under the same checkpoint: a new digest. The node cache still holds a copy with the
    # old one, but the store decides: a restore that asks for the old digest gets nothing.
    executor.store.delete(KEY)
    _, second = await _checkpoint(executor, runtime, key="source-2")
    assert second != first
    message = await _refused(executor, runtime, calls, KEY, manifest_digest=first)
    assert f"(manifest digest {second}, expected {first})" in message
    # And one that asks for the new digest is not served the old copy.
    assert await _restore_intact(executor, runtime, second) == "store"
    assert calls.images[-1].is_relative_to(tmp_path / "store")
    await executor.wait_cache_fills()
    assert cache.store.open(KEY).manifest.digest == second
    assert await _restore_intact(executor, runtime, second) == "cache"


async def test_delete_artifact_waits_for_restores_and_removes_every_copy(
    criu_bin: Path, tmp_path: Path
) -> None:
    cache = ArtifactCache(tmp_path / "cache", 1 << 30)
    executor, runtime = local_executor(tmp_path, criu_bin, cache=cache)
    _, digest = await _checkpoint(executor, runtime)
    with pytest.raises(ValueError, match="invalid artifact key"):
        await executor.delete_artifact("../tenant-a")

    # A restore is reading it: nothing is removed.
    reading, go_on = asyncio.Event(), asyncio.Event()
    restore = runtime.restore

    async def held(*args: Any, **kwargs: Any) -> Any:
        reading.set()
        await go_on.wait()
        return await restore(*args, **kwargs)

    runtime.restore = held  # type: ignore[method-assign]
    restoring = asyncio.create_task(_restore_intact(executor, runtime, digest))
    await asyncio.wait_for(reading.wait(), 60)
    assert await executor.delete_artifact(KEY) is False
    assert executor.store.exists(KEY)
    go_on.set()
    assert await restoring == "store"
    runtime.restore = restore  # type: ignore[method-assign]
    await executor.wait_cache_fills()
    assert cache.store.exists(KEY)

    # While it is being removed, no restore starts on it.
    removing, finish = threading.Event(), threading.Event()
    delete = executor.store.delete

    def slow_delete(key: str) -> bool:
        removing.set()
        finish.wait(60)
        return delete(key)

    executor.store.delete = slow_delete  # type: ignore[method-assign]
    deleting = asyncio.create_task(executor.delete_artifact(KEY))
    assert await asyncio.to_thread(removing.wait, 60)
    with pytest.raises(ArtifactRefused, match=f"^artifact {KEY} refused: it is being deleted$"):
        await executor.restore("refused", KEY, manifest_digest=digest)
    finish.set()
    assert await deleting is True

    assert not executor.store.exists(KEY)
    assert not cache.store.exists(KEY)
    assert not (tmp_path / "store" / "tenant-a").exists()
    assert not (tmp_path / "cache" / "tenant-a").exists()
    assert executor.published(KEY) is None
    with pytest.raises(ArtifactRefused, match=f"no artifact {KEY}"):
        await executor.restore("refused", KEY, manifest_digest=digest)
    assert await executor.delete_artifact(KEY) is True, "nothing left to remove"
