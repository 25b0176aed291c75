"""A lazy restore whose pages come from criu.page_server, with real CRIU: the restored process gets its
memory back byte for byte, only once the server's `ready` lets each range through (held back, the
restore waits on its faults; let go, it runs on), and the server refuses asks its images do not hold."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu
from dynamo_snapshot.criu.page_server import PageIndex, PageServerError, serve_pages
from dynamo_snapshot.criu.sparse import PAGE, read_pagemap
from tests.helpers.polling import wait_file
from tests.helpers.script_process import kill_groups, start_script

pytestmark = pytest.mark.criu

# 4096 anonymous pages of random bytes and a forked child with 256 of its own; each writes the SHA-256
# of its memory before the dump and, told to go on after the restore, again (every page touched).
WORKER = r"""
import hashlib, mmap, os, sys, time
d, P = sys.argv[1], mmap.PAGESIZE
pages = 4096
if os.fork() == 0:
    role, pages = "child", 256
else:
    role = "parent"
mem = mmap.mmap(-1, pages * P, flags=mmap.MAP_PRIVATE)
for i in range(0, pages, 256):
    mem[i * P:(i + 256) * P] = os.urandom(256 * P)
def report(name):
    with open(os.path.join(d, f"{name}-{role}.tmp"), "w") as f:
        f.write(hashlib.sha256(mem).hexdigest())
    os.rename(os.path.join(d, f"{name}-{role}.tmp"), os.path.join(d, f"{name}-{role}"))
report("before")
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.01)
report("after")
while True:
    time.sleep(1)
"""


async def _dumped(criu: Criu, tmp: Path) -> tuple[Path, Path, dict[str, str]]:
    work, images = tmp / "work", tmp / "images"
    proc = await start_script(WORKER, work)
    before = {r: await asyncio.to_thread(wait_file, work / f"before-{r}", 60) for r in ("parent", "child")}
    await criu.dump(proc.pid, images)
    await proc.wait()
    # The child was ours only through the worker: whoever inherited it reaps it, soon.
    for pagemap in images.glob("pagemap-*.img"):
        pid = pagemap.name.removeprefix("pagemap-").removesuffix(".img")
        for _ in range(1500):
            if not await asyncio.to_thread(os.path.exists, f"/proc/{pid}"):
                break
            await asyncio.sleep(0.02)
    return work, images, before


async def test_a_lazy_restore_gets_its_pages_from_the_server_only_once_they_are_ready(
    criu_bin: Path, tmp_path: Path
) -> None:
    criu = Criu(criu_bin)
    work, images, before = await _dumped(criu, tmp_path)
    gate = asyncio.Event()
    asked: list[tuple[str, int, int]] = []

    async def ready(name: str, offset: int, length: int) -> None:
        asked.append((name, offset, length))
        await gate.wait()

    ours, theirs = socket.socketpair()
    restored_pid = None
    try:
        daemon = await criu.lazy_pages_daemon(images, tmp_path / "lazy", theirs.fileno())
        theirs.close()
        server = asyncio.create_task(
            serve_pages(ours, images, PageIndex(images), ready, await criu.version())
        )
        (work / "go").touch()
        restore = asyncio.create_task(
            criu.restore(images, log_dir=tmp_path / "lazy", extra_args=("--lazy-pages",))
        )
        await asyncio.sleep(1.0)
        # Held back: the restore waits on the first fault of its own (the restorer's), nothing came
        # through, no process went on.
        assert asked, "the daemon asked for no page"
        assert not restore.done()
        assert not (work / "after-parent").exists()
        assert not (work / "after-child").exists()
        gate.set()
        restored_pid = (await asyncio.wait_for(restore, 60)).pid
        for role in ("parent", "child"):
            assert await asyncio.to_thread(wait_file, work / f"after-{role}", 60) == before[role], role
        stats = await asyncio.wait_for(server, 60)
        assert await asyncio.wait_for(daemon.wait(), 30) == 0
    finally:
        ours.close()
        kill_groups(restored_pid)
    # Every lazy page went through the server, once; the restore read the others from the images.
    pages_bytes = sum(p.stat().st_size for p in images.glob("pages-*.img"))
    eager = sum(length for _, _, length in PageIndex(images).eager())
    assert 0 < eager < pages_bytes / 2
    assert stats.bytes == sum(length for _, _, length in asked) == pages_bytes - eager
    assert stats.waited_s >= 0.5  # the gate held the first ask most of the second it was shut


async def test_an_ask_the_images_do_not_hold_is_refused_by_name(criu_bin: Path, tmp_path: Path) -> None:
    _, images, _ = await _dumped(Criu(criu_bin), tmp_path)
    index = PageIndex(images)
    pagemap = next(images.glob("pagemap-*.img"))
    pid = int(pagemap.name.removeprefix("pagemap-").removesuffix(".img"))
    pages_id, entries = read_pagemap(pagemap)
    with pytest.raises(PageServerError, match="no pagemap-999999"):
        index.locate(999999, 0, 1)
    with pytest.raises(PageServerError, match="not in its images"):
        index.locate(pid, PAGE, 1)
    # More pages asked for than the first run holds: only that run's come, the daemon asks again.
    offset = 0
    for vaddr, pages, _ in sorted(entries):
        assert index.locate(pid, vaddr, 1 << 30) == (f"pages-{pages_id}.img", offset, pages)
        if pages > 1:
            assert index.locate(pid, vaddr + PAGE, 1) == (f"pages-{pages_id}.img", offset + PAGE, 1)
        offset += pages * PAGE
