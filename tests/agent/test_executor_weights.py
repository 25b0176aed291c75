"""Decoupled weights through the agent's Executor with real CRIU: the worker's weights file travels in
the artifact (not in the CRIU image) and is put back where the worker looks; a missing, truncated or
substituted weights file, or other weights in the way, is refused before the worker resumes; damage
only the checksums find is refused before the worker uses the weights (a worker that waits for the
agent's verdict resumes while they are checked)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import logging
import os
import time
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.agent.executor import AgentError, Executor
from dynamo_snapshot.agent.prefetch import PREFETCH_FILE, read_plan
from dynamo_snapshot.agent.restore import RestoreRun
from dynamo_snapshot.agent.runtime import ProcessRuntime
from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.agent.weights import WeightsPlacementError, WorkerFile, gpu_memory_problem, locate
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.workload import parse_restore_complete
from dynamo_snapshot.workload.weights import data_digest, read_header
from tests.agent.local_node import checkpoint_worker, local_executor
from tests.artifact.helpers import flip_a_byte
from tests.helpers.polling import await_json

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "test/decoupled", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)
WEIGHTS = "weights/00-model.dsw"


async def _checkpoint(
    tmp: Path, criu_bin: Path, *, waits_for_check: bool = True, **settings: Any
) -> tuple[Executor, ProcessRuntime, Path]:
    executor, runtime = local_executor(tmp, criu_bin, **{"compress_pages": True, **settings})
    env = {"WORKER_WAITS_FOR_CHECK": "1" if waits_for_check else "0"}
    # A fresh node: the source pod's control dir (and its copy of the weights) is gone.
    source = await checkpoint_worker(executor, runtime, WORKER, HASH, env, identity=IDENTITY)
    return executor, runtime, source.control_dir


@pytest.mark.criu
async def test_weights_travel_in_the_artifact_and_come_back(criu_bin: Path, tmp_path: Path) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    artifact = executor.store.open(HASH)
    assert [w["file"] for w in artifact.manifest.extra["weights"]] == [WEIGHTS]  # type: ignore[index,union-attr]
    assert artifact.manifest.extra["gpuMemory"] == {"heldMiB": 0, "releasedMiB": 3}
    assert artifact.manifest.features == ["compressed-pages"], "plain weights: no feature"
    images = sum(p.stat().st_size for p in (artifact.path / "criu").iterdir())
    assert images < 64 << 20

    prefetched_before = REGISTRY.get_sample_value("dynsnap_agent_prefetch_bytes_total") or 0.0
    restored = await executor.restore("restored", HASH)
    try:
        verdict = await await_json(ctl / "verify.json", settle=0.05)
        assert verdict == {"weights_ok": True, "digest_ok": True, "restored": True}
        # Put back as the artifact's own (verified) file, not a copy.
        assert await asyncio.to_thread(
            os.path.samefile, ctl / "weights" / "model.dsw", artifact.path / WEIGHTS
        )
        assert {"verify", "criu_restore", "weights_wait", "signal"} <= restored.timings.phases.keys()
        assert "weights_verify" in restored.timings.overlapped
        # The node files the worker mapped (python, its libraries) were read ahead, none skipped.
        plan = read_plan(artifact.path / PREFETCH_FILE)
        assert any(Path(f.path).name.startswith(("python", "libpython")) for f in plan.files)
        assert restored.prefetch is not None
        assert restored.prefetch.files == len(plan.files)
        assert restored.prefetch.bytes == plan.bytes
        assert restored.prefetch.skipped == 0
        prefetched = REGISTRY.get_sample_value("dynsnap_agent_prefetch_bytes_total")
        assert prefetched == prefetched_before + plan.bytes
    finally:
        await runtime.stop("restored")


def _hold_weights_check(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Keep the agent's weights check from starting until the returned event is set, as a big file
    on a slow disk would."""
    release = asyncio.Event()
    check = RestoreRun.verify_weights

    async def held(self: RestoreRun, *args: Any, **kwargs: Any) -> Any:
        await release.wait()
        return await check(self, *args, **kwargs)

    monkeypatch.setattr(RestoreRun, "verify_weights", held)
    return release


async def _appears(path: Path, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(path.exists):
        assert time.monotonic() < deadline, f"{path} did not appear"
        await asyncio.sleep(0.02)


@pytest.mark.criu
async def test_a_worker_that_waits_for_the_verdict_resumes_before_the_check_ends(
    criu_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    assert executor.store.open(HASH).manifest.extra["weightsEarlyLoad"] is True
    release = _hold_weights_check(monkeypatch)
    restoring = asyncio.create_task(executor.restore("restored", HASH))
    try:
        # Resumed and told the check is pending: it may load now, but it waits for the verdict.
        await _appears(ctl / "loading-before-verdict")
        info = parse_restore_complete((ctl / "restore-complete").read_text()) or {}
        assert info["weightsCheck"] == "pending"
        await asyncio.sleep(0.3)
        assert not (ctl / "verify.json").exists()
        assert not (ctl / "weights-verified").exists()
        release.set()
        restored = await restoring
        assert (ctl / "weights-verified").exists()
        assert (await await_json(ctl / "verify.json", settle=0.05))["weights_ok"]
        assert "weights_wait" in restored.timings.phases
    finally:
        release.set()
        await asyncio.gather(restoring, return_exceptions=True)
        await runtime.stop("restored")


@pytest.mark.criu
async def test_a_bad_verdict_after_the_early_resume_stops_the_worker(
    criu_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    _flip_a_byte(executor.store.path_for(HASH) / WEIGHTS)
    release = _hold_weights_check(monkeypatch)
    restoring = asyncio.create_task(executor.restore("restored", HASH))
    await _appears(ctl / "loading-before-verdict")
    release.set()
    with pytest.raises(AgentError, match=rf"weights of artifact .* refused: .*checksum mismatch: {WEIGHTS}"):
        await restoring
    # It never got the verdict, so it never used the weights; it is gone, and so is its go-ahead.
    assert await runtime.find("restored") is None
    assert not (ctl / "verify.json").exists()
    assert not (ctl / "weights-verified").exists()
    assert not (ctl / "restore-complete").exists()


@pytest.mark.criu
async def test_a_worker_of_an_older_sdk_resumes_only_after_the_check(
    criu_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin, waits_for_check=False)
    assert executor.store.open(HASH).manifest.extra["weightsEarlyLoad"] is False
    release = _hold_weights_check(monkeypatch)
    restoring = asyncio.create_task(executor.restore("restored", HASH))
    try:
        await asyncio.sleep(1.0)  # CRIU is done with this small worker by now; the check is held
        assert not (ctl / "restore-complete").exists()
        release.set()
        await restoring
        info = parse_restore_complete((ctl / "restore-complete").read_text()) or {}
        assert "weightsCheck" not in info
        assert (await await_json(ctl / "verify.json", settle=0.05))["weights_ok"]
        assert not (ctl / "loading-before-verdict").exists()
    finally:
        release.set()
        await asyncio.gather(restoring, return_exceptions=True)
        await runtime.stop("restored")


def _truncate(p: Path) -> None:
    with p.open("r+b") as f:
        f.truncate(p.stat().st_size - 4096)


def _garbage(p: Path) -> None:
    # Not a weights file at all, same size: a new file replaces the artifact's.
    data = os.urandom(p.stat().st_size)
    p.unlink()
    p.write_bytes(data)


def _flip_a_byte(p: Path) -> None:
    # Corrupted in place (the artifact's own inode): header and size still right, one chunk wrong.
    flip_a_byte(p, p.stat().st_size - 100)


def _other_model(p: Path) -> None:
    # A well-formed weights file of the same size and layout, holding other weights.
    header, _ = read_header(p)
    data = os.urandom(header.data_bytes)
    chunk = header.chunk_bytes
    digests = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    other = dataclasses.replace(header, chunk_sha256=tuple(digests), data_digest=data_digest(digests))
    p.unlink()
    p.write_bytes(other.encode() + data)


@pytest.mark.criu
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.unlink(), f"missing file: {WEIGHTS}"),
        (_truncate, f"unexpected file size: {WEIGHTS}"),
        (_garbage, f"{WEIGHTS} is not the checkpoint's weights file"),
        (_other_model, f"{WEIGHTS} holds other weights (data digest"),
        (_flip_a_byte, f"checksum mismatch: {WEIGHTS}"),
    ],
    ids=["missing", "truncated", "not-weights", "other-model", "flipped-byte"],
)
async def test_bad_weights_are_refused_before_the_worker_resumes(
    criu_bin: Path, tmp_path: Path, damage: Any, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    damage(executor.store.path_for(HASH) / WEIGHTS)
    with pytest.raises(AgentError, match=r"weights of artifact .* refused") as err:
        await executor.restore("restored", HASH)
    assert message in str(err.value)
    # The weights check begun beside the refusal failed too; what it failed with was collected, not
    # left for the garbage collector to print as a traceback.
    gc.collect()
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    # The restored process was stopped before restore-complete: it never resumed.
    assert not (ctl / "verify.json").exists()
    assert not (ctl / "restore-complete").exists()
    assert await runtime.find("restored") is None
    pidfile = ctl / ".criu-restore.pid"
    if pidfile.exists():
        assert not pid_running(int(pidfile.read_text()))


@pytest.mark.criu
async def test_a_refused_process_image_cancels_the_weights_check_begun_beside_it(
    criu_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    # The default: the check starts with the process check.
    assert executor.config.restore.weights_check_idle_io
    began, cancelled = asyncio.Event(), asyncio.Event()

    async def endless(self: RestoreRun, *args: Any, **kwargs: Any) -> Any:
        began.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(RestoreRun, "verify_weights", endless)
    images = executor.store.path_for(HASH) / "criu"
    victim = max((p for p in images.glob("core-*.img")), key=lambda p: p.stat().st_size)
    _flip_a_byte(victim)
    with pytest.raises(AgentError, match=rf"refused: checksum mismatch: criu/{victim.name}"):
        await executor.restore("restored", HASH)
    assert began.is_set()
    assert cancelled.is_set()
    assert await runtime.find("restored") is None
    assert not (ctl / "restore-complete").exists()


@pytest.mark.criu
@pytest.mark.parametrize("idle_io", [True, False], ids=["idle-io-with-process-check", "after-process-check"])
async def test_where_the_weights_check_starts(
    criu_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_io: bool
) -> None:
    """At idle I/O priority the weights check takes only the disk time nobody else wants: it starts with
    the check of the process images; at normal priority only once that passed."""
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin, weights_check_idle_io=idle_io)
    seen: list[bool] = []
    check_process = RestoreRun.verify_process_images

    async def recording(self: RestoreRun) -> None:
        seen.append(self.weights_check is not None)
        await check_process(self)

    monkeypatch.setattr(RestoreRun, "verify_process_images", recording)
    await executor.restore("restored", HASH)
    try:
        assert seen == [idle_io]
        assert (await await_json(ctl / "verify.json", settle=0.05))["weights_ok"]
    finally:
        await runtime.stop("restored")


@pytest.mark.criu
async def test_other_weights_at_the_path_are_not_overwritten(criu_bin: Path, tmp_path: Path) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    theirs = ctl / "weights" / "model.dsw"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"somebody else's file")
    with pytest.raises(AgentError, match=r"holds other weights .* not overwriting it"):
        await executor.restore("restored", HASH)
    assert theirs.read_bytes() == b"somebody else's file"
    assert not (ctl / "verify.json").exists()
    assert await runtime.find("restored") is None


@pytest.mark.criu
async def test_a_second_restore_skips_checked_files_but_not_changed_ones(
    criu_bin: Path, tmp_path: Path
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    await executor.restore("first", HASH)
    try:
        assert (await await_json(ctl / "verify.json", settle=0.05))["weights_ok"]
    finally:
        await runtime.stop("first")
    artifact = executor.store.open(HASH)
    process = [f for f in artifact.manifest.files if not f.path.startswith("weights/")]
    assert executor.verified is not None
    assert all(executor.verified.known(artifact.path, f) for f in process), (
        "the first restore's check was not kept"
    )
    # Changed in place after that check: the next restore on this node must hash it again and refuse.
    pages = max((artifact.path / "criu").glob("pages-*"), key=lambda p: p.stat().st_size)
    _flip_a_byte(pages)
    with pytest.raises(AgentError, match=rf"refused: checksum mismatch: criu/{pages.name}"):
        await executor.restore("second", HASH)
    assert await runtime.find("second") is None


def test_where_the_agent_finds_a_workers_weights_path() -> None:
    host_ctl = Path("/var/lib/agent/pod-1")
    assert locate(
        "/snapshot-control/weights/m.dsw", "/snapshot-control", host_ctl, host_process=False
    ) == WorkerFile(host_ctl, PurePosixPath("weights/m.dsw"))
    assert locate("/models/m.dsw", "/ctl", host_ctl, host_process=True) == WorkerFile(
        Path("/models"), PurePosixPath("m.dsw")
    )
    with pytest.raises(WeightsPlacementError, match="outside the control dir"):
        locate("/models/m.dsw", "/snapshot-control", host_ctl, host_process=False)
    with pytest.raises(WeightsPlacementError, match="absolute"):
        locate("weights/m.dsw", "/ctl", host_ctl, host_process=True)
    with pytest.raises(WeightsPlacementError, match="absolute"):
        locate("/ctl/../etc/passwd", "/ctl", host_ctl, host_process=True)
    with pytest.raises(WeightsPlacementError, match="the control dir itself"):
        locate("/ctl", "/ctl", host_ctl, host_process=False)


def test_gpu_memory_check() -> None:
    assert gpu_memory_problem([80_000], held_mib=1_000, released_mib=60_000) is None
    problem = gpu_memory_problem([20_000], held_mib=1_000, released_mib=60_000)
    assert problem == (
        "not enough free GPU memory: 20000 MiB free on 1 GPU(s), the checkpoint needs 61000 MiB "
        "(1000 MiB held by the worker at checkpoint + 60000 MiB it maps again after the restore)"
    )
