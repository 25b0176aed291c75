"""A restore with ``restore_huge_pages`` (the project's CRIU, scripts/criu-restore-thp.patch) fills the
densely dumped anonymous memory with transparent huge pages, and brings back the same bytes; without it,
on a host whose huge pages are only for memory that asks, that memory comes back in 4 KiB pages."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from dynamo_snapshot.criu import Criu
from tests.helpers.polling import wait_file
from tests.helpers.script_process import kill_groups, smaps_field, start_script

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# A 16 MiB private anonymous mapping filled with random bytes (never advised for huge pages) and a 1 MiB
# one, too small to be advised; the SHA-256 of both before the dump and after the restore, and where
# the large one is.
WORKER = r"""
import hashlib, mmap, os, sys, time
d = sys.argv[1]
big = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE)
small = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)
for m in (big, small):
    for off in range(0, len(m), 1 << 20):
        m[off:off + (1 << 20)] = os.urandom(1 << 20)

def report(name, text):
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))

def digest():
    return hashlib.sha256(big[:] + small[:]).hexdigest()

import ctypes
report("address", hex(ctypes.addressof(ctypes.c_char.from_buffer(big))))
report("before", digest())
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.02)
report("after", digest())
while True:
    time.sleep(1)
"""


def _thp_mode() -> str:
    found = re.search(r"\[(\w+)\]", THP_ENABLED.read_text()) if THP_ENABLED.exists() else None
    return found.group(1) if found else "never"


def _huge_kib(pid: int, address: int) -> int:
    """AnonHugePages of the mapping of ``pid`` that holds ``address`` (the kernel may have merged it with
    a neighbour of the same kind)."""
    return int(smaps_field(pid, address, "AnonHugePages").split()[0])


@pytest.mark.criu
@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "stock"])
async def test_dense_memory_comes_back_in_huge_pages_with_the_same_bytes(
    criu_bin: Path, tmp_path: Path, huge: bool
) -> None:
    mode = _thp_mode()
    if mode == "never" or (not huge and mode != "madvise"):
        pytest.skip(f"the host's transparent huge pages are {mode!r}")
    work, images = tmp_path / "work", tmp_path / "images"
    proc = await start_script(WORKER, work)
    restored_pid = None
    try:
        before = await asyncio.to_thread(wait_file, work / "before")
        address = int(await asyncio.to_thread(wait_file, work / "address"), 16)
        await Criu(criu_bin).dump(proc.pid, images)
        await proc.wait()
        restored = await Criu(criu_bin, restore_huge_pages=huge).restore(images, log_dir=tmp_path / "logs")
        restored_pid = restored.pid
        huge_kib = _huge_kib(restored.pid, address)
        if huge:
            assert huge_kib >= 2048, "no huge page in the densely filled mapping"
            assert "thp: " in restored.log_path.read_text()
        else:
            assert huge_kib == 0
        (work / "go").touch()
        assert await asyncio.to_thread(wait_file, work / "after") == before
    finally:
        kill_groups(proc.pid, restored_pid)
