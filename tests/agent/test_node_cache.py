"""The node cache through the agent's Executor with real CRIU: the first restore of a checkpoint on a node
reads the shared store and leaves a checked copy in the cache, the next one restores from that copy; a
damaged copy is dropped and the restore is made from the store instead; a checkpoint taken anew is never
restored from the old copy."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.artifact import ArtifactCache
from tests.agent.local_node import RestoreCalls, checkpoint_worker, local_executor
from tests.helpers.polling import await_json

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "0123456789abcdef"
RESTORES = "dynsnap_agent_cache_restores_total"


def restores(source: str) -> float:
    return REGISTRY.get_sample_value(RESTORES, {"source": source}) or 0.0


def _node(tmp: Path, criu_bin: Path) -> tuple[Executor, ProcessRuntime, RestoreCalls]:
    # Plain pages images: CRIU then restores straight from the artifact's directory, which shows which
    # copy it read.
    cache = ArtifactCache(tmp / "cache", 1 << 30)
    executor, runtime = local_executor(tmp, criu_bin, compress_pages=False, cache=cache)
    return executor, runtime, RestoreCalls(runtime)


async def _checkpoint(executor: Executor, runtime: ProcessRuntime, key: str = "source") -> None:
    await checkpoint_worker(executor, runtime, WORKER, HASH, {"WORKER_STATE_MIB": "24"}, key=key)


async def _restore_intact(executor: Executor, runtime: ProcessRuntime) -> str:
    outcome = await executor.restore("restored", HASH)
    try:
        verdict = await await_json(outcome.workload.control_dir / "verify.json")
        assert verdict["restored"] is True
        assert verdict["digest_after"] == verdict["digest_before"], "memory changed across the restore"
    finally:
        await runtime.stop("restored")
        await asyncio.to_thread(shutil.rmtree, outcome.workload.control_dir, True)
    return outcome.source


async def test_second_restore_reads_the_node_cache(criu_bin: Path, tmp_path: Path) -> None:
    executor, runtime, calls = _node(tmp_path, criu_bin)
    assert executor.cache is not None
    await _checkpoint(executor, runtime)
    from_store, from_cache = restores("store"), restores("cache")

    assert await _restore_intact(executor, runtime) == "store"
    assert calls.images[-1].is_relative_to(tmp_path / "store")
    await executor.wait_cache_fills()
    assert executor.cache.store.list() == [HASH]
    assert executor.cache.store.open(HASH).manifest == executor.store.open(HASH).manifest

    assert await _restore_intact(executor, runtime) == "cache"
    assert calls.images[-1].is_relative_to(tmp_path / "cache")
    assert restores("store") == from_store + 1
    assert restores("cache") == from_cache + 1


async def test_damaged_cached_copy_falls_back_to_the_store(criu_bin: Path, tmp_path: Path) -> None:
    executor, runtime, calls = _node(tmp_path, criu_bin)
    assert executor.cache is not None
    await _checkpoint(executor, runtime)
    await _restore_intact(executor, runtime)
    await executor.wait_cache_fills()
    pages = max((tmp_path / "cache" / HASH / "criu").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with pages.open("r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 16)
    refused = restores("refused")

    assert await _restore_intact(executor, runtime) == "store"
    assert calls.images[-1].is_relative_to(tmp_path / "store")
    assert restores("refused") == refused + 1
    # The bad copy is gone and a good one takes its place.
    await executor.wait_cache_fills()
    executor.cache.store.open(HASH).verify(expect_hash=HASH)
    assert await _restore_intact(executor, runtime) == "cache"


async def test_checkpoint_taken_anew_is_not_restored_from_the_old_copy(
    criu_bin: Path, tmp_path: Path
) -> None:
    executor, runtime, calls = _node(tmp_path, criu_bin)
    assert executor.cache is not None
    await _checkpoint(executor, runtime)
    await _restore_intact(executor, runtime)
    await executor.wait_cache_fills()
    old = executor.cache.store.open(HASH).manifest

    executor.store.delete(HASH)
    await _checkpoint(executor, runtime, "source-2")
    assert await _restore_intact(executor, runtime) == "store"
    assert calls.images[-1].is_relative_to(tmp_path / "store")
    await executor.wait_cache_fills()
    assert executor.cache.store.open(HASH).manifest != old
    assert await _restore_intact(executor, runtime) == "cache"
