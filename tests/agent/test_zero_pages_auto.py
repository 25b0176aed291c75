"""The agent's zero-page rewrite (`--drop-zero-pages`, off by default): with `auto` a worker that did not
drop its zero pages before the dump (a stock engine, a CPU worker) has them taken out of its CRIU images,
and is restored with its memory intact; `off` keeps them; with `auto` a worker that dropped some itself is
left as it is (its answer's cases, as pure logic: only a CUDA process of the tree is asked, so no CPU
worker here is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.zero_page_release import ZeroPagesReleased, agent_drops_zero_pages
from dynamo_snapshot.criu import sparse
from tests.agent.local_node import checkpoint_worker, local_executor
from tests.helpers.polling import await_json

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"
HASH = "0123456789abcdef"
ZERO_MIB = 24


def _answer(released: int, error: str | None = None) -> ZeroPagesReleased:
    return ZeroPagesReleased.model_validate(
        {"pid": 7, "scannedBytes": 1 << 30, "releasedBytes": released, "error": error}
    )


@pytest.mark.parametrize(
    ("setting", "released", "rewrites"),
    [
        ("auto", None, True),  # no offer: a stock engine, a CPU worker
        ("auto", _answer(0), True),  # answered, dropped nothing
        ("auto", _answer(1 << 30, error="madvise failed"), True),
        ("auto", _answer(1 << 30), False),  # the SDK's worker dropped the host copy's zeros
        ("on", _answer(1 << 30), True),
        ("off", None, False),
    ],
)
def test_auto_rewrites_unless_the_worker_dropped_its_zero_pages(
    setting: str, released: ZeroPagesReleased | None, rewrites: bool
) -> None:
    assert agent_drops_zero_pages(setting, released) is rewrites


@pytest.mark.parametrize(("given", "read"), [(True, "on"), (False, "off"), ("auto", "auto"), ("on", "on")])
def test_a_yes_or_no_from_an_older_config_still_reads(given: object, read: str) -> None:
    config = AgentConfig.model_validate({"nodeName": "n", "checkpoint": {"dropZeroPages": given}})
    assert config.checkpoint.drop_zero_pages == read


def test_an_unknown_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="dropZeroPages"):
        AgentConfig.model_validate({"nodeName": "n", "checkpoint": {"dropZeroPages": "sometimes"}})


@pytest.mark.criu
@pytest.mark.parametrize(
    ("setting", "dropped", "advise"),
    [("auto", True, False), ("on", True, True), (None, False, False), ("off", False, True)],
)
async def test_a_worker_that_kept_its_zero_pages_is_checkpointed_without_them_unless_off(
    criu_bin: Path, tmp_path: Path, setting: str | None, dropped: bool, advise: bool
) -> None:
    settings: dict[str, object] = {"zero_pages_huge_advice": advise}
    if setting is not None:
        settings["drop_zero_pages"] = setting
    executor, runtime = local_executor(tmp_path, criu_bin, **settings)
    source = await checkpoint_worker(
        executor, runtime, WORKER, HASH, {"WORKER_STATE_MIB": "8", "WORKER_ZERO_MIB": str(ZERO_MIB)}
    )
    artifact = executor.store.open(HASH)
    pages = artifact.manifest.extra["zeroPagesDropped"]
    assert isinstance(pages, int)
    if dropped:
        assert pages * 4096 >= ZERO_MIB << 20
    else:
        assert pages == 0
    pages_bytes = sum(f.size for f in artifact.manifest.files if f.path.startswith("criu/pages-"))
    assert (pages_bytes < ZERO_MIB << 20) is dropped, pages_bytes
    # --zero-pages-huge-advice: the worker's zeros, a mapping the rewrite emptied, marked for huge pages.
    marked = [
        v
        for mm in (artifact.path / "criu").glob("mm-*.img")
        for v in sparse._vmas(mm.parent, int(mm.name[3:-4]))
        if v.madv & (1 << 14) and v.end - v.start >= ZERO_MIB << 20
    ]
    assert bool(marked) is (dropped and advise), marked

    await executor.restore("restored", HASH)
    try:
        verdict = await await_json(source.control_dir / "verify.json")
        assert verdict["restored"] is True
        assert verdict["digest_after"] == verdict["digest_before"]
        assert verdict["zeros_intact"] is True
    finally:
        await runtime.stop("restored")
