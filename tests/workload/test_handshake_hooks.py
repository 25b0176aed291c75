"""Hooks around the checkpoint (SnapshotHandshake.add_hook) and the GPU offload hook built on them:
KV caches and weights released before ready-for-snapshot, taken back once the wait ends. GPU memory
is the pure-Python stand-in of fake_cuda."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.api.protocol import (
    FILE_READY_FOR_SNAPSHOT,
    FILE_RESTORE_COMPLETE,
    FILE_SNAPSHOT_COMPLETE,
    FILE_WEIGHTS_VERIFIED,
)
from dynamo_snapshot.cuda import CudaError
from dynamo_snapshot.workload import (
    FILE_WEIGHTS_MANIFEST,
    GpuOffload,
    KvCache,
    RestoreInfo,
    SnapshotHandshake,
    WeightRegion,
    read_offload_manifest,
    read_weights_manifest,
)
from dynamo_snapshot.workload import handshake as hs
from dynamo_snapshot.workload.gpu_memory import RegionPool
from dynamo_snapshot.workload.weights import ENCODINGS, read_header
from tests.helpers.polling import wait_file
from tests.workload.fake_cuda import CUresult, FakeDriver, FakeEngine


class Recorder:
    def __init__(self, name: str, events: list[str], ctl: Path, fail: bool = False) -> None:
        self.name, self.events, self.ctl, self.fail = name, events, ctl, fail
        self.infos: list[RestoreInfo | None] = []

    def before_checkpoint(self, handshake: SnapshotHandshake) -> None:
        assert not (self.ctl / FILE_READY_FOR_SNAPSHOT).exists()  # the agent must not see ready yet
        self.events.append(f"{self.name}.before")
        if self.fail:
            raise RuntimeError(f"{self.name} failed")

    def on_resume(self, handshake: SnapshotHandshake, info: RestoreInfo | None) -> None:
        self.events.append(f"{self.name}.resume")
        self.infos.append(info)


def later(path: Path, text: str, delay: float = 0.2) -> threading.Thread:
    t = threading.Timer(delay, path.write_text, args=(text,))
    t.start()
    return t


def once_ready(ctl: Path, name: str, text: str) -> threading.Thread:
    """The agent's answer `name`, written once the worker said ready-for-snapshot (its hooks ran)."""

    def answer() -> None:
        wait_file(ctl / FILE_READY_FOR_SNAPSHOT)
        (ctl / name).write_text(text)

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    return t


def test_hooks_run_before_ready_and_after_the_wait_in_order(tmp_path: Path) -> None:
    events: list[str] = []
    h = SnapshotHandshake(tmp_path)
    a, b = Recorder("a", events, tmp_path), Recorder("b", events, tmp_path)
    h.add_hook(a)
    h.add_hook(b)
    h.signal_ready({"k": 1})
    assert events == ["a.before", "b.before"]
    assert json.loads((tmp_path / FILE_READY_FOR_SNAPSHOT).read_text())["info"] == {"k": 1}
    later(tmp_path / FILE_RESTORE_COMPLETE, '{"podName": "p2"}')
    info = h.wait_for_restore(poll_interval=0.02, timeout=5)
    assert events == ["a.before", "b.before", "a.resume", "b.resume"]
    assert a.infos == [info]
    assert info.restored


def test_hooks_also_run_when_dumped_and_left_running(tmp_path: Path) -> None:
    events: list[str] = []
    h = SnapshotHandshake(tmp_path)
    h.add_hook(Recorder("a", events, tmp_path))
    later(tmp_path / FILE_SNAPSHOT_COMPLETE, "")
    info = h.checkpoint_and_wait(poll_interval=0.02, timeout=5)
    assert not info.restored
    assert events == ["a.before", "a.resume"]


def test_a_failing_hook_means_no_ready_file_and_undoes_the_others(tmp_path: Path) -> None:
    events: list[str] = []
    h = SnapshotHandshake(tmp_path)
    ok, bad = Recorder("ok", events, tmp_path), Recorder("bad", events, tmp_path, fail=True)
    h.add_hook(ok)
    h.add_hook(bad)
    with pytest.raises(RuntimeError, match="bad failed"):
        h.signal_ready()
    assert not (tmp_path / FILE_READY_FOR_SNAPSHOT).exists()
    assert events == ["ok.before", "bad.before", "bad.resume", "ok.resume"]
    assert ok.infos == [None]
    # Nothing is armed any more: a later wait does not run the hooks a second time.
    (tmp_path / FILE_RESTORE_COMPLETE).write_text("")
    h.wait_for_restore(timeout=1)
    assert events == ["ok.before", "bad.before", "bad.resume", "ok.resume"]


def test_hooks_do_not_run_for_a_wait_without_signal_ready(tmp_path: Path) -> None:
    events: list[str] = []
    h = SnapshotHandshake(tmp_path)
    h.add_hook(Recorder("a", events, tmp_path))
    (tmp_path / FILE_RESTORE_COMPLETE).write_text("")
    h.wait_for_restore(timeout=1)
    assert events == []


def test_unserialisable_info_fails_before_any_hook_runs(tmp_path: Path) -> None:
    events: list[str] = []
    h = SnapshotHandshake(tmp_path)
    h.add_hook(Recorder("a", events, tmp_path))
    with pytest.raises(TypeError):
        h.signal_ready({"bad": object()})
    assert events == []


async def test_async_wait_runs_the_hooks_off_the_loop(tmp_path: Path) -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    class Slow:
        def before_checkpoint(self, handshake: SnapshotHandshake) -> None:
            pass

        def on_resume(self, handshake: SnapshotHandshake, info: RestoreInfo | None) -> None:
            seen.append(threading.get_ident())
            time.sleep(0.3)

    h = SnapshotHandshake(tmp_path)
    h.add_hook(Slow())
    await h.signal_ready_async()
    (tmp_path / FILE_RESTORE_COMPLETE).write_text("")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    task = asyncio.create_task(ticker())
    await h.wait_for_restore_async(poll_interval=0.02, timeout=5)
    task.cancel()
    assert seen
    assert seen[0] != loop_thread
    assert ticks >= 5  # the loop kept running while the hook slept


# ---- the GPU offload hook -------------------------------------------------------------------------


@pytest.fixture
def cu() -> FakeDriver:
    driver = FakeDriver(granularity=64 << 10, total=64 << 20)
    driver.set_current_for_test(FakeDriver.context_of(0))
    return driver


def test_gpu_offload_releases_before_ready_and_restores_after(cu: FakeDriver, tmp_path: Path) -> None:
    ctl = tmp_path / "control"
    ctl.mkdir()
    pool = RegionPool()
    kv = KvCache(4 << 20, driver=cu, pool=pool)
    weights = WeightRegion(driver=cu, engine=FakeEngine, pool=pool)
    weights.allocate([("w", "uint8", (3 << 20,), 3 << 20)])
    assert weights.region is not None
    payload = bytes(range(256)) * ((3 << 20) // 256)
    cu.memory(weights.region.ptr)[: len(payload)] = payload
    used_before = cu.used

    h = SnapshotHandshake(ctl)
    h.register_kv_cache(kv)
    h.register_weights(weights, tmp_path / "cache" / "model.dsw")

    seen_at_ready: dict[str, Any] = {}

    def agent() -> None:
        wait_file(ctl / FILE_READY_FOR_SNAPSHOT)
        seen_at_ready["used"] = cu.used
        seen_at_ready["manifest"] = read_weights_manifest(ctl)
        seen_at_ready["offload"] = read_offload_manifest(ctl)
        (ctl / FILE_RESTORE_COMPLETE).write_text('{"podName": "restored"}')

    t = threading.Thread(target=agent)
    t.start()
    info = h.checkpoint_and_wait(poll_interval=0.02, timeout=10)
    t.join()

    assert info.restored
    assert seen_at_ready["used"] == 0  # nothing left on the "GPU" when the agent checkpoints
    (entry,) = seen_at_ready["manifest"]
    weights_file = tmp_path / "cache" / "model.dsw"
    assert entry.path == str(weights_file)
    assert entry.bytes == weights_file.stat().st_size
    assert entry.data_digest == read_header(weights_file)[0].data_digest
    assert (ctl / FILE_WEIGHTS_MANIFEST).exists()
    # The agent learns how much GPU memory comes back after a restore, per device.
    assert seen_at_ready["offload"].released_bytes == {0: used_before}

    assert cu.used == used_before
    assert not kv.released
    assert not weights.released
    assert bytes(cu.memory(weights.region.ptr)[: len(payload)]) == payload
    report = h.gpu_offload.report
    assert report.released_bytes == kv.size + weights.region.size
    assert report.reacquired_bytes == kv.size
    (loaded,) = report.loaded
    assert loaded.bytes == 3 << 20
    json.dumps(report.to_dict())

    # A second cycle: the file holds these weights already and is not written again.
    mtime = weights_file.stat().st_mtime_ns
    (ctl / FILE_RESTORE_COMPLETE).unlink()
    (ctl / FILE_READY_FOR_SNAPSHOT).unlink()  # the first cycle's
    once_ready(ctl, FILE_SNAPSHOT_COMPLETE, "")
    h.checkpoint_and_wait(poll_interval=0.02, timeout=10)
    assert not h.gpu_offload.report.saved[0].written
    assert weights_file.stat().st_mtime_ns == mtime
    assert bytes(cu.memory(weights.region.ptr)[: len(payload)]) == payload


def test_gpu_offload_waits_for_the_agents_verdict_before_the_worker_serves(
    cu: FakeDriver, tmp_path: Path
) -> None:
    ctl = tmp_path / "control"
    ctl.mkdir()
    weights = WeightRegion(driver=cu, engine=FakeEngine, pool=RegionPool())
    weights.allocate([("w", "uint8", (1 << 20,), 1 << 20)])
    h = SnapshotHandshake(ctl)
    h.register_weights(weights, tmp_path / "model.dsw")
    h.signal_ready()
    assert read_offload_manifest(ctl).waits_for_weights_check  # type: ignore[union-attr]
    # The agent resumed the worker while it still checks the weights, and says so.
    (ctl / FILE_RESTORE_COMPLETE).write_text('{"podName": "restored", "weightsCheck": "pending"}')
    later(ctl / FILE_WEIGHTS_VERIFIED, "{}", delay=0.3)
    started = time.monotonic()
    info = h.wait_for_restore(poll_interval=0.02, timeout=10)
    assert info.restored
    assert time.monotonic() - started >= 0.3  # the wait ended only with the verdict
    report = h.gpu_offload.report
    assert report.weights_check_wait_seconds > 0
    (loaded,) = report.loaded
    assert not loaded.direct  # read through the page cache the agent's check fills


def test_gpu_offload_failure_before_ready_takes_everything_back(cu: FakeDriver, tmp_path: Path) -> None:
    pool = RegionPool()
    kv = KvCache(1 << 20, driver=cu, pool=pool)
    weights = WeightRegion(driver=cu, engine=FakeEngine, pool=pool)
    weights.allocate([("w", "uint8", (1 << 20,), 1 << 20)])
    h = SnapshotHandshake(tmp_path)
    h.register_weights(weights, tmp_path / "w.dsw")
    h.register_kv_cache(kv)
    cu.fail["cuMemUnmap"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match="cuMemUnmap"):
        h.signal_ready()
    assert not (tmp_path / FILE_READY_FOR_SNAPSHOT).exists()
    assert not kv.released
    assert not weights.released


def test_hooks_are_undone_when_the_ready_file_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    h = SnapshotHandshake(tmp_path)
    hook = Recorder("a", events, tmp_path)
    h.add_hook(hook)

    def no_space(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hs.os, "replace", no_space)
    with pytest.raises(OSError, match="No space"):
        h.signal_ready()
    assert events == ["a.before", "a.resume"]
    assert hook.infos == [None]
    assert not (tmp_path / FILE_READY_FOR_SNAPSHOT).exists()


def test_gpu_offload_refuses_an_unknown_weights_encoding_when_made() -> None:
    with pytest.raises(
        ValueError, match=r"weights_encoding must be one of \('raw', 'split-nibble'\), got 'deflate'"
    ):
        GpuOffload(weights_encoding="deflate")
    for encoding in ENCODINGS:
        assert GpuOffload(weights_encoding=encoding).weights_encoding == encoding
