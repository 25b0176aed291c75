"""A restore with ``restore_readers`` (the project's CRIU, scripts/criu-restore-readers.patch) reads each
task's pages with several threads at once and brings back the same bytes, the same thread ids and the same
tree: a parent with threads and more than one 64 MiB piece of dense memory, and a forked child of its own."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu
from tests.helpers.polling import wait_file, wait_for
from tests.helpers.script_process import kill_groups, start_script

# 160 MiB of random bytes in the parent, 200 MiB in a child (four of the readers' 64 MiB pieces), four
# sleeping threads; each process reports the SHA-256 of its memory and its thread ids, before the dump
# and again after the restore.
WORKER = r"""
import hashlib, mmap, os, sys, threading, time
d = sys.argv[1]
who = "parent"
mem = mmap.mmap(-1, 160 << 20, flags=mmap.MAP_PRIVATE)
if os.fork() == 0:
    who = "child"
    mem = mmap.mmap(-1, 200 << 20, flags=mmap.MAP_PRIVATE)
else:
    for _ in range(4):
        threading.Thread(target=lambda: time.sleep(1e6), daemon=True).start()
for off in range(0, len(mem), 1 << 20):
    mem[off:off + (1 << 20)] = os.urandom(1 << 20)

def report(name):
    tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    text = hashlib.sha256(mem[:]).hexdigest() + " " + ",".join(map(str, tids))
    with open(os.path.join(d, f"{who}-{name}.tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(d, f"{who}-{name}.tmp"), os.path.join(d, f"{who}-{name}"))

report("before")
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.02)
report("after")
while True:
    time.sleep(1)
"""


@pytest.mark.criu
@pytest.mark.parametrize("readers", [4, 1])
async def test_pages_read_by_several_threads_come_back_the_same(
    criu_bin: Path, tmp_path: Path, readers: int
) -> None:
    work, images = tmp_path / "work", tmp_path / "images"
    proc = await start_script(WORKER, work)
    restored_pid = None
    squatter: asyncio.subprocess.Process | None = None
    try:
        before = {w: await asyncio.to_thread(wait_file, work / f"{w}-before") for w in ("parent", "child")}
        await Criu(criu_bin).dump(proc.pid, images)
        await proc.wait()
        # The child's pid must be free again before the restore takes it back.
        child = Path("/proc") / before["child"].split()[1].split(",")[0]
        await asyncio.to_thread(wait_for, lambda: not child.exists(), 10.0, f"{child} to go", 0.02)
        # The first id above the tree's is taken: the readers go on to the next ones.
        tree_max = max(int(t) for text in before.values() for t in text.split()[1].split(","))
        squatter = await _process_with_pid(tree_max + 1)
        restored = await Criu(criu_bin, restore_readers=readers).restore(images, log_dir=tmp_path / "logs")
        restored_pid = restored.pid
        log = restored.log_path.read_text()
        # Each task says how many threads read its pages: no more than its pieces (a run of pages is one
        # or more; a forked child's pages shared with its parent are not its own), four here in both.
        counts = [int(n) for n in re.findall(r"pages read by (\d+) threads", log)]
        if readers == 1:
            assert counts == []
        else:
            assert counts == [readers, readers], log[-3000:]
            assert "not started" not in log
        (work / "go").touch()
        for who in ("parent", "child"):
            assert await asyncio.to_thread(wait_file, work / f"{who}-after") == before[who], who
        # The readers are gone: the parent's threads are those it had.
        assert len(os.listdir(f"/proc/{restored.pid}/task")) == 5
    finally:
        kill_groups(proc.pid, restored_pid)
        if squatter is not None:
            squatter.kill()
            await squatter.wait()


async def _process_with_pid(pid: int) -> asyncio.subprocess.Process | None:
    """A sleeping process with ``pid`` (the next pid the kernel gives, set through ns_last_pid); None where
    another process has it already."""
    for _ in range(20):
        if await asyncio.to_thread(os.path.exists, f"/proc/{pid}"):
            return None
        await asyncio.to_thread(Path("/proc/sys/kernel/ns_last_pid").write_text, str(pid - 1))
        proc = await asyncio.create_subprocess_exec("sleep", "60")
        if proc.pid == pid:
            return proc
        proc.kill()
        await proc.wait()
    raise AssertionError(f"could not start a process with pid {pid}: another one took it each time")


def test_a_reader_count_out_of_range_is_refused() -> None:
    for bad in (0, 65, -1):
        with pytest.raises(ValueError, match="restore_readers must be 1 to 64"):
            Criu(restore_readers=bad)
