"""The agent asks a real worker process (the SDK's handshake) to drop the zero pages of memory it mapped
after the agent looked: as the CUDA checkpoint's host copy is mapped during the checkpoint call."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_snapshot.agent.runtime.base import namespace_pid
from dynamo_snapshot.agent.zero_page_release import ZeroPageRelease, _subtract, offering_pid
from dynamo_snapshot.api import protocol

# A worker that signals ready, maps 64 MiB of private memory when told (every third page marked, the
# rest zero), then checks after the exchange that its marks are all still there.
WORKER = textwrap.dedent(
    """
    import mmap, os, sys, time
    from pathlib import Path
    from dynamo_snapshot.workload import SnapshotHandshake
    ctl = Path(sys.argv[1])
    h = SnapshotHandshake(ctl, release_zero_pages=sys.argv[2] == "offer")
    h.signal_ready()
    while not (ctl / "map-now").exists():
        time.sleep(0.005)
    pages = 16384
    m = mmap.mmap(-1, pages * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(bytes(pages * mmap.PAGESIZE))
    for i in range(0, pages, 3):
        m[i * mmap.PAGESIZE + 5] = 7
    (ctl / "mapped").write_text("")
    while not (ctl / "check-now").exists():
        time.sleep(0.005)
    ok = all(m[i * mmap.PAGESIZE + 5] == (7 if i % 3 == 0 else 0) for i in range(pages))
    (ctl / "verdict").write_text("ok" if ok else "marks lost")
    """
)
PAGES = 16384
ZERO_BYTES = (PAGES - len(range(0, PAGES, 3))) * os.sysconf("SC_PAGE_SIZE")


def _wait_for(path: Path, proc: subprocess.Popen[bytes], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert proc.poll() is None, f"worker exited {proc.returncode}"
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.01)


@pytest.fixture
def worker(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    offer = getattr(request, "param", "offer")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), offer])
    try:
        _wait_for(tmp_path / protocol.FILE_READY_FOR_SNAPSHOT, proc)
        yield proc, tmp_path
    finally:
        proc.kill()
        proc.wait()


def _map_and_ask(proc: subprocess.Popen[bytes], ctl: Path, wait_s: float = 10.0) -> object:
    release = ZeroPageRelease.prepare(ctl, [proc.pid])
    assert release is not None
    (ctl / "map-now").write_text("")
    _wait_for(ctl / "mapped", proc)
    answer = asyncio.run(release.ask(wait_s))
    (ctl / "check-now").write_text("")
    _wait_for(ctl / "verdict", proc)
    assert (ctl / "verdict").read_text() == "ok"
    return answer


def test_the_worker_drops_the_zero_pages_of_what_it_mapped_during_the_checkpoint_and_nothing_else(
    worker: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, ctl = worker
    assert offering_pid(ctl) == namespace_pid(proc.pid) == proc.pid
    answer = _map_and_ask(proc, ctl)
    assert answer is not None
    assert answer.error is None  # type: ignore[attr-defined]
    # The new mapping's zero pages (and at most those of a small allocation the interpreter mapped
    # meanwhile): the worker's older memory (its heap, Python's arenas) was not named.
    assert ZERO_BYTES <= answer.released_bytes <= ZERO_BYTES + (4 << 20)  # type: ignore[attr-defined]
    assert answer.scanned_bytes >= PAGES * os.sysconf("SC_PAGE_SIZE")  # type: ignore[attr-defined]
    # What the manifest keeps: the worker's scan, with its madvise calls (at least one run given back).
    account = answer.account()  # type: ignore[attr-defined]
    assert account["scannedBytes"] == answer.scanned_bytes  # type: ignore[attr-defined]
    assert account["runs"] >= 1
    assert 0 <= account["madviseSeconds"] <= account["seconds"]
    # Neither file of the exchange is left in the control directory.
    assert not (ctl / protocol.FILE_ZERO_PAGES_REQUEST).exists()
    assert not (ctl / protocol.FILE_ZERO_PAGES_RELEASED).exists()


@pytest.mark.parametrize("worker", ["no-offer"], indirect=True)
def test_a_worker_that_does_not_offer_is_not_asked(worker: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, ctl = worker
    ready = json.loads((ctl / protocol.FILE_READY_FOR_SNAPSHOT).read_text())
    assert protocol.FEATURE_RELEASE_ZERO_PAGES not in ready[protocol.READY_FEATURES]
    assert ZeroPageRelease.prepare(ctl, [proc.pid]) is None


def test_an_offer_from_a_process_that_is_not_a_cuda_process_of_the_tree_is_not_taken(
    worker: tuple[subprocess.Popen[bytes], Path],
) -> None:
    _, ctl = worker
    # The ready file names the worker; the agent's CUDA processes are others (or none).
    assert ZeroPageRelease.prepare(ctl, [os.getpid()]) is None
    assert ZeroPageRelease.prepare(ctl, []) is None


def test_no_answer_leaves_the_dump_as_it_is_after_the_wait(tmp_path: Path) -> None:
    # An offer from a process that never answers (this test process names itself and serves nothing).
    ready = {"pid": os.getpid(), protocol.READY_FEATURES: [protocol.FEATURE_RELEASE_ZERO_PAGES]}
    (tmp_path / protocol.FILE_READY_FOR_SNAPSHOT).write_text(json.dumps(ready))
    release = ZeroPageRelease.prepare(tmp_path, [os.getpid()])
    assert release is not None
    release.before = release.before[:-1]  # as if the driver had mapped the last one
    started = time.monotonic()
    assert asyncio.run(release.ask(0.3)) is None
    assert 0.3 <= time.monotonic() - started < 5
    assert not (tmp_path / protocol.FILE_ZERO_PAGES_REQUEST).exists()


def test_a_hostile_answer_is_not_followed_or_trusted(tmp_path: Path) -> None:
    ready = {"pid": os.getpid(), protocol.READY_FEATURES: [protocol.FEATURE_RELEASE_ZERO_PAGES]}
    (tmp_path / protocol.FILE_READY_FOR_SNAPSHOT).write_text(json.dumps(ready))
    secret = tmp_path / "node-secret.json"
    secret.write_text(json.dumps({"pid": 1, "releasedBytes": 1}))
    release = ZeroPageRelease.prepare(tmp_path, [os.getpid()])
    assert release is not None
    release.before = release.before[:-1]

    async def plant_link() -> object:
        def link_soon() -> None:
            while not (tmp_path / protocol.FILE_ZERO_PAGES_REQUEST).exists():
                time.sleep(0.001)
            (tmp_path / protocol.FILE_ZERO_PAGES_RELEASED).symlink_to(secret)

        linker = asyncio.create_task(asyncio.to_thread(link_soon))
        answer = await release.ask(0.5)
        await linker
        return answer

    # A link where the answer goes is not read through (a regular file only), so no answer.
    assert asyncio.run(plant_link()) is None
    assert secret.exists()


def test_only_the_new_part_of_a_mapping_merged_with_an_old_one_is_named() -> None:
    before = [(0x1000, 0x3000), (0x8000, 0x9000)]
    # The driver's mapping merged below an old one, a mapping grown on both sides, and a new one.
    after = [(0x1000, 0x5000), (0x7000, 0xA000), (0xC000, 0xD000)]
    assert _subtract(after, before) == [
        (0x3000, 0x5000),
        (0x7000, 0x8000),
        (0x9000, 0xA000),
        (0xC000, 0xD000),
    ]
    assert _subtract(before, before) == []
