"""The agent's restore as the benchmarks vary it (benchmarks/agent_variants.py), with real CRIU: the
pages checked while CRIU restores a tree held stopped, and the weights check started after the check of
the process images."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.agent_variants import StoppableProcessRuntime, VariantExecutor, VariantRestoreRun
from dynamo_snapshot.agent.executor import AgentError
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from tests.agent.local_node import checkpoint_worker, local_executor
from tests.artifact.helpers import flip_a_byte
from tests.helpers.polling import await_json

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "weights_worker.py"
IDENTITY = CheckpointIdentity.model_validate({"model": "test/variants", "backendFramework": "vllm"})
HASH = compute_identity_hash(IDENTITY)


async def _checkpoint(tmp: Path, criu_bin: Path) -> tuple[VariantExecutor, StoppableProcessRuntime, Path]:
    # Plain pages images: compressed ones are checked before they are unpacked, never beside CRIU.
    executor, runtime = local_executor(
        tmp, criu_bin, kind=VariantExecutor, runtime_kind=StoppableProcessRuntime, compress_pages=False
    )
    source = await checkpoint_worker(
        executor, runtime, WORKER, HASH, {"WORKER_WAITS_FOR_CHECK": "1"}, identity=IDENTITY
    )
    return executor, runtime, source.control_dir


def _flip_a_byte(p: Path) -> None:
    flip_a_byte(p, p.stat().st_size - 100)


@pytest.mark.criu
@pytest.mark.parametrize("flip", [False, True], ids=["intact", "flipped-page"])
async def test_pages_checked_while_criu_restores_a_stopped_tree(
    criu_bin: Path, tmp_path: Path, flip: bool
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    executor.overlap_page_check = True
    (pages,) = (executor.store.path_for(HASH) / "criu").glob("pages-*.img")
    if not flip:
        restored = await executor.restore("restored", HASH)
        try:
            assert (await await_json(ctl / "verify.json", settle=0.05))["weights_ok"]
            assert "pages_wait" in restored.timings.phases
        finally:
            await runtime.stop("restored")
        return
    _flip_a_byte(pages)
    with pytest.raises(AgentError, match=r"refused: checksum mismatch: criu/pages-"):
        await executor.restore("restored", HASH)
    # The tree CRIU rebuilt stayed stopped and was killed: it never ran.
    assert not (ctl / "verify.json").exists()
    assert await runtime.find("restored") is None


@pytest.mark.criu
@pytest.mark.parametrize("early", [True, False], ids=["with-process-check", "after-process-check"])
async def test_where_the_weights_check_starts(
    criu_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, early: bool
) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    executor.weights_check_early = early
    seen: list[bool] = []
    check_process = VariantRestoreRun.verify_process_images

    async def recording(self: VariantRestoreRun) -> None:
        seen.append(self.weights_check is not None)
        await check_process(self)

    monkeypatch.setattr(VariantRestoreRun, "verify_process_images", recording)
    restored = await executor.restore("restored", HASH)
    try:
        assert seen == [early]
        assert "pages_wait" not in restored.timings.phases, "no overlap unless asked"
        assert (await await_json(ctl / "verify.json", settle=0.05))["weights_ok"]
    finally:
        await runtime.stop("restored")


@pytest.mark.criu
@pytest.mark.parametrize("when", ["before_signal", "after_signal"])
async def test_lazy_pages_fill_the_restored_tree(criu_bin: Path, tmp_path: Path, when: str) -> None:
    executor, runtime, ctl = await _checkpoint(tmp_path, criu_bin)
    executor.lazy_pages = when
    restored = await executor.restore("restored", HASH)
    try:
        # The worker reads its weights and compares them with what it wrote before the checkpoint: every
        # page the daemon moved is the image's.
        assert (await await_json(ctl / "verify.json", settle=0.05))["weights_ok"]
        assert "lazy_pages_wait" in restored.timings.phases
        log = (runtime.control_dir("restored") / "lazy-pages.log").read_text()
        moved = re.findall(r"UFFD transferred pages: \((\d+)/(\d+)\)", log)
        assert moved
        assert all(done == total for done, total in moved)
    finally:
        await runtime.stop("restored")
