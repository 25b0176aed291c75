"""Compressed pages images through the agent's Executor with real CRIU: a checkpoint stores the pages
packed, a restore unpacks them into a staging images directory that CRIU restores from (the worker has
its memory back) and that is gone afterwards; a damaged packed file is refused before anything runs,
whether the manifest's digest or the format's own checks find it; an artifact of plain pages (written
with packing off) restores from the artifact itself; an unusable scratch falls back beside the
workload's control dir."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.executor import AgentError, Executor
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.artifact import ArtifactWriter
from dynamo_snapshot.criu.packed import PACKED_SUFFIX, is_packed_pages, unpacked_size
from tests.agent.local_node import RestoreCalls, checkpoint_worker, local_executor
from tests.helpers.polling import await_json

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "00112233aabbccdd"
SAVED = "dynsnap_agent_page_bytes_compressed_saved_total"


async def _checkpoint(
    tmp: Path, criu_bin: Path, *, compress: bool = True, scratch: Path | None = None
) -> tuple[Executor, ProcessRuntime, Path]:
    executor, runtime = local_executor(
        tmp,
        criu_bin,
        compress_pages=compress,
        restore_scratch=scratch if scratch is not None else tmp / "scratch",
    )
    source = await checkpoint_worker(executor, runtime, WORKER, HASH, {"WORKER_STATE_MIB": "48"})
    return executor, runtime, source.control_dir


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


async def _restored_intact(executor: Executor, runtime: ProcessRuntime, ctl: Path) -> dict[str, float]:
    restored = await executor.restore("restored", HASH)
    try:
        verdict = await await_json(ctl / "verify.json")
        assert verdict["restored"] is True
        assert verdict["digest_after"] == verdict["digest_before"], "memory changed across the restore"
    finally:
        await runtime.stop("restored")
    return restored.timings.phases


async def test_pages_are_stored_compressed_and_restored_from_a_staging_dir(
    criu_bin: Path, tmp_path: Path
) -> None:
    saved_before = REGISTRY.get_sample_value(SAVED) or 0.0
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    artifact = executor.store.open(HASH)
    images = artifact.path / "criu"
    packed = sorted(p for p in images.iterdir() if is_packed_pages(p.name))
    assert packed, f"no packed pages image in {sorted(p.name for p in images.iterdir())}"
    # Sealed as they are stored; the plain ones they replace are gone, and nothing half-written is left.
    sealed = {f.path for f in artifact.manifest.files}
    for p in packed:
        assert f"criu/{p.name}" in sealed
        assert not p.with_name(p.name.removesuffix(PACKED_SUFFIX)).exists()
    assert not [p.name for p in images.iterdir() if p.name.endswith(".tmp")]
    info = artifact.manifest.extra["pagesCompressed"]
    assert isinstance(info, dict)
    before, after = info["bytesBefore"], info["bytesAfter"]
    assert isinstance(before, int)
    assert isinstance(after, int)
    assert info["files"] == len(packed)
    assert after == sum(p.stat().st_size for p in packed)
    assert before == sum(unpacked_size(p) for p in packed)
    assert after < before / 2, (before, after)  # three quarters of the state in four letters
    assert "compress_pages" in artifact.manifest.timings
    assert artifact.manifest.features == ["compressed-pages"], "a reader must know to unpack them"
    assert REGISTRY.get_sample_value(SAVED) == saved_before + before - after

    calls = RestoreCalls(runtime)
    phases = await _restored_intact(executor, runtime, ctl)
    assert "unpack_wait" in phases
    # CRIU read a staging dir under the scratch: plain files only (copies, no links into the store),
    # the pages under their plain names, nothing packed; the dir is gone once CRIU returned.
    (staged,) = calls.images
    assert staged.parent == tmp_path / "scratch"
    (seen,) = calls.seen
    assert not any(link for link, _ in seen.values())
    assert not any(is_packed_pages(name) for name in seen)
    for p in packed:
        assert seen[p.name.removesuffix(PACKED_SUFFIX)] == (False, unpacked_size(p))
    assert set(seen) == {
        f.removeprefix("criu/").removesuffix(PACKED_SUFFIX) for f in sealed if f.startswith("criu/")
    }
    assert _leftovers(tmp_path / "scratch") == []


async def test_a_damaged_packed_image_is_refused_before_anything_runs(criu_bin: Path, tmp_path: Path) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    images = executor.store.open(HASH).path / "criu"
    victim = max((p for p in images.iterdir() if is_packed_pages(p.name)), key=lambda p: p.stat().st_size)
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    calls = RestoreCalls(runtime)
    with pytest.raises(AgentError, match=rf"refused: checksum mismatch: criu/{victim.name}"):
        await executor.restore("restored", HASH)
    assert calls.images == [], "CRIU must not run on pages whose digest did not match"
    assert not (ctl / "verify.json").exists()
    assert await runtime.find("restored") is None
    assert _leftovers(tmp_path / "scratch") == []


async def test_a_garbled_packed_image_sealed_as_it_is_is_refused_by_its_format(
    criu_bin: Path, tmp_path: Path
) -> None:
    """Damage the manifest cannot see (sealed after it happened): the format's own checks refuse it
    before CRIU runs, rather than CRIU restoring short or wrong pages."""
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    good = executor.store.open(HASH)
    other = "ffeeddccbbaa9988"
    writer = ArtifactWriter(executor.store, other)
    shutil.copytree(good.path / "criu", writer.directory / "criu")
    victim = max(
        (p for p in (writer.directory / "criu").iterdir() if is_packed_pages(p.name)),
        key=lambda p: p.stat().st_size,
    )
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size - 100)
    await writer.publish(criu_version=good.manifest.criu_version, extra=good.manifest.extra)
    calls = RestoreCalls(runtime)
    with pytest.raises(AgentError, match=rf"artifact {other} refused: {victim.name}: truncated"):
        await executor.restore("restored", other)
    assert calls.images == []
    assert await runtime.find("restored") is None
    assert not (ctl / "verify.json").exists()
    assert _leftovers(tmp_path / "scratch") == []


async def test_an_artifact_of_plain_pages_restores_as_before(criu_bin: Path, tmp_path: Path) -> None:
    # As an agent before compression wrote it (or one with --no-compress-pages).
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin, compress=False)
    artifact = executor.store.open(HASH)
    assert not [f.path for f in artifact.manifest.files if is_packed_pages(f.path)]
    assert artifact.manifest.extra["pagesCompressed"] == {"files": 0, "bytesBefore": 0, "bytesAfter": 0}
    assert artifact.manifest.features == []
    executor.config.checkpoint.compress_pages = True  # the restoring agent compresses its own checkpoints
    calls = RestoreCalls(runtime)
    phases = await _restored_intact(executor, runtime, ctl)
    assert calls.images == [artifact.path / "criu"], "CRIU reads the artifact's own images"
    assert "unpack_wait" not in phases
    assert _leftovers(tmp_path / "scratch") == []


async def test_an_unusable_scratch_falls_back_beside_the_control_dir(
    criu_bin: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "scratch-file"
    not_a_dir.write_text("")
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin, scratch=not_a_dir)
    calls = RestoreCalls(runtime)
    with caplog.at_level(logging.WARNING, logger="dynamo_snapshot.agent.page_images"):
        phases = await _restored_intact(executor, runtime, ctl)
    assert "unpack_wait" in phases
    fallback = runtime.control_dir("restored").parent / ".restore-images"
    (staged,) = calls.images
    assert staged.parent == fallback
    assert any(str(not_a_dir) in str(r.__dict__.get("dir")) for r in caplog.records), caplog.text
    assert _leftovers(fallback) == []


async def test_staging_dirs_of_a_dead_agent_are_removed(criu_bin: Path, tmp_path: Path) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    scratch = tmp_path / "scratch"
    # An agent killed mid-restore leaves its staging behind; a live one's is not touched.
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    assert not pid_running(dead.pid)
    (scratch / f"{dead.pid}-old-restore-1234").mkdir(parents=True)
    (scratch / f"{os.getppid()}-other-agent-5678").mkdir()
    await _restored_intact(executor, runtime, ctl)
    assert _leftovers(scratch) == [f"{os.getppid()}-other-agent-5678"]


async def test_staging_of_a_dead_agent_is_removed_when_the_agent_starts(
    criu_bin: Path, tmp_path: Path
) -> None:
    executor, _, _ = await _checkpoint(tmp_path, criu_bin)
    scratch = tmp_path / "scratch"
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    (scratch / f"{dead.pid}-old-restore-1234").mkdir(parents=True)
    (scratch / f"{os.getppid()}-other-agent-5678").mkdir()
    await executor.remove_abandoned_scratch()  # what NodeAgent.run_until does first, before any restore
    assert _leftovers(scratch) == [f"{os.getppid()}-other-agent-5678"]
