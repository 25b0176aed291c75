"""The worker's handshake: env names, the ready file, waiting for the agent, identity after restore."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from dynamo_snapshot.api.protocol import (
    ENV_CONTROL_DIR,
    ENV_CONTROL_DIR_LEGACY,
    FEATURE_RESTORE_COMPLETE_LINES,
    FILE_READY_FOR_SNAPSHOT,
    FILE_RESTORE_COMPLETE,
    FILE_SNAPSHOT_COMPLETE,
    READY_FEATURES,
)
from dynamo_snapshot.workload import (
    DEFAULT_POLL_INTERVAL,
    NoControlDirError,
    SnapshotHandshake,
    control_dir,
    maybe_checkpoint_and_wait,
    maybe_checkpoint_and_wait_async,
    maybe_signal_ready,
    maybe_signal_ready_async,
)
from dynamo_snapshot.workload import handshake as hs


@pytest.fixture
def ctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "control"
    d.mkdir()
    monkeypatch.setenv(ENV_CONTROL_DIR, str(d))
    monkeypatch.delenv(ENV_CONTROL_DIR_LEGACY, raising=False)
    return d


@pytest.fixture
def etc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake /etc with what the kubelet mounts into a pod."""
    d = tmp_path / "etc"
    d.mkdir()
    (d / "hostname").write_text("worker-7f9c\n")
    (d / "hosts").write_text(
        "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n"
        "10.244.3.17\tworker-7f9c\n"
    )
    monkeypatch.setattr(hs, "_ETC", d)
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("POD_IP", raising=False)
    return d


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CONTROL_DIR, raising=False)
    monkeypatch.delenv(ENV_CONTROL_DIR_LEGACY, raising=False)


def write_later(path: Path, text: str, delay: float) -> threading.Timer:
    def write() -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    timer = threading.Timer(delay, write)
    timer.start()
    return timer


# ---- the control dir ----


def test_control_dir_env_names_and_precedence(caplog: pytest.LogCaptureFixture) -> None:
    assert control_dir({ENV_CONTROL_DIR: "/a"}) == Path("/a")
    assert control_dir({ENV_CONTROL_DIR_LEGACY: "/b"}) == Path("/b")
    assert control_dir({ENV_CONTROL_DIR: "/a", ENV_CONTROL_DIR_LEGACY: "/a/"}) == Path("/a")
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger=hs.__name__):
        assert control_dir({ENV_CONTROL_DIR: "/a", ENV_CONTROL_DIR_LEGACY: "/b"}) == Path("/a")
    assert len(caplog.records) == 1
    assert ENV_CONTROL_DIR in caplog.records[0].getMessage()
    assert control_dir({}) is None
    assert control_dir({ENV_CONTROL_DIR: "", ENV_CONTROL_DIR_LEGACY: "/b"}) == Path("/b")


def test_process_env_is_read(ctl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert control_dir() == ctl
    assert SnapshotHandshake().control_dir == ctl
    monkeypatch.delenv(ENV_CONTROL_DIR)
    monkeypatch.setenv(ENV_CONTROL_DIR_LEGACY, str(ctl / "legacy"))
    assert SnapshotHandshake.from_env().control_dir == ctl / "legacy"


@pytest.mark.usefixtures("no_env")
def test_no_control_dir_is_a_clear_error_except_for_maybe() -> None:
    with pytest.raises(NoControlDirError, match="no snapshot control dir: set SNAPSHOT_CONTROL_DIR"):
        SnapshotHandshake()
    with pytest.raises(NoControlDirError):
        SnapshotHandshake.from_env()
    assert SnapshotHandshake.maybe_from_env() is None
    t = time.monotonic()
    assert maybe_checkpoint_and_wait(timeout=5) is None
    assert maybe_signal_ready({"x": 1}) is False
    assert time.monotonic() - t < 1


# ---- ready-for-snapshot ----


def test_signal_ready_writes_json_with_pid_and_info(ctl: Path) -> None:
    SnapshotHandshake().signal_ready({"model": "qwen3", "tp": 2})
    ready = ctl / FILE_READY_FOR_SNAPSHOT
    content = json.loads(ready.read_text())
    assert content["pid"] == os.getpid()
    assert content["info"] == {"model": "qwen3", "tp": 2}
    assert stat.S_IMODE(ready.stat().st_mode) == 0o644
    assert sorted(p.name for p in ctl.iterdir()) == [FILE_READY_FOR_SNAPSHOT]  # no temp file left


def test_signal_ready_without_info(ctl: Path) -> None:
    assert maybe_signal_ready() is True
    assert "info" not in json.loads((ctl / FILE_READY_FOR_SNAPSHOT).read_text())


def test_unserialisable_info_writes_nothing(ctl: Path) -> None:
    with pytest.raises(TypeError):
        SnapshotHandshake().signal_ready({"bad": object()})
    assert list(ctl.iterdir()) == []


def test_missing_control_dir_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SnapshotHandshake(tmp_path / "absent").signal_ready()


def test_signal_ready_clears_sentinels_of_an_earlier_run(ctl: Path) -> None:
    (ctl / FILE_RESTORE_COMPLETE).write_text("{}")
    (ctl / FILE_SNAPSHOT_COMPLETE).write_text("")
    h = SnapshotHandshake()
    assert h.was_restored()
    h.signal_ready()
    assert not h.was_restored()
    assert not (ctl / FILE_SNAPSHOT_COMPLETE).exists()


def test_ready_file_is_never_seen_partial(ctl: Path) -> None:
    h = SnapshotHandshake()
    ready = ctl / FILE_READY_FOR_SNAPSHOT
    big = {"blob": "x" * (256 << 10)}
    stop = threading.Event()
    seen: list[int] = []
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                text = ready.read_text()
            except FileNotFoundError:
                continue
            try:
                assert json.loads(text)["info"] == big
                seen.append(1)
            except (ValueError, KeyError, AssertionError):
                bad.append(text[:80])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(60):
            h.signal_ready(big)
    finally:
        stop.set()
        t.join()
    assert bad == []
    assert seen  # the reader did look


# ---- waiting ----


@pytest.mark.usefixtures("etc")
def test_wait_returns_soon_after_restore_complete_polling_every_interval(
    ctl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeps: list[float] = []
    real_sleep = time.sleep

    def recording_sleep(s: float) -> None:
        sleeps.append(s)
        real_sleep(s)

    monkeypatch.setattr(time, "sleep", recording_sleep)
    h = SnapshotHandshake()
    h.signal_ready()
    t0 = time.monotonic()
    timer = write_later(
        ctl / FILE_RESTORE_COMPLETE, json.dumps({"podName": "new-pod", "podIP": "10.0.0.9"}), 0.3
    )
    info = h.wait_for_restore()
    elapsed = time.monotonic() - t0
    timer.join()
    assert info.restored
    # Upper bounds leave room for a loaded machine; the poll count is the real check.
    assert 0.3 <= elapsed < 0.9
    assert 0.25 <= info.waited_s < 0.9
    assert sleeps
    assert all(s == pytest.approx(DEFAULT_POLL_INTERVAL) for s in sleeps)
    # One sleep per interval until the file shows up 0.3 s in, give or take the machine's load.
    assert 0.3 / DEFAULT_POLL_INTERVAL - 2 <= len(sleeps) <= 0.9 / DEFAULT_POLL_INTERVAL
    assert (info.pod_name, info.pod_ip) == ("new-pod", "10.0.0.9")
    assert info.content == {"podName": "new-pod", "podIP": "10.0.0.9"}
    assert h.was_restored()


def test_timeout_is_a_clear_timeout_error(ctl: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"no {FILE_RESTORE_COMPLETE}.*{ctl.name}.*after 0.25 s"):
        SnapshotHandshake().wait_for_restore(poll_interval=0.05, timeout=0.25)
    assert 0.25 <= time.monotonic() - t0 < 0.9


@pytest.mark.parametrize(("poll", "timeout"), [(0, None), (-1, 1), (0.1, -1)])
def test_bad_wait_arguments(ctl: Path, poll: float, timeout: float | None) -> None:
    with pytest.raises(ValueError, match="must be"):
        SnapshotHandshake().wait_for_restore(poll, timeout)


def test_time_frozen_by_a_checkpoint_does_not_count() -> None:
    # A restore on another machine makes CLOCK_MONOTONIC jump either way between two polls.
    assert hs._counted(0.1) == pytest.approx(0.1)
    assert hs._counted(86_400.0) == hs._MAX_COUNTED_GAP
    assert hs._counted(-5_000.0) == 0.0


def test_identity_after_restore_prefers_what_the_agent_says(ctl: Path, etc: Path) -> None:
    (ctl / FILE_RESTORE_COMPLETE).write_text(
        json.dumps({"env": {"POD_NAME": "restored-1", "POD_IP": "10.1.1.1", "N": 3}, "hostname": "h1"})
    )
    info = SnapshotHandshake().wait_for_restore()
    assert (info.restored, info.hostname, info.pod_name, info.pod_ip) == (
        True,
        "h1",
        "restored-1",
        "10.1.1.1",
    )
    assert info.env == {"POD_NAME": "restored-1", "POD_IP": "10.1.1.1"}


def test_a_restore_gives_the_restore_containers_carried_settings(ctl: Path, etc: Path) -> None:
    # Two containers restored from one snapshot differ in these: each engine's id, its failover lock.
    (ctl / "restore-context.json").write_text(
        json.dumps({"env": {"ENGINE_ID": "1", "FAILOVER_LOCK_PATH": "/shared/l", "DYN_SYSTEM_PORT": None}})
    )
    (ctl / FILE_RESTORE_COMPLETE).write_text("done")
    info = SnapshotHandshake().wait_for_restore()
    assert info.context_env == {"ENGINE_ID": "1", "FAILOVER_LOCK_PATH": "/shared/l"}


@pytest.mark.parametrize("written", ["", "not json", "[1]", '{"env": 3}'])
def test_an_unreadable_restore_context_gives_no_settings(ctl: Path, etc: Path, written: str) -> None:
    (ctl / "restore-context.json").write_text(written)
    (ctl / FILE_RESTORE_COMPLETE).write_text("done")
    assert SnapshotHandshake().wait_for_restore().context_env == {}


def test_identity_after_restore_ignores_the_checkpointed_env(
    ctl: Path, etc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CRIU brings back the environment of the checkpoint pod: it must not be taken for the new pod's.
    monkeypatch.setenv("POD_NAME", "checkpoint-job-pod")
    monkeypatch.setenv("POD_IP", "10.9.9.9")
    (ctl / FILE_RESTORE_COMPLETE).write_text("done")
    info = SnapshotHandshake().wait_for_restore()
    assert info.content == "done"
    assert (info.hostname, info.pod_name, info.pod_ip) == ("worker-7f9c", "worker-7f9c", "10.244.3.17")


def test_snapshot_complete_means_dumped_and_still_the_same_pod(
    ctl: Path, etc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAME", "checkpoint-job-pod")
    monkeypatch.setenv("POD_IP", "10.9.9.9")
    (ctl / FILE_SNAPSHOT_COMPLETE).write_text("")
    info = SnapshotHandshake().wait_for_restore()
    assert not info.restored
    assert info.content is None
    assert (info.pod_name, info.pod_ip) == ("checkpoint-job-pod", "10.9.9.9")


@pytest.mark.usefixtures("etc")
def test_sentinel_filled_in_after_creation_is_read_complete(ctl: Path) -> None:
    path = ctl / FILE_RESTORE_COMPLETE
    path.write_text("")  # the agent created it and writes the content a moment later
    timer = threading.Timer(0.03, lambda: path.write_text('{"podName": "late"}'))
    timer.start()
    info = SnapshotHandshake().wait_for_restore()
    timer.join()
    assert info.pod_name == "late"


@pytest.mark.usefixtures("etc")
def test_checkpoint_and_wait(ctl: Path) -> None:
    timer = write_later(ctl / FILE_RESTORE_COMPLETE, "1", 0.15)
    info = SnapshotHandshake().checkpoint_and_wait({"k": "v"}, poll_interval=0.05, timeout=5)
    timer.join()
    assert info.restored
    assert info.content == 1
    assert json.loads((ctl / FILE_READY_FOR_SNAPSHOT).read_text())["info"] == {"k": "v"}


@pytest.mark.usefixtures("etc")
def test_maybe_checkpoint_and_wait_in_a_snapshot_pod(ctl: Path) -> None:
    timer = write_later(ctl / FILE_RESTORE_COMPLETE, "{}", 0.1)
    info = maybe_checkpoint_and_wait(poll_interval=0.02, timeout=5)
    timer.join()
    assert info is not None
    assert info.restored


# ---- async ----


@pytest.mark.usefixtures("etc")
async def test_async_variants_do_not_block_the_loop(ctl: Path) -> None:
    stop = asyncio.Event()
    ticker: list[float] = []

    async def tick() -> None:
        while not stop.is_set():
            ticker.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def agent() -> None:
        await asyncio.sleep(0.3)
        (ctl / FILE_RESTORE_COMPLETE).write_text(json.dumps({"podIP": "10.2.2.2"}))

    h = SnapshotHandshake()
    ticks = asyncio.create_task(tick())
    writer = asyncio.create_task(agent())
    await h.signal_ready_async({"async": True})
    info = await h.wait_for_restore_async()
    stop.set()
    await asyncio.gather(ticks, writer)
    assert info.restored
    assert info.pod_ip == "10.2.2.2"
    assert len(ticker) >= 15  # the loop kept running while we waited
    assert max(b - a for a, b in itertools.pairwise(ticker)) < 0.2
    assert json.loads((ctl / FILE_READY_FOR_SNAPSHOT).read_text())["info"] == {"async": True}


async def test_async_timeout(ctl: Path) -> None:
    with pytest.raises(TimeoutError, match=FILE_RESTORE_COMPLETE):
        await SnapshotHandshake().wait_for_restore_async(poll_interval=0.02, timeout=0.1)


@pytest.mark.usefixtures("etc")
async def test_async_checkpoint_and_wait_and_maybe(ctl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def agent() -> None:
        await asyncio.sleep(0.1)
        (ctl / FILE_SNAPSHOT_COMPLETE).write_text("")

    task = asyncio.create_task(agent())
    info = await maybe_checkpoint_and_wait_async(poll_interval=0.02, timeout=5)
    await task
    assert info is not None
    assert not info.restored
    monkeypatch.delenv(ENV_CONTROL_DIR)
    assert await maybe_checkpoint_and_wait_async() is None
    assert await maybe_signal_ready_async() is False


def test_the_zero_page_offer_ends_with_a_wait_that_gave_up(ctl: Path) -> None:
    h = SnapshotHandshake()
    h.signal_ready()
    ready = json.loads((ctl / FILE_READY_FOR_SNAPSHOT).read_text())
    assert ready["features"] == [FEATURE_RESTORE_COMPLETE_LINES, "release-zero-pages"]
    server = h._zero_pages
    assert server is not None
    assert server.thread.is_alive()
    with pytest.raises(TimeoutError):
        h.wait_for_restore(poll_interval=0.02, timeout=0.1)
    server.thread.join(2)
    assert not server.thread.is_alive()


def test_a_worker_may_decline_the_zero_page_offer(ctl: Path) -> None:
    h = SnapshotHandshake(release_zero_pages=False)
    h.signal_ready()
    assert json.loads((ctl / FILE_READY_FOR_SNAPSHOT).read_text())["features"] == [
        FEATURE_RESTORE_COMPLETE_LINES
    ]
    assert h._zero_pages is None


def test_the_ready_file_says_this_sdk_reads_the_contracts_restore_complete(ctl: Path) -> None:
    SnapshotHandshake().signal_ready()
    ready = json.loads((ctl / FILE_READY_FOR_SNAPSHOT).read_text())
    assert FEATURE_RESTORE_COMPLETE_LINES in ready[READY_FEATURES]


def test_restore_complete_as_the_contract_writes_it_carries_the_agents_document(ctl: Path, etc: Path) -> None:
    """The restore-pod contract's lines: the pid as the container numbers it, and this agent's JSON
    document (who the worker is now) under its key, read as that document."""
    doc = {"env": {"POD_NAME": "restored-2", "POD_IP": "10.1.1.2"}, "hostname": "h2", "note": "a=b"}
    (ctl / FILE_RESTORE_COMPLETE).write_text(f"pid=7\nrestore={json.dumps(doc)}\n")
    info = SnapshotHandshake().wait_for_restore(timeout=5)
    assert (info.restored, info.hostname, info.pod_name, info.pod_ip) == (
        True,
        "h2",
        "restored-2",
        "10.1.1.2",
    )
    assert info.content == {**doc, "pid": 7}


def test_restore_complete_with_the_pid_alone_is_a_restore_with_the_pods_own_identity(
    ctl: Path, etc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another agent of the contract writes only the pid: the worker is restored all the same and reads
    who it is from the pod (its environment, /etc/hostname and /etc/hosts)."""
    (etc / "hostname").write_text("pod-b\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n10.2.2.2 pod-b\n")
    (ctl / FILE_RESTORE_COMPLETE).write_text("pid=12\n")
    info = SnapshotHandshake().wait_for_restore(timeout=5)
    assert (info.restored, info.hostname, info.pod_ip, info.content) == (
        True,
        "pod-b",
        "10.2.2.2",
        {"pid": 12},
    )


@pytest.mark.parametrize(
    ("text", "complete"),
    [
        ("pid=7\nrestore={}\n", True),
        ("pid=7\nrestore={}", False),  # the last line may still be growing
        ('pid=7\nrestore={"podName": "x', False),  # cut inside the document
        ("pid=x\n", False),
        ("pid=7\nnot a key value line\n", False),
        ("restore=[1, 2]\n", False),
        ("other=1\n", False),  # none of the keys this SDK reads
    ],
)
def test_contract_lines_are_complete_only_whole(text: str, complete: bool) -> None:
    content, whole = hs._parse(text)
    assert whole is complete, (text, content)
    if complete:
        assert content == {"pid": 7}
